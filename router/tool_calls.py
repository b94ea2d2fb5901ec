"""Tool calling for /v1/chat/completions: the output constraint a ``tool_choice`` needs, and the
parsers that turn a choice's generated text into OpenAI ``tool_calls``, streamed or whole.

- ``tool_choice`` naming a function: the output is constrained to that function's ``parameters``
  schema, and the whole text is the call's ``arguments`` (finish reason ``stop``, as OpenAI gives
  for a forced function).
- ``"required"``: the output is constrained to a JSON array of ``{"name", "parameters"}`` objects
  (one of the tools each; at most one when ``parallel_tool_calls`` is false); each element is a call.
- ``"auto"``: the model decides, in its own format, read by the server's ``--tool-call-parser``
  (``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as Hermes and Qwen
  models write it); text outside the tags is the message's content.

Every parser is incremental: ``feed(text)`` returns what can be released now (content and
tool-call deltas, in OpenAI's streamed shape), ``finish()`` what is left. A whole response runs the
same parser over the whole text (``collect``), so streamed and whole responses agree.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_PARSERS = ("hermes",)


def random_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema; a function without one (or with ``{}``) takes an object, as in
    vLLM (an empty schema would let any JSON value through as the arguments)."""
    params = tool["function"].get("parameters")
    return params if params else {"type": "object", "properties": {}}


def tool_choice_constraint(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any],
                           parallel_tool_calls: bool) -> dict[str, Any] | None:
    """The structured-output spec (engine form) a tool choice needs, or None (``none``, ``auto``)."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        tool = next(t for t in tools if t["function"]["name"] == name)
        return {"json": tool_parameters(tool)}
    if tool_choice != "required":
        return None
    one_call = [{"type": "object",
                 "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                "parameters": tool_parameters(t)},
                 "required": ["name", "parameters"]} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_call}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return {"json": schema}


@dataclass
class ToolDelta:
    """What a parser releases: message content, and tool-call deltas as OpenAI streams them
    (``{"index", "id", "type", "function": {"name", "arguments"}}`` first, then
    ``{"index", "function": {"arguments"}}`` for more of the same call's arguments)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def extend(self, other: ToolDelta) -> None:
        self.content += other.content
        self.tool_calls += other.tool_calls


class ToolCallParser:
    """Base: passes text through as content. ``calls`` counts the calls released so far."""

    finish_reason_on_call = "tool_calls"

    def __init__(self) -> None:
        self.calls = 0

    def feed(self, text: str) -> ToolDelta:
        return ToolDelta(content=text)

    def finish(self) -> ToolDelta:
        return ToolDelta()

    def _start_call(self, name: str, arguments: str) -> dict[str, Any]:
        call = {"index": self.calls, "id": random_tool_call_id(), "type": "function",
                "function": {"name": name, "arguments": arguments}}
        self.calls += 1
        return call


class NamedToolCallParser(ToolCallParser):
    """tool_choice names one function: all the text is its arguments."""

    finish_reason_on_call = "stop"

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> ToolDelta:
        if not text:
            return ToolDelta()
        if self.calls == 0:
            return ToolDelta(tool_calls=[self._start_call(self.name, text)])
        return ToolDelta(tool_calls=[{"index": 0, "function": {"arguments": text}}])

    def finish(self) -> ToolDelta:
        # Even an empty answer is a call to the named function (with empty arguments).
        return ToolDelta(tool_calls=[self._start_call(self.name, "")]) if self.calls == 0 else ToolDelta()


class RequiredToolCallParser(ToolCallParser):
    """tool_choice "required": the text is a JSON array of ``{"name": ..., "parameters": {...}}``.

    A character scanner (strings and nesting only; it needs no complete JSON): a call is released
    once its name has been read, then its ``parameters`` value's text as it arrives."""

    def __init__(self) -> None:
        super().__init__()
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._expecting_key = False  # inside an element, before a key
        self._capture: list[str] | None = None  # a key or the name being read (raw JSON string text)
        self._capturing_key = False
        self._new_element()

    def _new_element(self) -> None:
        self._key: str | None = None  # the element's last key read
        self._name: str | None = None
        self._index: int | None = None  # the call's index once released
        self._args: list[str] = []  # parameters text not released yet
        self._args_state = "before"  # before, in, done
        self._args_seen = False  # a non-blank character of the parameters value was read

    def feed(self, text: str) -> ToolDelta:
        out = ToolDelta()
        for ch in text:
            if self._step(ch):  # a new element starts: release what is left of the previous one
                self._release(out)
                self._new_element()
        self._release(out)
        return out

    def _release(self, out: ToolDelta) -> None:
        if self._name is None:
            return
        args = "".join(self._args)
        self._args = []
        if self._index is None:
            out.tool_calls.append(self._start_call(self._name, args))
            self._index = self.calls - 1
        elif args:
            out.tool_calls.append({"index": self._index, "function": {"arguments": args}})

    def _step(self, ch: str) -> bool:
        """Scan one character; True when it opens a new element."""
        args_in = self._args_state == "in"
        if self._in_string:
            if args_in:
                self._args.append(ch)
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
                if self._capture is not None:
                    self._end_capture()
                elif args_in and self._depth == 2:  # a string value ended
                    self._args_state = "done"
                return False
            if self._capture is not None:
                self._capture.append(ch)
            return False
        if args_in:
            if self._depth == 2 and ch in ",}":  # a scalar value ended; the character is structure
                self._args_state = "done"
                args_in = False
            elif self._args_seen or not ch.isspace():
                self._args.append(ch)
                self._args_seen = True
        if ch == '"':
            self._in_string = True
            if self._depth == 2 and not args_in and (self._expecting_key or self._key == "name"):
                self._capture, self._capturing_key = [], self._expecting_key
        elif ch in "[{":
            self._depth += 1
            if self._depth == 2:
                self._expecting_key = True
                return True
        elif ch in "]}":
            self._depth -= 1
            if args_in and self._depth == 2:
                self._args_state = "done"
        elif self._depth == 2 and not args_in:
            if ch == ":":
                self._expecting_key = False
                if self._key == "parameters" and self._args_state == "before":
                    self._args_state = "in"
            elif ch == ",":
                self._expecting_key = True
        return False

    def _end_capture(self) -> None:
        assert self._capture is not None
        try:
            text = json.loads('"' + "".join(self._capture) + '"')
        except ValueError:
            text = "".join(self._capture)
        if self._capturing_key:
            self._key = text
        elif self._name is None:
            self._name = text
        self._capture = None


class HermesToolCallParser(ToolCallParser):
    """``auto`` with ``--tool-call-parser hermes``: ``<tool_call>{"name", "arguments"}</tool_call>``
    blocks are calls, the rest is content. Text that may be the start of a tag is held back; a call
    is released whole when its closing tag arrives. A block that is not such JSON stays content.
    Blank text after a call (the newline between two calls) is held back until other text follows,
    so a reply of calls alone has no content. With ``parallel_tool_calls`` false, calls after the
    first are dropped (as vLLM keeps only the first)."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, parallel_tool_calls: bool = True) -> None:
        super().__init__()
        self.parallel_tool_calls = parallel_tool_calls
        self._pending = ""  # content that may be the start of a tag, or a call's body
        self._in_call = False
        self._blank = ""  # blank content after a call, not released yet

    def feed(self, text: str) -> ToolDelta:
        self._pending += text
        out = ToolDelta()
        while True:
            if self._in_call:
                end = self._pending.find(self.END)
                if end < 0:
                    return out
                self._emit_call(self._pending[:end], closed=True, out=out)
                self._pending = self._pending[end + len(self.END):]
                self._in_call = False
                continue
            start = self._pending.find(self.START)
            if start >= 0:
                self._add_content(self._pending[:start], out)
                self._pending = self._pending[start + len(self.START):]
                self._in_call = True
                continue
            keep = partial_suffix(self._pending, self.START)
            self._add_content(self._pending[:len(self._pending) - keep], out)
            self._pending = self._pending[len(self._pending) - keep:]
            return out

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        if self._in_call:  # no closing tag (the model stopped right after the JSON, or was cut off)
            self._emit_call(self._pending, closed=False, out=out)
        else:
            self._add_content(self._pending, out)
        self._pending, self._in_call, self._blank = "", False, ""  # blank text after the last call is dropped
        return out

    def _add_content(self, text: str, out: ToolDelta) -> None:
        if self.calls and not (self._blank + text).strip():
            self._blank += text
            return
        out.content += self._blank + text
        self._blank = ""

    def _emit_call(self, body: str, closed: bool, out: ToolDelta) -> None:
        try:
            call = json.loads(body)
            name, arguments = call["name"], call.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError(name)
        except (ValueError, TypeError, KeyError):
            self._add_content(self.START + body + (self.END if closed else ""), out)
            return
        self._blank = ""
        if self.calls and not self.parallel_tool_calls:
            return
        out.tool_calls.append(self._start_call(name, json.dumps(arguments, ensure_ascii=False)))


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def create_tool_call_parser(tool_choice: str | dict[str, Any], server_parser: str | None,
                            parallel_tool_calls: bool = True) -> ToolCallParser | None:
    """The parser a chat request's effective ``tool_choice`` needs (None: plain content)."""
    if isinstance(tool_choice, dict):
        return NamedToolCallParser(tool_choice["function"]["name"])
    if tool_choice == "required":
        return RequiredToolCallParser()
    if tool_choice == "auto":
        if server_parser == "hermes":
            return HermesToolCallParser(parallel_tool_calls)
        raise ValueError(f"unknown tool call parser {server_parser!r}")
    return None


def collect(parser: ToolCallParser, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer: its content (None when it is only tool calls) and its complete tool calls."""
    out = parser.feed(text)
    out.extend(parser.finish())
    calls = merge_tool_call_deltas(out.tool_calls)
    content = out.content if out.content.strip() or not calls else None
    return content, calls


def merge_tool_call_deltas(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Streamed tool-call deltas merged into whole calls (``{"id", "type", "function"}``)."""
    calls: list[dict[str, Any]] = []
    for delta in deltas:
        if "id" in delta:
            calls.append({"id": delta["id"], "type": "function",
                          "function": {"name": delta["function"]["name"], "arguments": delta["function"]["arguments"]}})
        else:
            calls[delta["index"]]["function"]["arguments"] += delta["function"]["arguments"]
    return calls
