"""``--tool-call-parser glm45``: tool calls as GLM-4.5, 4.6 and 4.7 write them (vLLM's ``glm45``)::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

The function's name is the first line of the block (GLM-4.7 may write the first ``<arg_key>`` on the
same line); each argument is a key and a value, the value read by the type the request's tool gives
the parameter: a ``string`` parameter's value exactly as written, any other (or a parameter the tool
does not declare) as JSON, else as a Python literal, else as its text without the blanks around it
(vLLM's rules). Text outside the blocks is content, as with hermes.

Incremental as every parser here. A call is released once its name's line has ended and its first
``<arg_key>`` or ``</tool_call>`` follows (a "name" with blanks, quotes, braces or angle brackets in
it is not one, nor is a line followed by anything else, prose or another ``<tool_call>``: such a
block is content, released as it comes). Its arguments go out as a JSON object that grows by one
``"key": value`` as each value ends; a ``string`` parameter's value streams as it is written (a long
file's contents arrive as the model writes them, as vLLM streams them). A block cut off keeps what
it got: the value being written ends where the text does, and the object is closed.
"""

from __future__ import annotations

import json
from typing import Any

from router.parsed_output import ParsedDelta, partial_suffix
from router.tool_parsers import SteppedToolCallParser, json_safe, python_literal, tool_properties


def glm45_value(raw: str, schema: Any) -> Any:
    """An argument's text as GLM-4.5's parser reads it: a ``string`` parameter's as written; any
    other's as JSON, else as a Python literal, else its text (stripped). A value JSON cannot carry
    (NaN, a set) stays its text."""
    if _is_string(schema):
        return raw
    text = raw.strip()
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        value = python_literal(text, text)
    return json_safe(value, text)


class Glm45ToolCallParser(SteppedToolCallParser):
    free_form = True

    START, END = "<tool_call>", "</tool_call>"
    KEY, KEY_END = "<arg_key>", "</arg_key>"
    VALUE, VALUE_END = "<arg_value>", "</arg_value>"
    # Characters no function name has (after the blanks around it are dropped).
    NOT_IN_NAMES = frozenset("{}<>\"' \t\r")

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__()
        self._properties = tool_properties(tools)
        # content; name (the block's first line), named (the name read, its first key or the block's
        # end awaited), text (a block that is no call), body, key, before_value, value
        self._state = "content"
        self._block = ""  # the block's text until its call is known (content if it is none)
        self._name = ""
        self._call_properties: dict[str, Any] = {}  # the current call's function's parameters
        self._key = ""  # the argument being read
        self._keys = 0  # arguments released in the current call
        self._string = False  # the value being read is a string parameter's, streamed as it comes

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        state, rest = self._state, self._pending
        if state == "content":
            self._content.add(rest, out)
        elif state in ("name", "text"):  # (a name cut off is no call: the block is text)
            self._content.add(self._block + rest, out)
        elif state == "named":  # cut off after the name's line: a call without arguments
            self._open_call(out)
        elif state == "value":  # cut off in a value: it ends where the text does (less a tag begun)
            self._value_text(rest[:len(rest) - max(partial_suffix(rest, t) for t in (self.VALUE_END, self.END))],
                             True, out)
        if state in ("named", "body", "key", "before_value", "value"):
            self._close_call(out)
        self._end_content(out)
        self._pending, self._block, self._state = "", "", "content"
        return out

    _ENDS = {"name": ("\n", KEY, END), "named": (KEY, END, START), "text": (END, START), "body": (KEY, END),
             "key": (KEY_END, END), "before_value": (VALUE, KEY, END), "value": (VALUE_END, END)}

    def _step(self, out: ParsedDelta) -> bool:
        """Consume what the pending text decides in the current state: True when the state changed
        (there may be more to read), False when the rest must wait for more text."""
        state, text = self._state, self._pending
        if state == "content":
            if not self._content_until(self.START, out):
                return False
            self._block, self._state = self.START, "name"
            return True
        if state == "named":  # after the name's line, anything but a key or the block's end: text
            kept = text.lstrip()
            if kept and not any(kept.startswith(t) or t.startswith(kept) for t in self._ENDS["named"]):
                self._state, self._searched = "text", 0
                return True
        if state == "name" and text[:1].isspace():  # (blanks before the name: layout)
            kept = text.lstrip()
            self._block += text[:len(text) - len(kept)]
            self._pending = text = kept
            if not kept:
                return False
        tags = self._ENDS[state]
        at, tag = self._until(tags)
        if at < 0:
            if state == "name":  # a character no name has: the block is text already
                keep = max(partial_suffix(text, t) for t in tags)
                if any(ch in self.NOT_IN_NAMES for ch in text[:len(text) - keep].rstrip()):
                    self._state, self._searched = "text", 0
                    return True
            elif state == "text":  # released as it comes (less what may be a tag beginning)
                keep = max(partial_suffix(text, t) for t in tags)
                self._content.add(self._block + text[:len(text) - keep], out)
                self._block, self._pending, self._searched = "", text[len(text) - keep:], 0
            elif state == "value" and self._string:
                keep = max(partial_suffix(text, t) for t in tags)
                self._value_text(text[:len(text) - keep], False, out)
                self._pending, self._searched = text[len(text) - keep:], 0
            return False
        if state == "name":  # the first line, up to the first key or the block's end
            name = text[:at].strip()
            if not name or any(ch in self.NOT_IN_NAMES for ch in name):
                self._state = "text"  # not a call: the block is text
                return True
            self._name, self._block = name, self._block + text[:at]
            self._pending, self._state = text[at:], "named"
        elif state == "named":
            if tag == self.START:  # another block begins: this one was text
                self._content.add(self._block + text[:at], out)
                self._block, self._pending, self._state = "", text[at:], "content"
                return True
            self._open_call(out)
            self._pending, self._state = text[at:], "body"
        elif state == "text":
            end = at + (len(tag) if tag == self.END else 0)  # (a new block's tag starts one)
            self._content.add(self._block + text[:end], out)
            self._block, self._pending, self._state = "", text[end:], "content"
        elif state == "value":
            self._value_text(text[:at], True, out)
            self._pending = text[at + len(tag):] if tag == self.VALUE_END else text[at:]
            self._state = "body"
        elif tag == self.END:  # the block ends (a key it named without a value is dropped)
            self._close_call(out)
            self._pending, self._state = text[at + len(tag):], "content"
        elif state == "key":
            self._key, self._pending, self._state = text[:at].strip(), text[at + len(tag):], "before_value"
        elif tag == self.VALUE:
            self._pending, self._state = text[at + len(tag):], "value"
            self._string = _is_string(self._call_properties.get(self._key))
            if self._string:  # (its key goes out now, its text as it comes)
                self._pair_start(out)
                out.tool_calls[-1]["function"]["arguments"] += '"'
        else:  # body or before_value: a key (the one before it had no value: dropped)
            self._pending, self._state = text[at + len(tag):], "key"
        return True

    def _open_call(self, out: ParsedDelta) -> None:
        self._content.drop()
        out.tool_calls.append(self._start_call(self._name, "{"))
        self._call_properties = self._properties.get(self._name, {})
        self._block, self._keys = "", 0

    def _pair_start(self, out: ParsedDelta) -> None:
        """``"key": `` (after a comma but for the first), as a delta of the current call."""
        key = f"{json.dumps(self._key, ensure_ascii=False)}: "
        out.tool_calls.append({"index": self.calls - 1, "function": {"arguments": ", " + key if self._keys else key}})
        self._keys += 1

    def _value_text(self, raw: str, last: bool, out: ParsedDelta) -> None:
        """The value's text read so far (``last``: all of it). A string parameter's goes out as it
        comes, escaped for JSON, closed by its quote at the end; any other's whole, read by its type."""
        if self._string:
            piece = json.dumps(raw, ensure_ascii=False)[1:-1] + ('"' if last else "")
            if piece:
                out.tool_calls.append({"index": self.calls - 1, "function": {"arguments": piece}})
            return
        self._pair_start(out)
        value = glm45_value(raw, self._call_properties.get(self._key))
        out.tool_calls[-1]["function"]["arguments"] += json.dumps(value, ensure_ascii=False)


def _is_string(schema: Any) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "string"
