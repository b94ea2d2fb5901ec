"""Custom logits processors for the tests (importable by the engines, which load them by name)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine_core.logits_processor import (
    AdapterLogitsProcessor,
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorContext,
    process_dict_updates,
)
from engine_core.sampling_params import SamplingParams


class TargetTokenProcessor(LogitsProcessor):
    """vLLM's example: a request with ``extra_args["target_token"]`` can only sample that token."""

    def __init__(self, context: LogitsProcessorContext, device: torch.device, is_pin_memory: bool) -> None:
        self.vocab_size = context.vocab_size
        self.targets: dict[int, int] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        target = (sampling_params.extra_args or {}).get("target_token")
        if target is not None and (type(target) is not int or target < 0):
            raise ValueError(f"target_token must be a non-negative integer, got {target!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.targets, batch_update,
                             lambda params, _prompt, _out: (params.extra_args or {}).get("target_token"))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.targets:
            return logits
        rows = torch.tensor(list(self.targets), device=logits.device)
        cols = torch.tensor(list(self.targets.values()), device=logits.device)
        kept = logits[rows, cols]
        logits[rows] = float("-inf")
        logits[rows, cols] = kept
        return logits


class OnlyTheBestProcessor(LogitsProcessor):
    """Argmax-invariant: a request with ``extra_args["only_the_best"]`` keeps only its largest logit,
    so even a random row picks the greedy token. Counts its calls (the engine skips it on a batch
    of greedy rows only)."""

    applied = 0

    def __init__(self, context: LogitsProcessorContext, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, bool] = {}

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update,
                             lambda params, _prompt, _out: True if (params.extra_args or {}).get("only_the_best")
                             else None)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        type(self).applied += 1
        for row in self.rows:
            best = logits[row].argmax()
            kept = logits[row, best].clone()
            logits[row] = float("-inf")
            logits[row, best] = kept
        return logits


class NoEchoAdapter(AdapterLogitsProcessor):
    """A per-request function (prompt ids, output ids, row): a request with ``extra_args["no_echo"]``
    never samples a token of its prompt, nor the token it sampled last (the output ids are live)."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        if not (params.extra_args or {}).get("no_echo"):
            return None

        def forbid(prompt_ids: Sequence[int], output_ids: Sequence[int], row: torch.Tensor) -> torch.Tensor:
            banned = list(prompt_ids) + ([output_ids[-1]] if output_ids else [])
            row[banned] = float("-inf")
            return row

        return forbid


class NotAProcessor:
    """Not a LogitsProcessor subclass (refused by the loader)."""
