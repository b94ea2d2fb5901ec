"""``--tool-call-parser minimax_m2`` (MiniMax-M2, M2.1): calls in XML-like blocks after the content,

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    </minimax:tool_call>

read as vLLM's minimax_m2 parser reads them:

- The content is the text before the first block; text between and after blocks is not content.
  A block holding no call is text (content) after all, as vLLM answers such an output.
- A call is released whole once its ``</invoke>`` arrives (vLLM streams it so too); one cut off
  before it is not a call. Names are read up to ``>``, their quotes dropped.
- Values (blanks around them dropped) are read by the types the request's tool gives the parameter
  (``minimax_m2_value``): ``null`` / ``none`` / ``nil`` are null; integers, numbers, booleans and
  objects or arrays where the text is one, else the next type the schema allows, a string as
  written; a parameter the tool does not declare is a string.
"""

from __future__ import annotations

import json
from typing import Any

from router.parsed_output import ParsedDelta, partial_suffix
from router.tool_parsers import SteppedToolCallParser, tool_properties


class MiniMaxM2ToolCallParser(SteppedToolCallParser):
    free_form = True

    START, END = "<minimax:tool_call>", "</minimax:tool_call>"
    INVOKE, INVOKE_END = "<invoke name=", "</invoke>"
    PARAMETER, PARAMETER_END = "<parameter name=", "</parameter>"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__()
        self._properties = tool_properties(tools)
        self._state = "content"  # content (before the first block), block (in one), between (after one)
        self._held = ""  # a block's text while it has no call (content, should it end with none)
        # In a block: where the current call starts (-1: not found yet); _searched: how much of the
        # pending text was searched without finding what ends it (the pending text only grows meanwhile).
        self._invoke_at = -1

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._state == "content":
            self._content.add(self._pending, out)
        elif self._state == "block" and not self.calls:  # a block cut off without a call: text
            self._content.add(self._held + self._pending, out)
        self._end_content(out)
        self._pending, self._held, self._state = "", "", "content"
        return out

    def _step(self, out: ParsedDelta) -> bool:
        text = self._pending
        if self._state == "content":
            if not self._content_until(self.START, out):
                return False
            self._held, self._state = self.START, "block"
            return True
        if self._state == "between":  # (text between blocks is not content)
            at = text.find(self.START)
            if at < 0:
                self._pending = text[len(text) - partial_suffix(text, self.START):]
                return False
            self._pending, self._held, self._state = text[at + len(self.START):], self.START, "block"
            return True
        # In a block: the next complete call, or the block's end (a call it cuts off is none).
        if self._invoke_at < 0:
            self._invoke_at = text.find(self.INVOKE, max(0, self._searched - len(self.INVOKE) + 1))
        start = self._invoke_at
        close = (text.find(self.INVOKE_END, max(start, self._searched - len(self.INVOKE_END) + 1)) if start >= 0
                 else -1)
        end = text.find(self.END, max(0, self._searched - len(self.END) + 1))
        self._searched = len(text)
        if end >= 0 and (close < 0 or end < close):
            if not self.calls:  # a block without a call is text
                self._content.add(self._held + text[:end + len(self.END)], out)
                self._state = "content"
            else:
                self._state = "between"
            self._pending, self._held = text[end + len(self.END):], ""
            self._invoke_at, self._searched = -1, 0
            return True
        if close < 0:
            return False  # (the call, or the block's end, is still coming)
        call = self._call(text[start + len(self.INVOKE):close])
        if call is not None:
            self._content.drop()
            out.tool_calls.append(call)
            self._held = ""
        elif not self.calls:
            self._held += text[:close + len(self.INVOKE_END)]
        self._pending = text[close + len(self.INVOKE_END):]
        self._invoke_at, self._searched = -1, 0
        return True

    def _call(self, body: str) -> dict[str, Any] | None:
        """A call from an invoke's body (``"NAME">`` then its parameters), None without a name."""
        head, sep, rest = body.partition(">")
        name = _unquoted(head)
        if not sep or not name:
            return None
        schemas = self._properties.get(name, {})
        arguments: dict[str, Any] = {}
        at = rest.find(self.PARAMETER)
        while at >= 0:  # (each parameter ends at the first </parameter> after it, as vLLM reads them)
            end = rest.find(self.PARAMETER_END, at)
            if end < 0:
                break
            key, sep, raw = rest[at + len(self.PARAMETER):end].partition(">")
            key = _unquoted(key)
            if sep and key:
                arguments[key] = minimax_m2_value(raw.strip(), schemas.get(key))
            at = rest.find(self.PARAMETER, end + len(self.PARAMETER_END))
        return self._start_call(name, json.dumps(arguments, ensure_ascii=False))


def _unquoted(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


def schema_types(schema: Any) -> set[str]:
    """The types a parameter's JSON schema allows (``type``, an ``enum``'s values' types, and
    ``anyOf`` / ``oneOf`` / ``allOf``'s), lower-cased; a string where it names none."""
    if not isinstance(schema, dict):
        return {"string"}
    types: set[str] = set()
    declared = schema.get("type")
    for kind in declared if isinstance(declared, list) else [declared]:
        if isinstance(kind, str):
            types.add(kind.lower())
    for value in schema.get("enum") or () if isinstance(schema.get("enum"), list) else ():
        types.add("null" if value is None else "boolean" if isinstance(value, bool)
                  else "integer" if isinstance(value, int) else "number" if isinstance(value, float)
                  else "string" if isinstance(value, str) else "array" if isinstance(value, list) else "object")
    for key in ("anyOf", "oneOf", "allOf"):
        for option in schema.get(key) or () if isinstance(schema.get(key), list) else ():
            types |= schema_types(option)
    return types or {"string"}


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def minimax_m2_value(raw: str, schema: Any) -> Any:
    """A MiniMax-M2 parameter's text as vLLM's minimax_m2 parser reads it: null words are null; then
    the first type of integer, number, boolean, object / array and string that the schema allows
    and the text is; where none fits, JSON, else the text."""
    if raw.lower() in ("null", "none", "nil"):
        return None
    types = schema_types(schema)
    for kind in ("integer", "int", "number", "float", "boolean", "bool", "object", "array", "string", "str", "text"):
        if kind not in types:
            continue
        if kind in ("string", "str", "text"):
            return raw
        if kind in ("integer", "int"):
            try:
                return int(raw)
            except ValueError:
                continue
        if kind in ("number", "float"):
            try:
                number = float(raw)
            except ValueError:
                continue
            if number != number or number in (float("inf"), float("-inf")):
                continue  # (JSON carries neither)
            return int(number) if number.is_integer() else number
        if kind in ("boolean", "bool"):
            if raw.lower() in _TRUE or raw.lower() in _FALSE:
                return raw.lower() in _TRUE
            continue
        if kind in ("object", "array"):
            try:
                return _json(raw)
            except ValueError:
                continue
    try:
        return _json(raw)
    except ValueError:
        return raw


def _refuse(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _json(raw: str) -> Any:
    """JSON text's value (NaN and the infinities refused: no JSON answer can carry them; nesting
    too deep to read is no value either)."""
    try:
        return json.loads(raw, parse_constant=_refuse)
    except RecursionError:
        raise ValueError("nested too deeply") from None
