"""vLLM's ``--enable-server-load-tracking``: how many requests a router replica is answering on
the paths that make the engines work, read by ``GET /load``."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from router.paths import route_path


@dataclass
class ServerLoad:
    count: int = 0


class ServerLoadTracker:
    """Counts each request on ``paths`` from its start to the end of its (streamed) body, as plain
    ASGI (nothing per streamed chunk)."""

    def __init__(self, app: ASGIApp, load: ServerLoad, paths: Collection[str]) -> None:
        self.app = app
        self.load = load
        self.paths = frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) not in self.paths:
            await self.app(scope, receive, send)
            return
        self.load.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.count -= 1
