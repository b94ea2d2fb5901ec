"""What the chat output parsers (reasoning, tool calls) release from a choice's text, and the small
text helpers they share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ParsedDelta:
    """Reasoning, message content, and tool-call deltas as OpenAI streams them
    (``{"index", "id", "type", "function": {"name", "arguments"}}`` first, then
    ``{"index", "function": {"arguments"}}`` for more of the same call's arguments)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def extend(self, other: ParsedDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


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


def calls_around_text(tool_calls: list[dict[str, Any]], writing: int | None
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A delta's call fragments that were written before its text, and those after it. One delta
    may end the call being written (index ``writing``) and go on with text (outputs merged by
    --stream-interval or speculative decoding): that call's last arguments come first, so a stream
    of items finishes the call before the text closes it; new calls come after the text."""
    ending = [call for call in tool_calls if call["index"] == writing and "id" not in call]
    return ending, [call for call in tool_calls if not any(call is done for done in ending)]


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag`` (text to hold back
    while the tag may still be arriving)."""
    # Only a tail that starts with the tag's first character can be one (usually none: one find).
    i = text.find(tag[0], max(0, len(text) - len(tag) + 1))
    while i != -1:
        if tag.startswith(text[i:]):
            return len(text) - i
        i = text.find(tag[0], i + 1)
    return 0
