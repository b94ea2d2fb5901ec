"""GPT-OSS's answers in OpenAI's harmony format, split into what a chat response carries
(``--reasoning-parser openai_gptoss``, with ``--tool-call-parser openai`` for function calls), as
vLLM serves gpt-oss.

A harmony answer is a run of messages, each a header and a body: the prompt ends with
``<|start|>assistant``, so the first header is only ``<|channel|>analysis``; the next ones start
again with ``<|start|>assistant``. A header names the message's channel and, for a tool call, its
recipient (`` to=functions.get_weather``, before or after the channel) and the arguments' format
(``<|constrain|>json``); ``<|message|>`` ends it. A body ends at ``<|end|>`` (more follows),
``<|call|>`` (a tool call: the model waits for its result) or ``<|return|>`` (the answer is done);
the last two are the model's end-of-sequence tokens, so the engine stops on them and they are not in
the text. The markers are special tokens: an answer this parser reads is decoded with them, and where
the server knows where its marker tokens' text lies (``marker_offsets``, from the detokenizer) the
same characters written with ordinary tokens (a final answer explaining the format) are text.

What each message becomes:
- ``analysis``: reasoning (``reasoning_content``), and so is any message to a built-in tool
  (``browser.*``, ``python``: this server runs none; they are the model's own steps);
- ``final``, and ``commentary`` without a recipient (a preamble the model writes for the user):
  content;
- ``commentary`` to ``functions.NAME``: a call of NAME whose arguments are the body, where the request
  let the model call its tools (``tool_choice`` "auto" under ``--tool-call-parser openai``);
  otherwise the body is content.
Text outside any header (a model not writing harmony) is content.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from router.parsed_output import ParsedDelta, partial_suffix
from router.tool_parsers import ToolCallParser, random_tool_call_id

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
_BODY_ENDS = (END, CALL, RETURN, START)
# A header longer than this without its <|message|> is not one: what was held is content.
_MAX_HEADER = 512
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=\s|<\||$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
FUNCTION_PREFIX = "functions."


class HarmonyParser(ToolCallParser):
    """Incremental (``feed`` / ``finish``, as every chat output parser): releases reasoning, content
    and tool-call deltas as the messages arrive, holding back only what may be a marker still
    arriving, and a header until its ``<|message|>``."""

    reads_reasoning = True

    def __init__(self, calls_allowed: bool, call_id: Callable[[], str] = random_tool_call_id,
                 marker_offsets: Sequence[int] | None = None) -> None:
        """``marker_offsets``: where in the answer's text its marker tokens' text begins (growing as
        the answer is decoded; None: every marker spelled in the text is one)."""
        super().__init__(call_id)
        self.calls_allowed = calls_allowed
        self._marker_offsets = marker_offsets
        self._pending = ""
        self._offset = 0  # the pending text's place in the answer's text
        self._in_header = True
        self._kind = "content"  # the open message's: reasoning, content or call

    def feed(self, text: str) -> ParsedDelta:
        self._pending += text
        out = ParsedDelta()
        while self._pending:
            if self._in_header and not self._read_header(out):
                break
            if not self._in_header and not self._read_body(out):
                break
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        pending = self._take(len(self._pending))
        if not self._in_header:
            self._emit(pending, out)
        elif "<|" not in pending and pending.strip():  # (text short of a header: content; a cut-off header,
            out.content += pending                    # or blanks between messages, nothing)
        return out

    def _take(self, length: int) -> str:
        """The pending text's first ``length`` characters, taken off it."""
        taken, self._pending = self._pending[:length], self._pending[length:]
        self._offset += length
        return taken

    def _is_marker(self, index: int) -> bool:
        """Whether the marker spelled at ``index`` of the pending text is a marker token's text."""
        return self._marker_offsets is None or self._offset + index in self._marker_offsets

    def _read_header(self, out: ParsedDelta) -> bool:
        """Read a header whole (True), or wait for more of it (False)."""
        stripped = self._pending.lstrip()
        if stripped and not stripped.startswith("<|") and not "<|".startswith(stripped):
            self._open("", out)  # (no header: text, as a model not writing harmony writes it)
            return True
        end = self._pending.find(MESSAGE)
        if end < 0:
            if len(self._pending) > _MAX_HEADER:
                self._open("", out)
                return True
            return False
        header = self._take(end)
        self._take(len(MESSAGE))
        self._open(header, out)
        return True

    def _open(self, header: str, out: ParsedDelta) -> None:
        self._kind, function = message_kind(header, self.calls_allowed)
        if self._kind == "call":
            out.tool_calls.append(self._start_call(function, ""))
        self._in_header = False

    def _read_body(self, out: ParsedDelta) -> bool:
        """Release the open body up to its end (True: it ended, a header follows) or up to what may
        be a marker arriving (False)."""
        start = 0  # (markers spelled with ordinary tokens before it are text)
        while True:
            ends = [(i, tag) for tag in _BODY_ENDS if (i := self._pending.find(tag, start)) >= 0]
            if not ends:
                keep = max(partial_suffix(self._pending, tag) for tag in _BODY_ENDS)
                self._emit(self._take(len(self._pending) - keep), out)
                return False
            i, tag = min(ends)
            if self._is_marker(i):
                break
            start = i + len(tag)
        self._emit(self._take(i), out)
        if tag != START:  # (<|start|> opens the next message's header: it stays for the header to read)
            self._take(len(tag))
        self._in_header = True
        return True

    def _emit(self, text: str, out: ParsedDelta) -> None:
        if not text:
            return
        if self._kind == "reasoning":
            out.reasoning += text
        elif self._kind == "call":
            out.tool_calls.append({"index": self.calls - 1, "function": {"arguments": text}})
        else:
            out.content += text


def message_kind(header: str, calls_allowed: bool) -> tuple[str, str]:
    """(what a message with this header is: "reasoning", "content" or "call", and the function a call
    names)."""
    channel_match, recipient_match = _CHANNEL.search(header), _RECIPIENT.search(header)
    channel = channel_match.group(1) if channel_match else ""
    recipient = recipient_match.group(1) if recipient_match else ""
    if recipient.startswith(FUNCTION_PREFIX) and calls_allowed:
        return "call", recipient[len(FUNCTION_PREFIX):]
    if channel == "analysis" or (recipient and not recipient.startswith(FUNCTION_PREFIX)):
        return "reasoning", ""
    return "content", ""


def reasoning_token_count(token_ids: Sequence[int], markers: dict[str, int],
                          decode: Callable[[list[int]], str]) -> int:
    """How many of an answer's tokens are its reasoning messages' bodies (the markers and headers not
    counted). ``markers``: the harmony markers' token ids; ``decode``: a header's tokens as text (with
    its special tokens)."""
    message, start = markers.get(MESSAGE), markers.get(START)
    ends = {markers[tag] for tag in _BODY_ENDS if tag in markers}
    count, header, in_body, reasoning = 0, [], False, False
    for token in token_ids:
        if in_body:
            if token in ends:
                in_body, header = False, [token] if token == start else []
            elif reasoning:
                count += 1
        elif token == message:
            in_body, reasoning = True, message_kind(decode(header), False)[0] == "reasoning"
        else:
            header.append(token)
    return count


def marker_ids(vocabulary: dict[str, int]) -> dict[str, int]:
    """The harmony markers' ids in a tokenizer's vocabulary (those it has)."""
    return {tag: vocabulary[tag] for tag in (START, CHANNEL, MESSAGE, END, CALL, RETURN) if tag in vocabulary}
