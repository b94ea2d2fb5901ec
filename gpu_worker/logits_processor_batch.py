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

from collections.abc import Iterator, Sequence
from typing import overload

import torch

from engine_core.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorContext,
    MoveDirectionality,
)
from gpu_worker.request_state import RequestState


class OutputTokenIds(Sequence[int]):
    """A live view of a request's generated token ids: it grows as the request samples."""

    __slots__ = ("_state",)

    def __init__(self, state: RequestState) -> None:
        self._state = state

    def __len__(self) -> int:
        return len(self._state.token_ids) - self._state.num_prompt_tokens

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        start = self._state.num_prompt_tokens
        if isinstance(index, slice):
            return self._state.token_ids[start:][index]
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("output token index out of range")
        return self._state.token_ids[start + index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._state.token_ids[self._state.num_prompt_tokens:])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"OutputTokenIds({list(self)})"


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
            if state is None or id(state) not in position:
                slots[index] = None
                removed.append(index)
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
            added.append((index, state.sampling_params, state.token_ids[:state.num_prompt_tokens],
                          OutputTokenIds(state)))
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
