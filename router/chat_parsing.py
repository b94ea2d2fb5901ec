"""One chat choice's generated text split into what the response carries: reasoning (with a
``--reasoning-parser``), content, and tool calls (read from the content, after any reasoning).
The same parser serves streamed chunks (``feed``/``finish``) and whole responses (``whole``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from router.parsed_output import ParsedDelta, merge_tool_call_deltas
from router.reasoning_parsers import ReasoningParser
from router.tool_parsers import ToolCallParser


@dataclass
class ChatAnswer:
    reasoning: str | None
    content: str | None
    tool_calls: list[dict[str, Any]]


class ChatOutputParser:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None,
                 include_reasoning: bool = True, parallel_tool_calls: bool = True) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.include_reasoning = include_reasoning
        # False: only the first call goes out (as vLLM keeps only the first), whatever the format.
        self.parallel_tool_calls = parallel_tool_calls
        self.reasoned = False  # some reasoning was read (returned or not)
        self._tool_text: list[str] = []  # the text the tool-call parser read (for a whole answer's fallback)
        self.calls_dropped = False  # a whole answer's calls were not JSON: it is its text instead

    @property
    def hides_reasoning(self) -> bool:
        """The request asked not to see the thinking (include_reasoning false): its tokens' logprobs
        and ids would show it, so the answer carries neither (vLLM's rule)."""
        reads_reasoning = self.reasoning is not None or (self.tools is not None and self.tools.reads_reasoning)
        return reads_reasoning and not self.include_reasoning

    def feed(self, text: str) -> ParsedDelta:
        reasoning, content = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        return self._read_tools(reasoning, content, final=False)

    def finish(self) -> ParsedDelta:
        reasoning, content = self.reasoning.finish() if self.reasoning is not None else ("", "")
        return self._read_tools(reasoning, content, final=True)

    def _read_tools(self, reasoning: str, content: str, final: bool) -> ParsedDelta:
        self.reasoned = self.reasoned or bool(reasoning)
        out = ParsedDelta(reasoning if self.include_reasoning else "", content)
        if self.tools is not None:
            self._tool_text.append(content)
            released = self.tools.feed(content)
            if final:
                released.extend(self.tools.finish())
            out.content, out.tool_calls = released.content, released.tool_calls
            if released.reasoning:  # (harmony: the channels carry the reasoning)
                self.reasoned = True
                out.reasoning += released.reasoning if self.include_reasoning else ""
            if not self.parallel_tool_calls:
                out.tool_calls = [d for d in out.tool_calls if d["index"] == 0]
        return out

    def finish_reason(self, finish_reason: str | None) -> str | None:
        """A choice that ended normally after calling tools finishes with ``tool_calls`` (a named
        tool_choice keeps ``stop``, as OpenAI answers a forced function)."""
        if self.tools is not None and finish_reason == "stop" and self.tools.calls and not self.calls_dropped:
            return self.tools.finish_reason_on_call
        return finish_reason

    def parse(self, text: str, cut: bool = False) -> ParsedDelta:
        """A whole answer's text, split as its stream would have been; but when the model wrote
        calls in its own format (tool_choice "auto") and one's arguments are not JSON (a trailing
        comma, say), the answer is its text and no call, as vLLM's parsers answer: a call nobody
        can read is not one. (A stream has sent such a call as it came.) An answer ``cut`` off
        (by max_tokens) keeps the call it was writing, as streamed: its finish reason says why its
        arguments are incomplete."""
        out = self.feed(text)
        out.extend(self.finish())
        if not cut and self.tools is not None and self.tools.free_form and out.tool_calls \
                and not all(_is_json(call["function"]["arguments"]) for call in merge_tool_call_deltas(out.tool_calls)):
            self.calls_dropped = True
            out.content, out.tool_calls = "".join(self._tool_text), []
        return out

    def whole(self, text: str, cut: bool = False) -> ChatAnswer:
        out = self.parse(text, cut)
        calls = merge_tool_call_deltas(out.tool_calls)
        # An answer that is all thinking or tool calls has no content (null, as OpenAI sends it);
        # any text, blanks included, is content, as streamed.
        content = out.content if out.content or not (calls or self.reasoned) else None
        return ChatAnswer(out.reasoning or None, content, calls)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):  # (nested past Python's limit: not readable either)
        return False
    return True
