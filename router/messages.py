"""Anthropic's Messages API (``POST /v1/messages`` and ``/v1/messages/count_tokens``), as vLLM
serves it: a request runs as a chat request (the same template, tool-call and reasoning parsers,
engines and limits), and its answer comes back as Anthropic's message (content blocks: thinking,
text, tool_use), whole or as Anthropic's event stream. Errors on these paths have Anthropic's
shape (``{"type": "error", "error": {"type", "message"}}``, see ``anthropic_error_body``).

Mapping: ``system`` is the system message; a user turn's ``tool_result`` blocks become tool
messages (before its text); an assistant turn's ``tool_use`` blocks become its tool calls, and its
``thinking`` is its ``reasoning`` (the template shows it or not, as chat's earlier answers);
``stop_sequences`` are stop strings; ``tool_choice`` auto / any / tool / none are OpenAI's auto /
required / named / none (auto by default with tools, which needs ``--enable-auto-tool-choice``);
``thinking`` enabled or disabled is the chat template's ``enable_thinking``; ``metadata.user_id``
is ``user``. A stop string ends the answer with ``stop_reason`` ``stop_sequence`` and names it.
Usage follows Anthropic's accounting: prompt tokens found in an engine's prefix cache are
``cache_read_input_tokens``, the rest ``input_tokens``.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from router.parsed_output import ParsedDelta, calls_around_text, merge_tool_call_deltas
from router.protocol import ChatCompletionRequest, _warn_ignored
from router.serving import (
    APIError,
    ChatRun,
    OpenAIServing,
    SSEStream,
    _StreamError,
    api_error_of,
    bad_request,
    chat_request_from,
    conversation_chars,
    parsed_whole,
    required_text,
)
from router.serving import (
    named_sse_event as _sse,
)

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"

# OpenAI-shaped error types (the app's) to Anthropic's.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
# Chat parameters named by errors past validation, and the Messages parameters they come from.
_CHAT_TO_MESSAGES_PARAM = {"max_completion_tokens": "max_tokens", "max_tokens": "max_tokens",
                           "stop": "stop_sequences", "chat_template_kwargs": "thinking", "user": "metadata",
                           "response_format": "output_config"}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """An error as Anthropic's API answers it (its client raises by status and shows the message)."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


# Anthropic's thinking settings (its client's ThinkingConfigParam kinds).
_THINKING_TYPES = ("enabled", "adaptive", "between_tools", "disabled")


class _MessagesInput(BaseModel):
    """What a Messages request and a token count share: the conversation and its tools."""

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _note_ignored(self) -> _MessagesInput:
        _warn_ignored(type(self).__name__, list(self.model_extra or ()))
        return self

    def chat_body(self) -> dict[str, Any]:
        """The chat request's fields for this conversation. One that ends with the assistant's text
        (a prefill) is continued from it, as Anthropic answers it: the answer is what follows."""
        messages = self._chat_messages()
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        last = messages[-1]
        if last["role"] == "assistant" and last.get("content") and not last.get("tool_calls"):
            if (self.output_config or {}).get("format") is not None:  # (the format would follow the prefill)
                raise bad_request("a final assistant turn (a prefill) cannot be combined with output_config.format",
                                  "output_config")
            body.update(add_generation_prompt=False, continue_final_message=True)
        if self.tools:
            body["tools"] = [_tool(i, tool) for i, tool in enumerate(self.tools)]
        choice = self.tool_choice
        if choice is not None:
            kind = choice.get("type")
            if kind in ("auto", "any", "none"):
                body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
            elif kind == "tool" and isinstance(choice.get("name"), str) and choice["name"]:
                body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
            else:
                raise bad_request('tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or '
                                  '{"type": "tool", "name": ...}', "tool_choice")
            if choice.get("disable_parallel_tool_use"):
                body["parallel_tool_calls"] = False
        if self.thinking is not None:
            kind = self.thinking.get("type")
            if kind not in _THINKING_TYPES:
                raise bad_request(f"thinking type must be one of {', '.join(_THINKING_TYPES)}", "thinking")
            # ("between_tools" is thinking switched off but for notes between tool calls, which a
            # template has no switch for: off.)
            body["chat_template_kwargs"] = {"enable_thinking": kind in ("enabled", "adaptive")}
        if self.output_config is not None:
            fields = _output_config(self.output_config)
            kwargs = {**body.get("chat_template_kwargs", {}), **fields.pop("chat_template_kwargs", {})}
            body.update(fields, **({"chat_template_kwargs": kwargs} if kwargs else {}))
        return body

    def _chat_messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        # The top-level system, then any system messages among the turns (the SDK types them), as one.
        system = [self.system if isinstance(self.system, str) else _block_text(self.system, "system")] \
            if self.system else []
        for i, message in enumerate(self.messages):
            if message.get("role") == "system":
                system.append(_block_text(message.get("content") or "", f"messages[{i}].content"))
        if system:
            out.append({"role": "system", "content": "\n\n".join(system)})
        if all(message.get("role") == "system" for message in self.messages):
            raise bad_request("messages must hold a user turn, not system messages alone", "messages")
        for i, message in enumerate(self.messages):
            where = f"messages[{i}]"
            role = message.get("role")
            if role == "system":
                continue
            if role not in ("user", "assistant"):
                raise bad_request(f"{where}.role must be user, assistant or system", "messages")
            content = message.get("content")
            if isinstance(content, str):
                out.append({"role": role, "content": content})
                continue
            if not isinstance(content, list) or not content:
                raise bad_request(f"{where}.content must be a string or a non-empty list of content blocks",
                                  "messages")
            texts: list[str] = []
            thinking: list[str] = []
            calls: list[dict[str, Any]] = []
            # A user turn's text and images in order, as OpenAI parts (when it has images).
            parts: list[dict[str, Any]] = []
            for j, block in enumerate(content):
                kind = block.get("type") if isinstance(block, dict) else None
                at = f"{where}.content[{j}]"
                if kind == "text" and isinstance(block.get("text"), str):
                    texts.append(block["text"])
                    parts.append({"type": "text", "text": block["text"]})
                elif kind == "image" and role == "user":
                    parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), at)}})
                elif kind == "tool_use" and role == "assistant":
                    calls.append({"id": _required(block, "id", at), "type": "function",
                                  "function": {"name": _required(block, "name", at),
                                               "arguments": json.dumps(block.get("input") or {})}})
                elif kind == "tool_result" and role == "user":
                    out.append({"role": "tool", "tool_call_id": _required(block, "tool_use_id", at),
                                "content": _block_text(block.get("content") or "", f"{at}.content", "\n")})
                elif kind == "thinking" and role == "assistant":
                    # An earlier answer's thinking, as the chat endpoint takes it back (vLLM's
                    # Messages does too): the template decides whether to show it.
                    if isinstance(block.get("thinking"), str):
                        thinking.append(block["thinking"])
                elif kind == "redacted_thinking" and role == "assistant":
                    continue  # (encrypted: nothing a template could show)
                else:
                    raise bad_request(f"{at}: {role} blocks of type {kind!r} are not supported "
                                      "(text; tool_use and thinking from the assistant; image and tool_result from "
                                      "the user)", "messages")
            if role == "assistant":
                turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls
                                        else None}
                if calls:
                    turn["tool_calls"] = calls
                if thinking:
                    turn["reasoning"] = "".join(thinking)
                out.append(turn)
            elif len(parts) > len(texts):  # (images: the parts in order)
                out.append({"role": "user", "content": parts})
            elif texts:
                out.append({"role": "user", "content": texts[0] if len(texts) == 1
                            else [{"type": "text", "text": t} for t in texts]})
        return out

    def chat_request(self, **fields: Any) -> ChatCompletionRequest:
        return chat_request_from({**self.chat_body(), **fields}, _CHAT_TO_MESSAGES_PARAM, "messages")


class MessagesRequest(_MessagesInput):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None

    def to_chat(self) -> ChatCompletionRequest:
        user = (self.metadata or {}).get("user_id")
        fields: dict[str, Any] = {"max_completion_tokens": self.max_tokens, "stop": self.stop_sequences,
                                  "stream": self.stream, "user": user if isinstance(user, str) else None}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        return self.chat_request(**fields)


class CountTokensRequest(_MessagesInput):
    """``POST /v1/messages/count_tokens``: the prompt a Messages request would have, counted."""


def _output_config(output: Any) -> dict[str, Any]:
    """The chat fields of Anthropic's ``output_config`` (the SDK's ``messages.parse`` sends it):
    ``format`` a JSON schema the answer follows (chat's response_format), ``effort`` the reasoning
    effort the chat template is given."""
    if not isinstance(output, dict):
        raise bad_request("output_config must be an object", "output_config")
    fields: dict[str, Any] = {}
    form = output.get("format")
    if form is not None:
        if not isinstance(form, dict) or form.get("type") != "json_schema" or not isinstance(form.get("schema"), dict):
            raise bad_request('output_config.format must be {"type": "json_schema", "schema": {...}}', "output_config")
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": form["schema"]}}
    if isinstance(output.get("effort"), str):
        fields["chat_template_kwargs"] = {"reasoning_effort": output["effort"]}
    return fields


def _tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    kind = tool.get("type", "custom")
    if kind != "custom" or not isinstance(tool.get("name"), str):
        raise bad_request(f"tools[{i}]: only client tools ({{name, description, input_schema}}) are supported, "
                          f"not {kind!r}", "tools")
    function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _required(block: dict[str, Any], key: str, where: str) -> str:
    return required_text(block, key, where, "messages")


def _block_text(content: Any, where: str, separator: str = "") -> str:
    """Text content: a string, or text blocks (joined by ``separator``: a tool result's blocks by
    lines, as vLLM joins them)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                         and isinstance(b.get("text"), str) for b in content):
        return separator.join(b["text"] for b in content)
    raise bad_request(f"{where} must be a string or a list of text blocks", "messages" if "messages" in where
                      else "system")


def _error_event(error: Exception) -> str:
    """Anthropic's error event (an engine failure, a timeout, or anything else mid-answer)."""
    return _sse({"type": "error", "error": {"type": "api_error", "message": api_error_of(error).message}})


@dataclass
class _Blocks:
    """The answer's content blocks as they stream: one open at a time (thinking, text, a tool call);
    each change of kind closes the open block and starts the next."""

    events: list[str] = field(default_factory=list)
    count: int = 0
    open_kind: str | None = None  # "thinking", "text", or a tool call's index as "call:<i>"
    called: bool = False  # a tool_use block was started

    def _start(self, kind: str, block: dict[str, Any]) -> None:
        self.close()
        self.open_kind = kind
        self.events.append(_sse({"type": "content_block_start", "index": self.count, "content_block": block}))

    def _delta(self, delta: dict[str, Any]) -> None:
        self.events.append(_sse({"type": "content_block_delta", "index": self.count, "delta": delta}))

    def close(self) -> None:
        if self.open_kind is not None:
            self.events.append(_sse({"type": "content_block_stop", "index": self.count}))
            self.count += 1
            self.open_kind = None

    def add(self, parsed: ParsedDelta) -> None:
        if parsed.reasoning:
            if self.open_kind != "thinking":
                self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self._delta({"type": "thinking_delta", "thinking": parsed.reasoning})
        writing = int(self.open_kind[5:]) if self.open_kind and self.open_kind.startswith("call:") else None
        before, after = calls_around_text(parsed.tool_calls, writing)
        for call in before:
            self._call(call)
        if parsed.content:
            if self.open_kind != "text":
                self._start("text", {"type": "text", "text": ""})
            self._delta({"type": "text_delta", "text": parsed.content})
        for call in after:
            self._call(call)

    def _call(self, call: dict[str, Any]) -> None:
        kind = f"call:{call['index']}"
        if "id" in call:
            self.called = True
            self._start(kind, {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}})
        arguments = call["function"].get("arguments") or ""
        if arguments and self.open_kind == kind:  # (a closed block takes no more: Anthropic's rule)
            self._delta({"type": "input_json_delta", "partial_json": arguments})

    def take(self) -> list[str]:
        events, self.events = self.events, []
        return events


class MessagesServing:
    """Anthropic's Messages API over an OpenAIServing's chat path."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, request: MessagesRequest, session_id: str | None = None) -> dict[str, Any] | SSEStream:
        chat = request.to_chat()
        run = await self.serving.start_chat_as(chat, session_id, f"msg_{uuid.uuid4().hex}", _CHAT_TO_MESSAGES_PARAM)
        model = self.serving.model_name(request.model)
        if request.stream:
            return SSEStream(self._stream(run, model), run.streams, _error_event)
        await self.serving.finish_chat(run)
        parsed = parsed_whole(run.choices[0])
        content: list[dict[str, Any]] = []
        if parsed.reasoning:
            content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
        if parsed.content:
            content.append({"type": "text", "text": parsed.content})
        for call in merge_tool_call_deltas(parsed.tool_calls):
            try:
                arguments = json.loads(call["function"]["arguments"] or "{}")
            except ValueError:
                continue  # a call cut off by max_tokens: not a whole call
            content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                            "input": arguments})
        called = any(block["type"] == "tool_use" for block in content)
        stop_reason, stop_sequence = self._stop(run, called)
        return {"id": run.request_id, "type": "message", "role": "assistant", "model": model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": self._usage(run)}

    def _stop(self, run: ChatRun, called: bool) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of a finished run (``called``: its answer calls tools, also
        under a named tool_choice, as Anthropic says ``tool_use`` then); an aborted answer is a
        server error."""
        choice = run.choices[0]
        finish = choice.finish_reason
        if called and finish == "stop":
            return "tool_use", None
        if finish == "stop" and isinstance(choice.stop_reason, str):
            return "stop_sequence", choice.stop_reason
        if finish in ("stop", "length"):
            return ("max_tokens" if finish == "length" else "end_turn"), None
        raise APIError(500, choice.error or "the engine aborted the request", "InternalServerError")

    @staticmethod
    def _usage(run: ChatRun, output_tokens: int | None = None) -> dict[str, Any]:
        choice = run.choices[0]
        cached = choice.num_cached_tokens
        return {"input_tokens": len(run.prompt_ids) - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached,
                "output_tokens": len(choice.token_ids) if output_tokens is None else output_tokens}

    async def _stream(self, run: ChatRun, model: str) -> AsyncIterator[str]:
        start = {"id": run.request_id, "type": "message", "role": "assistant", "model": model, "content": [],
                 "stop_reason": None, "stop_sequence": None, "usage": self._usage(run, 0)}
        yield _sse({"type": "message_start", "message": start})
        blocks = _Blocks()
        try:
            async with contextlib.aclosing(self.serving.parsed_deltas(run)) as deltas:
                async for parsed, _ in deltas:
                    blocks.add(parsed)
                    if blocks.events:
                        yield "".join(blocks.take())
            stop_reason, stop_sequence = self._stop(run, blocks.called)
        except (_StreamError, APIError) as e:
            blocks.close()
            yield "".join([*blocks.take(), _error_event(e)])
            return
        blocks.close()
        usage = self._usage(run)
        yield "".join([*blocks.take(), _sse({"type": "message_delta", "delta": {
            "stop_reason": stop_reason, "stop_sequence": stop_sequence}, "usage": {
            "output_tokens": usage["output_tokens"], "input_tokens": usage["input_tokens"],
            "cache_read_input_tokens": usage["cache_read_input_tokens"]}}), _sse({"type": "message_stop"})])

    async def count_tokens(self, request: CountTokensRequest, session_id: str | None = None) -> dict[str, Any]:
        """The prompt's tokens as a Messages request with this conversation would send them."""
        await self.serving.resolve_model(request.model)
        chat = request.chat_request()
        ids = await self.serving.tokenizer_work(conversation_chars(chat.messages, chat.tools), self.serving.render_chat,
                                                chat)
        # (Images count as their placeholders, as the request would send them.)
        ids, _ = await self.serving.prompt_images(self.serving.chat_images(chat.messages), ids, count_only=True)
        return {"input_tokens": len(ids)}

def _image_url(source: Any, at: str) -> str:
    """An image block's source as the URL the chat endpoint takes: ``{"type": "base64", "media_type",
    "data"}`` as a data: URL, ``{"type": "url", "url"}`` as it is."""
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str):
        media_type = source.get("media_type")
        if not isinstance(media_type, str) or not media_type.startswith("image/"):
            raise bad_request(f"{at}.source.media_type must be an image type (image/png, ...)", "messages")
        return f"data:{media_type};base64,{source['data']}"
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise bad_request(f'{at}.source must be {{"type": "base64", "media_type", "data"}} or {{"type": "url", "url"}}',
                      "messages")
