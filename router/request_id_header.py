"""vLLM's --enable-request-id-headers: every answer carries an ``X-Request-Id`` header, the one the
request came with (a gateway's trace id, say) or a new one, so a client or proxy can name the request
in the server's logs. Plain ASGI: the header is added to the response's start message; the wrapper
passes every other message (each streamed chunk) straight on."""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"


class RequestIdHeader:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = next((value for key, value in scope["headers"] if key == HEADER and value), None)
        if request_id is None:
            request_id = uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
