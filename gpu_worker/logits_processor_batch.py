"""The batch custom logits processors see (engine_core.logits_processor): each sampling request
keeps an index (its logits row) from step to step, and the processors hear of every change.

The model runner samples a different set of requests at each step, in an order of its own. Here
each request keeps its index while it samples: one that stops sampling leaves the batch (its
index is freed), a new one takes the lowest free index, and the last requests move down into the
gaps so the indices stay 0..batch_size-1. The runner then computes the step's logits in index
order, so row i is the request at index i.

Every TP rank arranges its batch the same way (the logits are gathered across ranks in that row
order); only the rank that samples holds processors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine_core.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorContext,
    MoveDirectionality,
)
from gpu_worker.request_state import RequestState


def sync_output_ids(state: RequestState, output_ids: list[int]) -> None:
    """Bring a request's output id list (the one its processors hold) up to its tokens: the new
    ones appended (a step samples one), rewritten whole when they differ otherwise."""
    start = state.num_prompt_tokens
    tokens = state.token_ids
    known = len(output_ids)
    if start + known <= len(tokens) and (not known or output_ids[-1] == tokens[start + known - 1]):
        output_ids.extend(tokens[start + known:])
    else:
        output_ids[:] = tokens[start:]


class LogitsProcessorBatch:
    """The requests' indices, and (on the sampling rank) the processors that see them."""

    def __init__(self, classes: Sequence[type[LogitsProcessor]], context: LogitsProcessorContext,
                 device: torch.device, holds_processors: bool = True) -> None:
        processors: list[LogitsProcessor] = []
        if holds_processors:
            pin = device.type == "cuda" and torch.cuda.is_available()
            processors = [cls(context, device, pin) for cls in classes]
        self.processors = processors
        # As vLLM splits them: the argmax-invariant ones run on random rows' tempered logits only.
        self.argmax_invariant = [p for p in processors if p.is_argmax_invariant()]
        self.non_argmax_invariant = [p for p in processors if not p.is_argmax_invariant()]
        # Index -> the request there (None: a gap, only within arrange()).
        self._slots: list[RequestState | None] = []
        # Each request's output ids, as the processors were given them (a list kept up to date).
        self._output_ids: dict[int, list[int]] = {}

    @property
    def batch_size(self) -> int:
        return len(self._slots)

    def arrange(self, states: Sequence[RequestState]) -> list[int]:
        """The step's sampling requests (``states``) placed at their indices, the processors told
        how the batch changed; returns the order: ``order[i]`` is the position in ``states`` of
        the request at index i."""
        position = {id(s): i for i, s in enumerate(states)}
        slots = self._slots
        removed: list[int] = []
        for index, state in enumerate(slots):
            # (A request resumed after preemption, or a continued session, is a new state: it rejoins.)
            if id(state) not in position:
                slots[index] = None
                removed.append(index)
                del self._output_ids[id(state)]
        placed = {id(s) for s in slots if s is not None}
        added = []
        free = iter(removed)
        refilled = 0
        for state in states:
            if id(state) in placed:
                continue
            index = next(free, None)
            if index is None:
                index = len(slots)
                slots.append(state)
            else:
                slots[index] = state
                refilled += 1
            output_ids = self._output_ids[id(state)] = []
            # (A prompt given as embeddings has no token ids: None, as vLLM gives processors.)
            prompt_ids = None if state.prompt_embeds is not None else state.token_ids[:state.num_prompt_tokens]
            added.append((index, state.sampling_params, prompt_ids, output_ids))
        # (An index an added request took is not reported as removed: adding replaces what was there.)
        removed = removed[refilled:]
        moved = []
        gaps = sorted(removed)
        while slots and slots[-1] is None:
            slots.pop()
        for gap in gaps:  # the last request fills the lowest gap, until none is left below the end
            if gap >= len(slots):
                break
            last = len(slots) - 1
            slots[gap] = slots[last]
            slots.pop()
            moved.append((last, gap, MoveDirectionality.UNIDIRECTIONAL))
            while slots and slots[-1] is None:
                slots.pop()
        for state in slots:  # (the tokens sampled since: what the processors read this step)
            sync_output_ids(state, self._output_ids[id(state)])  # type: ignore[arg-type]
        update = (BatchUpdate(batch_size=len(slots), removed=sorted(removed, reverse=True), added=added,
                              moved=moved) if removed or added or moved else None)
        for processor in self.processors:
            processor.update_state(update)
        return [position[id(s)] for s in slots]  # type: ignore[arg-type]

    def apply_non_argmax_invariant(self, logits: torch.Tensor) -> torch.Tensor:
        for processor in self.non_argmax_invariant:
            logits = processor.apply(logits)
        return logits

    def apply_argmax_invariant(self, logits: torch.Tensor) -> torch.Tensor:
        for processor in self.argmax_invariant:
            logits = processor.apply(logits)
        return logits
