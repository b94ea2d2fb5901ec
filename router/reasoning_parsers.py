"""Reasoning parsers (``--reasoning-parser``): split a chat answer's thinking, written between
``<think>`` and ``</think>`` (Mistral's: ``[THINK]`` and ``[/THINK]``), from its content, as vLLM
returns it in ``reasoning_content``.

- ``deepseek_r1``: the text up to ``</think>`` is reasoning (the chat template of DeepSeek-R1 opens
  the ``<think>`` in the prompt, so the answer may not repeat it); an answer cut off before
  ``</think>`` is all reasoning.
- ``qwen3``: only an answer that opens with ``<think>`` reasons (Qwen3 with thinking switched off
  writes none, and then everything is content), or one whose prompt ended with ``<think>`` (the
  thinking-only templates of Qwen3-2507 open it there).
- ``mistral`` (Magistral, Ministral 3 Reasoning): as ``qwen3``, with Mistral's tags ``[THINK]`` and
  ``[/THINK]``, which are special tokens of its vocabulary (so an answer it reads is decoded with
  its special tokens, as the tool-call parsers' are).
- ``glm45`` (GLM-4.5, 4.6, 4.7): as ``qwen3`` (GLM's templates close the thinking in the prompt,
  ``<think></think>``, when ``enable_thinking`` is false: the answer is then all content).
- ``deepseek_v3`` (DeepSeek-V3, V3.1: its template opens the thinking in the prompt under
  ``chat_template_kwargs: {"thinking": true}`` and closes it otherwise) and ``kimi_k2`` (Kimi K2
  Thinking): as ``qwen3``.
- ``minimax_m2`` (MiniMax-M2, M2.1): as ``deepseek_r1`` (the model writes no ``<think>``, only
  ``</think>``); ``minimax_m2_append_think``: nothing split off, the answer all content with its
  thinking in it behind a ``<think>`` put back in front (for clients that send the thinking back).
- ``openai_gptoss`` (gpt-oss): its answers are harmony messages on channels, not tags; they are read
  by ``router.harmony.HarmonyParser`` (reasoning, content and tool calls together).

Incremental like the tool-call parsers: ``feed(text)`` returns the (reasoning, content) that can be
released now, holding back what may be the start of a tag; ``finish()`` the rest. A whole answer
runs the same parser (``split``), so streamed and whole responses agree.
"""

from __future__ import annotations

from router.parsed_output import partial_suffix

REASONING_PARSERS = ("deepseek_r1", "qwen3", "mistral", "openai_gptoss", "glm45", "deepseek_v3", "kimi_k2",
                     "minimax_m2", "minimax_m2_append_think")
# The parsers whose answers think first, without an opening tag of their own (their templates open
# the thinking in the prompt, or the model never writes it): an output constraint waits for the end.
THINKS_FIRST = ("deepseek_r1", "minimax_m2", "minimax_m2_append_think")
# The harmony format's parsers (gpt-oss): the reasoning parser and the tool-call parser of that name
# both read an answer with router.harmony.HarmonyParser.
HARMONY_REASONING_PARSER, HARMONY_TOOL_CALL_PARSER = "openai_gptoss", "openai"

START, END = "<think>", "</think>"
# Each parser's (start, end) tags.
THINK_TAGS = {"deepseek_r1": (START, END), "qwen3": (START, END), "mistral": ("[THINK]", "[/THINK]"),
              "glm45": (START, END), "deepseek_v3": (START, END), "kimi_k2": (START, END),
              "minimax_m2": (START, END), "minimax_m2_append_think": (START, END)}


def think_tags(name: str | None) -> tuple[str, str]:
    """The tags the reasoning parser ``name`` reads (``<think>``'s where there is none)."""
    return THINK_TAGS.get(name or "", (START, END))


class ReasoningParser:
    def __init__(self, needs_start_tag: bool, tags: tuple[str, str] = (START, END)) -> None:
        self.needs_start_tag = needs_start_tag
        self.start, self.end = tags
        self._state = "start"  # start (before anything but blanks), reasoning, content
        self._pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._pending += text
        reasoning = content = ""
        if self._state == "start":
            stripped = self._pending.lstrip()
            if stripped.startswith(self.start):
                self._pending, self._state = stripped[len(self.start):], "reasoning"
            elif self.start.startswith(stripped):  # blanks, or a start tag still arriving
                return "", ""
            else:
                self._state = "content" if self.needs_start_tag else "reasoning"
        if self._state == "reasoning":
            end = self._pending.find(self.end)
            if end >= 0:
                reasoning, self._pending = self._pending[:end], self._pending[end + len(self.end):]
                self._state = "content"
            else:
                keep = partial_suffix(self._pending, self.end)
                reasoning = self._pending[:len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep:]
                return reasoning, ""
        content, self._pending = self._pending, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        pending, self._pending = self._pending, ""
        if self._state == "start":  # only blanks (or a lone partial tag) were written
            return ("", pending) if self.needs_start_tag else (pending, "")
        return (pending, "") if self._state == "reasoning" else ("", pending)


class ThinkingInContentParser(ReasoningParser):
    """``minimax_m2_append_think``: no reasoning is split off; the answer is all content, its
    thinking kept in it behind the ``<think>`` the model does not write (as vLLM's parser of that
    name answers, for clients that send MiniMax-M2's thinking back in the next turn)."""

    def __init__(self) -> None:
        super().__init__(needs_start_tag=False)
        self._opened = False

    def feed(self, text: str) -> tuple[str, str]:
        if not self._opened:
            self._opened, text = True, self.start + text
        return "", text

    def finish(self) -> tuple[str, str]:
        return self.feed("") if not self._opened else ("", "")


def create_reasoning_parser(name: str, starts_thinking: bool = False) -> ReasoningParser:
    """``starts_thinking``: the prompt ended with the start tag (Qwen3's thinking-only templates write
    ``<think>`` there), so the answer reasons up to ``</think>`` without an opening tag of its own."""
    if name in ("deepseek_r1", "minimax_m2"):  # (MiniMax-M2 never writes the opening tag)
        return ReasoningParser(needs_start_tag=False)
    if name == "minimax_m2_append_think":
        return ThinkingInContentParser()
    # (GLM-4.5's answers think only after their own <think>, as Qwen3's; its template closes the
    # thinking in the prompt when enable_thinking is false, and GLM-4.7's may open it there. So do
    # DeepSeek-V3.1's, whose template opens or closes it by the `thinking` keyword, and DeepSeek-V3's
    # plain answers have none; Kimi K2 Thinking's open their own.)
    if name in ("qwen3", "mistral", "glm45", "deepseek_v3", "kimi_k2"):
        return ReasoningParser(needs_start_tag=not starts_thinking, tags=THINK_TAGS[name])
    if name == HARMONY_REASONING_PARSER:
        raise ValueError("openai_gptoss answers are read by router.harmony.HarmonyParser, not a tag parser")
    raise ValueError(f"unknown reasoning parser {name!r} (one of {', '.join(REASONING_PARSERS)})")
