"""Engine-side configuration: frozen dataclasses validated in ``__post_init__``.

A bad value raises ``ValueError`` naming the flag and its allowed range; user input is never
checked with ``assert``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SchedulingPolicyName = Literal["fcfs", "priority"]


def _require(condition: bool, flag: str, allowed: str, value: object) -> None:
    if not condition:
        raise ValueError(f"{flag} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # When set, outranks max_num_batched_tokens as the per-pass token budget (seed: "silently outranks").
    max_num_scheduled_tokens: int | None = None
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    policy: SchedulingPolicyName = "fcfs"

    def __post_init__(self) -> None:
        _require(isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1,
                 "max_num_seqs", ">= 1", self.max_num_seqs)
        _require(isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1,
                 "max_num_batched_tokens", ">= 1", self.max_num_batched_tokens)
        _require(self.max_num_scheduled_tokens is None
                 or (isinstance(self.max_num_scheduled_tokens, int) and self.max_num_scheduled_tokens >= 1),
                 "max_num_scheduled_tokens", "None or >= 1", self.max_num_scheduled_tokens)
        _require(isinstance(self.max_model_len, int) and self.max_model_len >= 1,
                 "max_model_len", ">= 1", self.max_model_len)
        _require(isinstance(self.long_prefill_token_threshold, int) and self.long_prefill_token_threshold >= 0,
                 "long_prefill_token_threshold", ">= 0", self.long_prefill_token_threshold)
        _require(isinstance(self.max_num_partial_prefills, int) and self.max_num_partial_prefills >= 1,
                 "max_num_partial_prefills", ">= 1", self.max_num_partial_prefills)
        _require(isinstance(self.max_long_partial_prefills, int)
                 and 1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills,
                 "max_long_partial_prefills", f"between 1 and max_num_partial_prefills "
                 f"({self.max_num_partial_prefills})", self.max_long_partial_prefills)
        _require(self.policy in ("fcfs", "priority"), "policy", "one of 'fcfs', 'priority'", self.policy)
        # Seed: with max_num_partial_prefills > 1 and no threshold given, the config fills the
        # threshold in as 4% of the model's context length.
        if self.max_num_partial_prefills > 1 and self.long_prefill_token_threshold == 0:
            object.__setattr__(self, "long_prefill_token_threshold", int(self.max_model_len * 0.04))

    @property
    def token_budget(self) -> int:
        """The per-pass budget the scheduler seeds ``token_budget`` from."""
        # max_num_scheduled_tokens outranks max_num_batched_tokens when it is set.
        if self.max_num_scheduled_tokens is not None:
            return self.max_num_scheduled_tokens
        return self.max_num_batched_tokens


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Usable KV blocks. There is no reserved null block in this engine, so every id in
    # [0, num_blocks) can hold tokens.
    num_blocks: int = 4096
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _require(isinstance(self.block_size, int) and self.block_size >= 1, "block_size", ">= 1", self.block_size)
        _require(isinstance(self.num_blocks, int) and self.num_blocks >= 1, "num_blocks", ">= 1", self.num_blocks)
