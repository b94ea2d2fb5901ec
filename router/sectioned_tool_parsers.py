"""Tool-call formats that put the calls in a marked section after the content, each call between
its own markers (the markers are tokens of these models' vocabularies; DeepSeek's are written here
with ASCII bars and underscores, its own have fullwidth bars and U+2581 between the words):

- ``deepseek_v3`` (DeepSeek-V3, -R1, -V3-0324)::

      <|tool_calls_begin|><|tool_call_begin|>function<|tool_sep|>NAME
      ```json
      {...}
      ```<|tool_call_end|><|tool_calls_end|>

- ``deepseek_v31`` (DeepSeek-V3.1, -V3.2): ``<|tool_call_begin|>NAME<|tool_sep|>{...}<|tool_call_end|>``
  in the same section;
- ``kimi_k2`` (Kimi K2): ``<|tool_calls_section_begin|>`` ... ``<|tool_call_begin|>functions.NAME:0
  <|tool_call_argument_begin|>{...}<|tool_call_end|>`` ... ``<|tool_calls_section_end|>``; the call's
  id is the one it writes (``functions.NAME:0``: Kimi's template expects it back), as vLLM answers.

Text before the section (and after it) is content; inside it, only calls count. A call is released
once its header is read (its name, as vLLM's parsers read it), then its arguments as they are
written (DeepSeek-V3's closing fence held back); a call cut off keeps what it got.
"""

from __future__ import annotations

from typing import Any

from router.parsed_output import ParsedDelta, partial_suffix
from router.tool_parsers import SteppedToolCallParser, first_tag


class SectionedToolCallParser(SteppedToolCallParser):
    free_form = True

    SECTION_BEGIN = SECTION_END = CALL_BEGIN = CALL_END = ARGS_BEGIN = ""

    def __init__(self) -> None:
        super().__init__()
        self._state = "content"  # content, section, header, arguments, skip (a block that is no call)
        self._args = ""  # the current call's arguments as written so far
        self._released = ""  # what of them went out
        self._call_index = -1
        self._id = ""  # the id the current call writes (Kimi K2's), or "" for a made one

    def _name(self, header: str) -> tuple[str, str] | None:
        """(name, the id the model wrote or "") of a call's header, or None: not a call."""
        raise NotImplementedError

    @staticmethod
    def _is_name(name: str) -> bool:
        """A function's name: no blanks, quotes, braces, backticks or angle brackets (a marker) in it."""
        return bool(name) and not any(ch.isspace() or ch in "<>{}\"'`" for ch in name)

    def _releasable(self, args: str) -> str:
        """The part of the arguments written so far that can go out before the call ends."""
        return args

    def _complete(self, args: str) -> str:
        """The whole arguments, once the call has ended."""
        return args

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._state == "content":
            self._content.add(self._pending, out)
        elif self._state == "arguments":  # cut off in the arguments: what was written (less a marker begun)
            keep = max(partial_suffix(self._pending, t) for t in self._tags("arguments"))
            self._args += self._pending[:len(self._pending) - keep]
            self._end_call(out)
        self._end_content(out)
        self._pending, self._state = "", "content"
        return out

    def _tags(self, state: str) -> tuple[str, ...]:
        return {"content": (self.SECTION_BEGIN,), "section": (self.CALL_BEGIN, self.SECTION_END),
                "header": (self.ARGS_BEGIN, self.CALL_END, self.SECTION_END),
                "arguments": (self.CALL_END, self.CALL_BEGIN, self.SECTION_END),
                "skip": (self.CALL_END, self.SECTION_END)}[state]

    def _step(self, out: ParsedDelta) -> bool:
        state, text = self._state, self._pending
        tags = self._tags(state)
        at, tag = first_tag(text, tags)
        if at < 0:
            keep = max(partial_suffix(text, t) for t in tags)
            if state == "content":
                self._content.add(text[:len(text) - keep], out)
            elif state == "arguments":
                self._args += text[:len(text) - keep]
                self._release(self._releasable(self._args), out)
            elif state == "header":
                return False  # (the header is read whole)
            self._pending = text[len(text) - keep:]  # (between calls, and a block that is no call: dropped)
            return False
        rest = text[at + len(tag):]
        if state == "content":
            self._content.add(text[:at], out)
            self._pending, self._state = rest, "section"
        elif state in ("section", "skip"):
            closes_section = tag == self.SECTION_END
            self._pending, self._state = rest, "content" if closes_section else (
                "header" if state == "section" else "section")
        elif state == "header":
            named = self._name(text[:at]) if tag == self.ARGS_BEGIN else None
            if named is None:  # not a call: skipped (up to its end, or the section's)
                self._pending, self._state = (rest, "skip") if tag == self.ARGS_BEGIN else (text[at:], "skip")
                return True
            self._content.drop()
            name, self._id = named
            out.tool_calls.append(self._start_call(name, ""))
            self._call_index, self._args, self._released = self.calls - 1, "", ""
            self._pending, self._state = rest, "arguments"
        else:  # arguments: the call ends (at its own end marker; without one, where the next call or
            # the section's end begins)
            self._args += text[:at]
            self._end_call(out)
            self._pending, self._state = (rest if tag == self.CALL_END else text[at:]), "section"
        return True

    def _release(self, args: str, out: ParsedDelta) -> None:
        if len(args) > len(self._released) and args.startswith(self._released):
            out.tool_calls.append({"index": self._call_index, "function": {"arguments": args[len(self._released):]}})
            self._released = args

    def _end_call(self, out: ParsedDelta) -> None:
        args = self._complete(self._args)
        self._release(args if args.strip() or self._released else "{}", out)

    def _call_id(self) -> str:
        return self._id or super()._call_id()


def _deepseek_marker(words: str) -> str:
    """DeepSeek's marker token of ``words`` ("tool calls begin": ``<|tool_calls_begin|>`` with
    fullwidth bars, U+FF5C, and U+2581 between the words)."""
    return "<\uff5c" + words.replace(" ", "\u2581") + "\uff5c>"


class DeepSeekV3ToolCallParser(SectionedToolCallParser):
    SECTION_BEGIN, SECTION_END = _deepseek_marker("tool calls begin"), _deepseek_marker("tool calls end")
    CALL_BEGIN, CALL_END = _deepseek_marker("tool call begin"), _deepseek_marker("tool call end")
    SEPARATOR, ARGS_BEGIN, FENCE = _deepseek_marker("tool sep"), "```json", "```"

    def _name(self, header: str) -> tuple[str, str] | None:
        _kind, sep, name = header.partition(self.SEPARATOR)
        name = name.strip()
        return (name, "") if sep and self._is_name(name) else None

    def _releasable(self, args: str) -> str:
        # (The arguments follow a line break and end with "\n```": blanks and backticks at the end
        # wait for what follows them.)
        return args.lstrip("\n").rstrip("`\n\r\t ")

    def _complete(self, args: str) -> str:
        body = args.lstrip("\n").rstrip()
        return body.removesuffix(self.FENCE).rstrip() if body.endswith(self.FENCE) else body


class DeepSeekV31ToolCallParser(SectionedToolCallParser):
    SECTION_BEGIN, SECTION_END = DeepSeekV3ToolCallParser.SECTION_BEGIN, DeepSeekV3ToolCallParser.SECTION_END
    CALL_BEGIN, CALL_END = DeepSeekV3ToolCallParser.CALL_BEGIN, DeepSeekV3ToolCallParser.CALL_END
    ARGS_BEGIN = DeepSeekV3ToolCallParser.SEPARATOR

    def _name(self, header: str) -> tuple[str, str] | None:
        name = header.strip()
        return (name, "") if self._is_name(name) else None


class KimiK2ToolCallParser(SectionedToolCallParser):
    SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    CALL_BEGIN, CALL_END, ARGS_BEGIN = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"

    def _name(self, header: str) -> tuple[str, str] | None:
        """``functions.NAME:INDEX``: NAME, and the whole as the call's id."""
        call_id = header.strip()
        name = call_id.rsplit(":", 1)[0].split(".", 1)[-1] if ":" in call_id else ""
        return (name, call_id) if name and self._is_name(call_id) else None


SECTIONED_TOOL_CALL_PARSERS: dict[str, Any] = {"deepseek_v3": DeepSeekV3ToolCallParser,
                                               "deepseek_v31": DeepSeekV31ToolCallParser,
                                               "kimi_k2": KimiK2ToolCallParser}
