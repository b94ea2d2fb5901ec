"""Per-request sampling parameters (the engine's copy; the router maps OpenAI fields onto it)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

_GREEDY_BELOW = 1e-5
_MIN_TEMPERATURE = 1e-2


def _check(condition: bool, name: str, allowed: str, value: object) -> None:
    if not condition:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    # Logprobs of the prompt's tokens (each given the tokens before it), with this many top
    # alternatives; sent with the request's first output. Such a request skips the prefix cache,
    # since cached positions are never computed.
    prompt_logprobs: int | None = None
    # e.g. {"json": schema}, {"regex": "..."}, {"choice": [...]}: the request waits for its grammar.
    structured_output: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", ">= 1", self.max_tokens)
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
               "min_tokens", f"between 0 and max_tokens ({self.max_tokens})", self.min_tokens)
        _check(math.isfinite(self.temperature) and self.temperature >= 0.0, "temperature", "finite and >= 0",
               self.temperature)
        # As vLLM: a temperature this close to 0 is greedy, and one below 0.01 is raised to it
        # (dividing logits by less overflows them to inf, and the sample turns into token 0).
        if self.temperature < _GREEDY_BELOW:
            self.temperature = 0.0
        elif self.temperature < _MIN_TEMPERATURE:
            self.temperature = _MIN_TEMPERATURE
        _check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]", self.top_p)
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", ">= -1 (0 or -1 disables)", self.top_k)
        _check(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]", self.min_p)
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "in [-2, 2]", self.presence_penalty)
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        _check(self.repetition_penalty > 0.0, "repetition_penalty", "> 0", self.repetition_penalty)
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
               "logprobs", "None or in [0, 20]", self.logprobs)
        _check(self.prompt_logprobs is None
               or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20),
               "prompt_logprobs", "None or in [0, 20]", self.prompt_logprobs)
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", "a list of non-negative token ids", self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
