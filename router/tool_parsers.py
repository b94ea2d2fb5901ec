"""Tool-call parsers for /v1/chat/completions: they turn a choice's generated text into OpenAI
``tool_calls``, streamed or whole (the output constraints they read are in ``tool_choice``).

- ``tool_choice`` naming a function: the whole text is the call's ``arguments`` (finish reason
  ``stop``, as OpenAI gives for a forced function).
- ``"required"``: the text is a JSON array of ``{"name", "parameters"}`` objects; each is a call.
- ``"auto"``: the model decides, in its own format, read by the server's ``--tool-call-parser``
  (``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as Hermes and Qwen
  models write it); text outside the tags is the message's content. ``openai`` (gpt-oss): calls are
  harmony messages to ``functions.NAME`` (``router.harmony``, which reads the whole answer);
  ``glm45`` (GLM-4.5 to 4.7; ``glm47``, vLLM's name for GLM-4.7's, the same parser: it reads the
  name and the first key on one line, and calls without arguments): ``<tool_call>NAME`` and
  ``<arg_key>``/``<arg_value>`` pairs (``router.glm45_tool_parser``); ``deepseek_v3``,
  ``deepseek_v31`` and ``kimi_k2``: calls in a marked section after the content
  (``router.sectioned_tool_parsers``).

Every parser is incremental: ``feed(text)`` returns what can be released now (content and
tool-call deltas, in OpenAI's streamed shape), ``finish()`` what is left. A whole response runs the
same parser over the whole text (``ChatOutputParser.whole``), so streamed and whole responses agree.
"""

from __future__ import annotations

import ast
import json
import math
import uuid
from collections.abc import Callable
from typing import Any

from router.parsed_output import ParsedDelta, partial_suffix

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "openai", "glm45", "glm47",
                     "deepseek_v3", "deepseek_v31", "kimi_k2", "minimax_m2")
# Where a JSON call object keeps its arguments.
ARGUMENTS_KEYS = ("arguments", "parameters")


def random_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def mistral_tool_call_id() -> str:
    """9 letters and digits: Mistral's chat templates refuse any other id sent back to them."""
    return uuid.uuid4().hex[:9]


class ToolCallParser:
    """Base: passes text through as content. ``calls`` counts the calls released so far;
    ``call_id`` makes their ids (the server's tool-call format decides their shape)."""

    finish_reason_on_call = "tool_calls"
    # The model chose to call, in its own format (tool_choice "auto"): a call whose arguments are
    # not JSON was not one (a whole answer is then its text, as vLLM's parsers answer).
    free_form = False
    # It releases the answer's reasoning too (harmony's channels), where a reasoning parser would.
    reads_reasoning = False

    def __init__(self, call_id: Callable[[], str] = random_tool_call_id) -> None:
        self.calls = 0
        self._new_call_id = call_id

    def feed(self, text: str) -> ParsedDelta:
        return ParsedDelta(content=text)

    def finish(self) -> ParsedDelta:
        return ParsedDelta()

    def _start_call(self, name: str, arguments: str) -> dict[str, Any]:
        call = {"index": self.calls, "id": self._call_id(), "type": "function",
                "function": {"name": name, "arguments": arguments}}
        self.calls += 1
        return call

    def _call_id(self) -> str:
        return self._new_call_id()


class SteppedToolCallParser(ToolCallParser):
    """A parser written as a state machine over the text not yet consumed (``_pending``): ``feed``
    appends and steps until a step needs more text. Content goes out through ``_content``."""

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""
        self._content = ContentWithHeldBlanks()
        self._searched = 0  # how much of the pending text _until searched without finding its tags

    def _content_until(self, tag: str, out: ParsedDelta) -> bool:
        """The pending text up to ``tag`` released as content (less what may be the tag's start):
        True once the tag is found, the pending text then following it."""
        text = self._pending
        at = text.find(tag)
        if at < 0:
            keep = partial_suffix(text, tag)
            self._content.add(text[:len(text) - keep], out)
            self._pending = text[len(text) - keep:]
            return False
        self._content.add(text[:at], out)
        self._pending, self._searched = text[at + len(tag):], 0
        return True

    def _until(self, tags: tuple[str, ...]) -> tuple[int, str]:
        """The first of ``tags`` in the pending text, or (-1, ""), searching only what may hold one
        since the last search that found none (the pending text only grows meanwhile)."""
        at, tag = first_tag(self._pending, tags, max(0, self._searched - max(map(len, tags)) + 1))
        self._searched = len(self._pending) if at < 0 else 0
        return at, tag

    def feed(self, text: str) -> ParsedDelta:
        self._pending += text
        out = ParsedDelta()
        while self._step(out):
            pass
        return out

    def _step(self, out: ParsedDelta) -> bool:
        """Consume what the pending text decides: True when there may be more to read now."""
        raise NotImplementedError

    def _close_call(self, out: ParsedDelta) -> None:
        """The current call's arguments object closed."""
        out.tool_calls.append({"index": self.calls - 1, "function": {"arguments": "}"}})

    def _end_content(self, out: ParsedDelta) -> None:
        """At the answer's end: a blank answer is still the answer; blanks around calls are not content."""
        if not self.calls:
            out.content += self._content.blank
        self._content.drop()


class ContentWithHeldBlanks:
    """Content released but its trailing blanks, which wait for what follows: dropped before a
    call (``drop``), released before more text. So streamed and whole answers agree, and the
    blanks next to calls are not content."""

    def __init__(self) -> None:
        self.blank = ""

    def add(self, text: str, out: ParsedDelta) -> None:
        text = self.blank + text
        kept = text.rstrip()
        out.content += kept
        self.blank = text[len(kept):]

    def drop(self) -> None:
        self.blank = ""


class NamedToolCallParser(ToolCallParser):
    """tool_choice names one function: all the text is its arguments."""

    finish_reason_on_call = "stop"

    def __init__(self, name: str, call_id: Callable[[], str] = random_tool_call_id) -> None:
        super().__init__(call_id)
        self.name = name

    def feed(self, text: str) -> ParsedDelta:
        if not text:
            return ParsedDelta()
        if self.calls == 0:
            return ParsedDelta(tool_calls=[self._start_call(self.name, text)])
        return ParsedDelta(tool_calls=[{"index": 0, "function": {"arguments": text}}])

    def finish(self) -> ParsedDelta:
        # Even an empty answer is a call to the named function (with empty arguments).
        return ParsedDelta(tool_calls=[self._start_call(self.name, "")]) if self.calls == 0 else ParsedDelta()


_NOTHING, _OPENED, _CLOSED = 0, 1, 2  # what a character did to the element being read


class CallScanner:
    """Reads calls out of JSON text as it arrives: objects ``{"name": ..., <args key>: ...}`` at
    nesting ``depth`` (1: the text is one object; 2: an array of them), the arguments under any of
    ``args_keys``. A character scanner
    (strings and nesting only; it needs no complete JSON): a call is released once its name has
    been read, then its arguments' text as it arrives, verbatim (trailing blanks wait for what
    follows; a call whose object ends without arguments gets ``{}``)."""

    def __init__(self, owner: ToolCallParser, depth: int, args_keys: tuple[str, ...]) -> None:
        self.owner, self.depth, self.args_keys = owner, depth, args_keys
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
        self.index: int | None = None  # the call's index once released
        self._args: list[str] = []  # parameters text not released yet
        self._args_state = "before"  # before, in, done
        self.args_seen = False  # a non-blank character of the arguments value was read
        self._closed = False

    def feed(self, text: str, out: ParsedDelta) -> None:
        for ch in text:
            event = self._step(ch)
            if event == _OPENED:  # what is left of the previous element goes out first
                self._close(out)
                self._new_element()
            elif event == _CLOSED:
                self._close(out)
        self._release(out)

    def finish(self, out: ParsedDelta) -> None:
        """The text ended (cut off, or a closing tag): close the element being read."""
        self._close(out)

    def _close(self, out: ParsedDelta) -> None:
        if not self._closed:
            self._release(out, final=True)
            self._closed = True

    def _release(self, out: ParsedDelta, final: bool = False) -> None:
        if self._name is None or self._closed:
            return
        text = "".join(self._args)
        args = text.rstrip()
        self._args = [] if final else [text[len(args):]]
        if final and not self.args_seen:
            args = "{}"
        if self.index is None:
            out.tool_calls.append(self.owner._start_call(self._name, args))
            self.index = self.owner.calls - 1
        elif args:
            out.tool_calls.append({"index": self.index, "function": {"arguments": args}})

    def _step(self, ch: str) -> int:
        """Scan one character: _OPENED when it opens an element, _CLOSED when it closes one."""
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
                elif args_in and self._depth == self.depth:  # a string value ended
                    self._args_state = "done"
                return _NOTHING
            if self._capture is not None:
                self._capture.append(ch)
            return _NOTHING
        if args_in:
            if self._depth == self.depth and ch in ",}":  # a scalar value ended; the character is structure
                self._args_state = "done"
                args_in = False
            elif self.args_seen or not ch.isspace():
                self._args.append(ch)
                self.args_seen = True
        if ch == '"':
            self._in_string = True
            if self._depth == self.depth and not args_in and (self._expecting_key or self._key == "name"):
                self._capture, self._capturing_key = [], self._expecting_key
        elif ch in "[{":
            self._depth += 1
            if self._depth == self.depth:
                self._expecting_key = True
                return _OPENED
        elif ch in "]}":
            self._depth -= 1
            if args_in and self._depth == self.depth:
                self._args_state = "done"
            elif self._depth == self.depth - 1:
                return _CLOSED
        elif self._depth == self.depth and not args_in:
            if ch == ":":
                self._expecting_key = False
                if self._key in self.args_keys and self._args_state == "before":
                    self._args_state = "in"
            elif ch == ",":
                self._expecting_key = True
        return _NOTHING

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



class RequiredToolCallParser(ToolCallParser):
    """tool_choice "required": the text is a JSON array of ``{"name": ..., "parameters": {...}}``;
    each element is a call, streamed as its name and arguments arrive."""

    def __init__(self, call_id: Callable[[], str] = random_tool_call_id) -> None:
        super().__init__(call_id)
        self._scanner = CallScanner(self, depth=2, args_keys=("parameters",))

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._scanner.feed(text, out)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        self._scanner.finish(out)
        return out


class HermesToolCallParser(ToolCallParser):
    """``auto`` with ``--tool-call-parser hermes``: ``<tool_call>{"name", "arguments"}</tool_call>``
    blocks are calls, the rest is content.

    - Text that may be the start of a tag is held back.
    - Inside a block, the call is released once its name is read, then its arguments as they
      arrive (verbatim; ``{}`` when the block has none). A block without a name stays content.
    - Trailing blanks are held back until other text follows, so the blanks just before or
      between calls are not content and a reply of calls alone has none.
"""

    free_form = True

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""  # content that may be the start of a tag, or the current block's body
        self._in_call = False
        self._scanner: CallScanner | None = None  # the current block's
        self._fed = 0  # how much of the block's body the scanner has read
        self._content = ContentWithHeldBlanks()

    def feed(self, text: str) -> ParsedDelta:
        self._pending += text
        out = ParsedDelta()
        while True:
            if self._in_call:
                # Only the text after what the scanner read (and a tag's worth before it) can hold
                # the closing tag.
                end = self._pending.find(self.END, max(0, self._fed - len(self.END) + 1))
                if end < 0:
                    safe = len(self._pending) - partial_suffix(self._pending, self.END)
                    self._scan(safe, out)
                    return out
                self._scan(end, out)
                self._end_call(self._pending[:end], closed=True, out=out)
                self._pending = self._pending[end + len(self.END):]
                continue
            start = self._pending.find(self.START)
            if start >= 0:
                self._add_content(self._pending[:start], out)
                self._pending = self._pending[start + len(self.START):]
                self._start_block()
                continue
            keep = partial_suffix(self._pending, self.START)
            self._add_content(self._pending[:len(self._pending) - keep], out)
            self._pending = self._pending[len(self._pending) - keep:]
            return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._in_call:  # no closing tag (the model stopped right after the JSON, or was cut off)
            self._scan(len(self._pending), out)
            self._end_call(self._pending, closed=False, out=out)
        else:
            self._add_content(self._pending, out)
        if not self.calls:  # a blank answer is still the answer; blanks around calls are not content
            out.content += self._content.blank
        self._pending, self._in_call = "", False
        self._content.drop()
        return out

    def _start_block(self) -> None:
        self._in_call, self._fed = True, 0
        # (Models sometimes write "parameters", as Llama's format names them: the same arguments.)
        self._scanner = CallScanner(self, depth=1, args_keys=ARGUMENTS_KEYS)

    def _scan(self, upto: int, out: ParsedDelta) -> None:
        assert self._scanner is not None  # (inside a block)
        if upto > self._fed:
            self._scanner.feed(self._pending[self._fed:upto], out)
            self._fed = upto

    def _end_call(self, body: str, closed: bool, out: ParsedDelta) -> None:
        scanner, self._scanner, self._in_call = self._scanner, None, False
        assert scanner is not None
        scanner.finish(out)
        if scanner.index is None:  # no call in it: the block was text
            self._add_content(self.START + body + (self.END if closed else ""), out)
        else:
            self._content.drop()

    def _add_content(self, text: str, out: ParsedDelta) -> None:
        self._content.add(text, out)


class Llama3JsonToolCallParser(ToolCallParser):
    """``auto`` with ``--tool-call-parser llama3_json``: Llama 3.x writes its calls as JSON objects
    ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), separated by ``;``, optionally after
    ``<|python_tag|>``. An answer that starts otherwise is content. Each call is released when its
    object is complete; an answer whose calls do not parse is content, whole (as vLLM does)."""

    free_form = True

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._mode = "start"  # start, calls, content
        self._text = ""  # everything read in calls mode (kept whole, for the fallback to content)
        self._parsed_to = 0  # where in _text the next object starts
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> ParsedDelta:
        if self._mode == "content":
            return ParsedDelta(content=text)
        self._text += text
        if self._mode == "calls" and "}" not in text:
            return ParsedDelta()  # (an object can only have ended with a closing brace)
        if self._mode == "start":
            head = self._text.lstrip()
            if not head or self.TAG.startswith(head):
                return ParsedDelta()  # blanks, or the tag still arriving
            if head.startswith(self.TAG):
                self._parsed_to = len(self._text) - len(head) + len(self.TAG)
            elif head.startswith("{"):
                self._parsed_to = len(self._text) - len(head)
            else:
                self._mode = "content"
                return ParsedDelta(content=self._text)
            self._mode = "calls"
        return self._release_calls()

    def _release_calls(self) -> ParsedDelta:
        out = ParsedDelta()
        while True:
            start = self._parsed_to
            while start < len(self._text) and self._text[start] in " \t\r\n;":
                start += 1
            try:
                obj, end = self._decoder.raw_decode(self._text, start)
            except ValueError:
                return out  # incomplete (or not JSON: decided at the finish)
            name = obj.get("name") if isinstance(obj, dict) else None
            if not isinstance(name, str) or not ("arguments" in obj or "parameters" in obj):
                return out  # not a call: decided at the finish (as vLLM, a call needs its arguments)
            arguments = obj.get("arguments", obj.get("parameters"))
            self._parsed_to = end
            out.tool_calls.append(self._start_call(name, json.dumps(arguments, ensure_ascii=False)))

    def finish(self) -> ParsedDelta:
        if self._mode == "start":  # only blanks, or a lone partial tag
            return ParsedDelta(content=self._text)
        if self._mode == "content":
            return ParsedDelta()
        rest = self._text[self._parsed_to:].strip(" \t\r\n;")
        if not rest:
            return ParsedDelta()
        if not self.calls:  # nothing parsed: the whole answer was text after all
            return ParsedDelta(content=self._text)
        return ParsedDelta(content=rest)


class MistralToolCallParser(ToolCallParser):
    """``auto`` with ``--tool-call-parser mistral``. Mistral's models write ``[TOOL_CALLS]`` and then
    either a JSON array of ``{"name", "arguments"}`` calls (the v0.3 format: Mistral-7B-Instruct-v0.3,
    Mistral-Nemo, Mistral-Large-2407) or, from tokenizer v11 on (Mistral-Small-3.x, Magistral,
    Devstral), ``name[ARGS]{...}``, a tag before each call. The text before the first tag is content.
    Calls stream as their names and arguments arrive; when no call follows the tag (text), the text
    after it is content. Call ids are 9 letters and digits, as Mistral's chat templates require of
    the ids sent back to them."""

    free_form = True

    TAG = "[TOOL_CALLS]"

    def __init__(self) -> None:
        super().__init__(mistral_tool_call_id)
        self._pending = ""
        self._content = ContentWithHeldBlanks()
        self._tagged = False  # the first tag has been read
        self._reader: CallScanner | _NamedCalls | None = None  # chosen by the first character after it
        self._after_tag = ""  # the text after the tag, until a call is read (else it was content)

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if self._tagged:
            self._scan(text, out)
            return out
        self._pending += text
        start = self._pending.find(self.TAG)
        if start < 0:
            cut = len(self._pending) - partial_suffix(self._pending, self.TAG)
            self._content.add(self._pending[:cut], out)
            self._pending = self._pending[cut:]
            return out
        self._content.add(self._pending[:start], out)
        self._content.drop()
        self._tagged = True
        rest, self._pending = self._pending[start + len(self.TAG):], ""
        self._scan(rest, out)
        return out

    def _scan(self, text: str, out: ParsedDelta, final: bool = False) -> None:
        if not self.calls:
            self._after_tag += text
        if self._reader is None:
            if not self._after_tag.strip():  # (blanks so far: which format is not known yet)
                if not final:
                    return
            else:
                text = self._after_tag  # (what came before is blanks, or the held text)
                first = text.lstrip()[0]
                self._reader = CallScanner(self, depth=2, args_keys=ARGUMENTS_KEYS) if first in "[{" \
                    else _NamedCalls(self)
        if self._reader is not None:
            self._reader.feed(text, out)
            if final:
                self._reader.finish(out)

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if not self._tagged:  # no tag: the whole answer is content
            out.content, self._pending = self._content.blank + self._pending, ""
            self._content.drop()
            return out
        self._scan("", out, final=True)
        if not self.calls:  # no call after the tag (text): it was content
            out.content = self.TAG + self._after_tag
        elif isinstance(self._reader, _NamedCalls):
            out.content += self._reader.trailing_content()
        return out



class _NamedCalls:
    """Mistral's v11 format after the first ``[TOOL_CALLS]``: ``name[ARGS]{...}`` (the name may be
    followed by ``[CALL_ID]`` and an id, which is not kept), then for each further call
    ``[TOOL_CALLS]`` again. A name that is not one (blanks or punctuation in it) means the tag was
    followed by text, which the parser keeps as content. Arguments are released as they arrive
    (their trailing blanks wait for what follows); a call's arguments end where their JSON value
    closes. Text after the calls is content, released at the end."""

    ARGS, CALL_ID = "[ARGS]", "[CALL_ID]"

    def __init__(self, owner: MistralToolCallParser) -> None:
        self.owner = owner
        self._state = "name"  # name, args, after; text: not a call (everything after is held)
        self._buffer = ""
        self._index = -1
        self._held_blanks = ""
        self._args_sent = False
        self._depth = 0
        self._in_string = self._escaped = False
        self._after = ""  # text after the calls that is not a tag

    def feed(self, text: str, out: ParsedDelta) -> None:
        self._buffer += text
        while self._buffer:
            if self._state == "name":
                if not self._read_name(out):
                    return
            elif self._state == "args":
                if not self._read_args(out):
                    return
            elif self._state == "after":
                if not self._read_after():
                    return
            else:
                return

    def finish(self, out: ParsedDelta) -> None:
        if self._state == "args" and not self._args_sent:  # cut off before its arguments
            out.tool_calls.append({"index": self._index, "function": {"arguments": "{}"}})
        elif self._state in ("name", "text") and self.owner.calls:  # a last tag with no call after it
            self._after += self.owner.TAG + self._buffer
        elif self._state == "after":
            self._after += self._buffer
        self._buffer = ""

    def trailing_content(self) -> str:
        return self._after.strip() and self._after.lstrip()  # (the blanks next to the calls are not content)

    def _read_name(self, out: ParsedDelta) -> bool:
        at = self._buffer.find(self.ARGS)
        head = self._buffer if at < 0 else self._buffer[:at]
        if at < 0:  # (a marker may be arriving)
            head = head[:len(head) - max(partial_suffix(head, self.ARGS), partial_suffix(head, self.CALL_ID))]
        name = head.split(self.CALL_ID)[0].strip()
        if any(not (ch.isalnum() or ch in "_-.") for ch in name) or (at >= 0 and not name):
            self._state = "text"
            return False
        if at < 0:
            return False  # (the name goes on, or [ARGS] is arriving)
        out.tool_calls.append(self.owner._start_call(name, ""))
        self._index = self.owner.calls - 1
        self._buffer = self._buffer[at + len(self.ARGS):]
        self._state, self._depth, self._in_string, self._escaped = "args", 0, False, False
        self._held_blanks, self._args_sent = "", False
        return True

    def _read_args(self, out: ParsedDelta) -> bool:
        end = None
        for i, ch in enumerate(self._buffer):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "[{":
                self._depth += 1
            elif ch in "]}":
                self._depth -= 1
                if self._depth <= 0:
                    end = i + 1
                    break
        chunk = self._buffer if end is None else self._buffer[:end]
        text = self._held_blanks + (chunk if self._args_sent else chunk.lstrip())
        released = text if end is not None else text.rstrip()
        self._held_blanks = text[len(released):]
        if released:
            out.tool_calls.append({"index": self._index, "function": {"arguments": released}})
            self._args_sent = True
        if end is None:
            self._buffer = ""
            return False
        self._buffer, self._state = self._buffer[end:], "after"
        return True

    def _read_after(self) -> bool:
        tag = self.owner.TAG
        at = self._buffer.find(tag)
        if at < 0:
            keep = partial_suffix(self._buffer, tag)
            self._after += self._buffer[:len(self._buffer) - keep]
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        self._after += self._buffer[:at]
        self._buffer, self._state = self._buffer[at + len(tag):], "name"
        return True


class PythonicToolCallParser(ToolCallParser):
    """``auto`` with ``--tool-call-parser pythonic`` (Llama 3.2, Llama 4's pythonic templates): an
    answer that is a Python list of calls with keyword arguments, ``[get_weather(city="Rome"),
    f(n=1)]`` (optionally between ``<|python_start|>`` and ``<|python_end|>``). The calls are
    released once the list parses; an answer that does not start with ``[`` or never parses as such
    a list is content, whole (as vLLM)."""

    free_form = True

    TAGS = ("<|python_start|>", "<|python_end|>")

    def __init__(self) -> None:
        super().__init__()
        self._mode = "start"  # start, list, done (the list parsed), content
        self._text = ""
        self._checked = 0  # the code before this has no closing bracket that ends a list of calls

    def feed(self, text: str) -> ParsedDelta:
        if self._mode == "content":
            return ParsedDelta(content=text)
        if self._mode == "done":  # after the list: held for the finish (usually the closing tag)
            self._rest += text
            return ParsedDelta()
        self._text += text
        if self._mode == "start":
            head = self._code().lstrip()
            if not head or any(tag.startswith(self._text.lstrip()) for tag in self.TAGS):
                return ParsedDelta()  # blanks, or a tag still arriving
            if not head.startswith("["):
                self._mode = "content"
                return ParsedDelta(content=self._text)
            self._mode = "list"
        # The list can only end at a closing bracket: try each new one (the first that closes a
        # list of calls ends it, whether the text was fed whole or in pieces).
        code = self._code()
        calls, end = None, self._checked
        while calls is None:
            end = code.find("]", end)
            if end < 0:
                self._checked = len(code)
                return ParsedDelta()
            end += 1
            calls = self._parse(code[:end].strip())
        self._mode, self._rest = "done", code[end:]
        out = ParsedDelta()
        for name, arguments in calls:
            out.tool_calls.append(self._start_call(name, arguments))
        return out

    def finish(self) -> ParsedDelta:
        if self._mode in ("start", "list"):  # never a list of calls: the whole answer is content
            return ParsedDelta(content=self._text)
        if self._mode == "done":  # text after the list, but for the tags, is content
            rest = self._without_tags(self._rest)
            return ParsedDelta(content=rest if rest.strip() else "")
        return ParsedDelta()

    def _code(self) -> str:
        return self._without_tags(self._text)

    def _without_tags(self, text: str) -> str:
        for tag in self.TAGS:
            text = text.replace(tag, "")
        return text

    @staticmethod
    def _parse(code: str) -> list[tuple[str, str]] | None:
        """The (name, JSON of the keyword arguments) of a list of calls, or None when ``code`` is
        not one."""
        try:
            tree = ast.parse(code, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for call in tree.elts:
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and not call.args):
                return None
            try:
                arguments = json.dumps({kw.arg: _literal(kw.value) for kw in call.keywords if kw.arg is not None},
                                       ensure_ascii=False, allow_nan=False)  # (1e999: no JSON for it)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None  # not literals (a call, a name...), or keys JSON cannot take
            calls.append((call.func.id, arguments))
        return calls


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> Any:
    """A call argument's value: Python literals, and JSON's true/false/null as models write them."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True) if k is not None}
    return ast.literal_eval(node)


class Qwen3CoderToolCallParser(SteppedToolCallParser):
    """``auto`` with ``--tool-call-parser qwen3_coder`` (Qwen3-Coder): each call is XML-like,
    ``<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>``, each tag
    on its own line (a value's first and last newline are layout). The rest is content, as with hermes.

    - A call is released once its name is read (``<function=NAME>``; a name with blanks, quotes,
      braces or ``<`` in it is no name, and its block stays content), its arguments as a JSON object
      that grows by one ``"key": value`` as each parameter ends: at ``</parameter>``, or, where the
      model left that out, at the next ``<parameter=``, ``</function>`` or ``</tool_call>``.
    - Values are read by the type the request's tool gives the parameter (vLLM's rules, in
      ``qwen3_coder_value``); a function the request does not have gets its values as strings.
    - A block cut off keeps what it got: the parameter being written ends where the text does,
      and the object is closed. Text after ``</function>`` inside the block is not content.
"""

    free_form = True

    START, END = "<tool_call>", "</tool_call>"
    FUNCTION, FUNCTION_END = "<function=", "</function>"
    PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
    # Characters no function name has: with them, "<function=" was text (a template, a pseudo-tag).
    NOT_IN_NAMES = frozenset("{}<>\"' \t\r\n")

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__()
        self._properties = tool_properties(tools)
        self._state = "content"  # content, block, name, body, key, value, after
        self._block = ""  # the block's text until its call is known (it is content if none comes)
        self._call_properties: dict[str, Any] = {}  # the current call's function's parameters
        self._key = ""  # the parameter being read
        self._keys = 0  # parameters released in the current call

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        state, rest = self._state, self._pending
        if state == "content":
            self._content.add(rest, out)
        elif state == "block" or (state == "name" and self._block):  # no call in it: text
            self._content.add(self._block + rest, out)
        elif state == "value":  # cut off in a value: it ends where the text does (less a tag begun)
            tags = (self.PARAMETER_END, self.PARAMETER, self.FUNCTION_END, self.END)
            self._release_parameter(rest[:len(rest) - max(partial_suffix(rest, tag) for tag in tags)], out)
        if state in ("body", "key", "value"):
            self._close_call(out)
        self._end_content(out)
        self._pending, self._block, self._state = "", "", "content"
        return out

    def _step(self, out: ParsedDelta) -> bool:
        """Consume what the pending text decides in the current state: True when the state changed
        (there may be more to read), False when the rest must wait for more text."""
        state, text = self._state, self._pending
        if state == "content":
            if not self._content_until(self.START, out):
                return False
            self._block, self._state = self.START, "block"
            return True
        if state == "name":
            return self._read_name(out)
        if state == "key":
            end = text.find(">")
            if end < 0:
                return False
            self._key, self._pending = text[:end], text[end + 1:]
            self._state, self._searched = "value", 0
            return True
        if state == "value":
            at, tag = self._until((self.PARAMETER_END, self.PARAMETER, self.FUNCTION_END, self.END))
            if at < 0:
                return False
            self._release_parameter(text[:at], out)
            # (A missing </parameter>: the tag that ended the value is read as the body's.)
            self._pending = text[at + len(tag):] if tag == self.PARAMETER_END else text[at:]
            self._state = "body"
            return True
        # block, body, after: looking for the next tag (what else is there is dropped, or, in a
        # block that has no call yet, kept in case it never gets one).
        tags = {"block": (self.FUNCTION, self.END), "body": (self.PARAMETER, self.FUNCTION_END, self.END),
                "after": (self.FUNCTION, self.END)}[state]
        at, tag = first_tag(text, tags)
        if at < 0:
            keep = max(partial_suffix(text, t) for t in tags)
            if state == "block":
                self._block += text[:len(text) - keep]
            self._pending = text[len(text) - keep:]
            return False
        self._pending = text[at + len(tag):]
        if state == "block" and tag == self.END:  # a block without a call is text
            self._content.add(self._block + text[:at + len(tag)], out)
            self._block, self._state = "", "content"
        elif tag == self.FUNCTION:
            self._block = self._block + text[:at + len(tag)] if state == "block" else ""
            self._state = "name"
        elif tag == self.PARAMETER:
            self._state = "key"
        elif state == "after":  # </tool_call>
            self._state = "content"
        else:  # </function>, or a </tool_call> that ends a call without one
            self._close_call(out)
            self._state = "after" if tag == self.FUNCTION_END else "content"
        return True

    def _read_name(self, out: ParsedDelta) -> bool:
        text = self._pending
        end = next((i for i, ch in enumerate(text) if ch in self.NOT_IN_NAMES), -1)
        if end < 0:
            return False  # the name goes on
        if text[end] != ">" or end == 0:  # no name: the block is text (a second one's is dropped)
            if self._block:
                self._content.add(self._block, out)
            self._block, self._state = "", "content" if self._block else "after"
            return True
        name, self._pending, self._block = text[:end], text[end + 1:], ""
        self._content.drop()
        out.tool_calls.append(self._start_call(name, "{"))
        self._call_properties = self._properties.get(name, {})
        self._keys, self._state = 0, "body"
        return True

    def _release_parameter(self, raw: str, out: ParsedDelta) -> None:
        raw = raw.removeprefix("\n").removesuffix("\n")
        if self._key in self._call_properties:
            value = qwen3_coder_value(raw, self._call_properties[self._key])
        else:  # a parameter the tool does not declare (or a function the request lacks): a string
            value = raw
        pair = f"{json.dumps(self._key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        out.tool_calls.append({"index": self.calls - 1,
                               "function": {"arguments": ", " + pair if self._keys else pair}})
        self._keys += 1


def tool_properties(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Each function's parameter schemas (``parameters.properties``), by name."""
    found: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            found.setdefault(function["name"], properties if isinstance(properties, dict) else {})
    return found


def first_tag(text: str, tags: tuple[str, ...], start: int = 0) -> tuple[int, str]:
    """Where the first of ``tags`` is in ``text`` (from ``start``), and which: (-1, "") if none."""
    first, which = -1, ""
    for tag in tags:
        at = text.find(tag, start)
        if at >= 0 and (first < 0 or at < first):
            first, which = at, tag
    return first, which


_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_NULLS = ("null", "none")


def _declared_type(schema: Any) -> tuple[str, bool]:
    """A parameter's type as the qwen3_coder parser reads its schema (``type``, else the first typed
    option of ``anyOf``; neither: a string), and whether the schema admits null."""
    if not isinstance(schema, dict):
        return "string", False
    if "type" in schema and not isinstance(schema["type"], list):
        kind = str(schema["type"]).strip().lower()
        return kind, kind == "null"
    if "type" in schema:  # ["integer", "null"]: read as anyOf
        options = [str(t).strip().lower() for t in schema["type"]]
    elif isinstance(schema.get("anyOf"), list):
        options = [str(o["type"]).strip().lower() for o in schema["anyOf"] if isinstance(o, dict) and "type" in o]
    else:
        return "string", False
    typed = [kind for kind in options if kind != "null"]
    return (typed[0] if typed else "string"), len(typed) < len(options)


def qwen3_coder_value(raw: str, schema: Any) -> Any:
    """A Qwen3-Coder parameter's text as its declared type reads it (vLLM's rules): strings as
    written; integers and numbers (a whole number as an integer) else the text; booleans true only
    for ``true`` (any case); objects and arrays as JSON, else as Python literals, else the text;
    other types as Python literals, else the text. ``null`` / ``None`` is null but for a string
    that does not admit null. A value JSON cannot carry (NaN, a set) stays its text."""
    kind, nullable = _declared_type(schema)
    if raw.lower() in _NULLS and (nullable or kind not in _STRING_TYPES):
        return None
    if kind in _STRING_TYPES:
        return raw
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(raw)
        except ValueError:
            return raw
    if kind.startswith(("num", "float")):
        try:
            number = float(raw)
        except ValueError:
            return raw
        if not math.isfinite(number):
            return raw
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return raw.lower() == "true"
    container = kind in ("object", "array", "arr") or kind.startswith(("dict", "list"))
    value: Any = _NO_VALUE
    if container:
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError):
            pass
        else:
            if isinstance(value, str):  # JSON of a Python repr, "{'k': 'v'}" (a known template slip)
                value = python_literal(value, value)
    if value is _NO_VALUE:
        value = python_literal(raw, raw)
        if container and isinstance(value, str):
            value = python_literal(value, value)
    return json_safe(value, raw)


def json_safe(value: Any, otherwise: Any) -> Any:
    """``value`` where JSON can carry it, else ``otherwise`` (NaN, a set, nesting too deep)."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return otherwise
    return value


_NO_VALUE = object()


def python_literal(text: str, otherwise: Any) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return otherwise


def create_tool_call_parser(tool_choice: str | dict[str, Any], server_parser: str | None,
                            tools: list[dict[str, Any]] | None = None) -> ToolCallParser | None:
    """The parser a chat request's effective ``tool_choice`` needs (None: plain content). Calls a
    named or required tool_choice makes take the server's id shape too (a Mistral template refuses
    the others when they come back). ``tools``: the request's, as ``tool_dicts`` gives them (the
    qwen3_coder format reads its values by their parameters' types)."""
    call_id = mistral_tool_call_id if server_parser == "mistral" else random_tool_call_id
    if isinstance(tool_choice, dict):
        return NamedToolCallParser(tool_choice["function"]["name"], call_id)
    if tool_choice == "required":
        return RequiredToolCallParser(call_id)
    if tool_choice == "auto":
        if server_parser == "hermes":
            return HermesToolCallParser()
        if server_parser == "llama3_json":
            return Llama3JsonToolCallParser()
        if server_parser == "mistral":
            return MistralToolCallParser()
        if server_parser == "pythonic":
            return PythonicToolCallParser()
        if server_parser == "qwen3_coder":
            return Qwen3CoderToolCallParser(tools)
        if server_parser in ("glm45", "glm47"):
            from router.glm45_tool_parser import Glm45ToolCallParser

            return Glm45ToolCallParser(tools)
        if server_parser == "minimax_m2":
            from router.minimax_m2_tool_parser import MiniMaxM2ToolCallParser

            return MiniMaxM2ToolCallParser(tools)
        if server_parser in ("deepseek_v3", "deepseek_v31", "kimi_k2"):
            from router.sectioned_tool_parsers import SECTIONED_TOOL_CALL_PARSERS

            return SECTIONED_TOOL_CALL_PARSERS[server_parser]()
        if server_parser == "openai":
            from router.harmony import HarmonyParser

            return HarmonyParser(calls_allowed=True)
        raise ValueError(f"unknown tool call parser {server_parser!r}")
    return None
