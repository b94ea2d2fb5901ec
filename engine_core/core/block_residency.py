"""How long KV blocks live in the pool (vLLM's ``--kv-cache-metrics``): a sample of the blocks is
followed from allocation until they are handed out again (evicted: from the prefix cache for a
cached block), and each reports its lifetime (allocation to eviction), how long it sat unused
before (idle since its last use), and the gaps between its reuses (its last few prefix-cache hits),
so an operator can see whether the pool is large enough for the prefixes worth keeping.

Only ``sample_rate`` of the allocations are followed (``--kv-cache-metrics-sample``, 1% by default,
as vLLM), so the pass pays a random draw and a dict pop per allocated block and a dict lookup per
prefix-cache hit."""

from __future__ import annotations

import itertools
import random
import time
from collections import deque
from collections.abc import Callable

# Reuses remembered per block (the gaps between the last ones are reported).
_HISTORY = 4
# (lifetime s, idle before eviction s, gaps between reuses s)
ResidencyEvent = tuple[float, float, list[float]]


class _Followed:
    __slots__ = ("born", "last_used", "reuses")

    def __init__(self, now: float) -> None:
        self.born = self.last_used = now
        self.reuses: deque[float] = deque(maxlen=_HISTORY)


class BlockResidency:
    def __init__(self, sample_rate: float, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"kv_cache_metrics_sample must be in (0, 1], got {sample_rate}")
        self.sample_rate = sample_rate
        self._clock = clock
        self._random = (rng or random.Random()).random
        self._followed: dict[int, _Followed] = {}
        self._events: list[ResidencyEvent] = []

    def allocated(self, block_id: int) -> None:
        """A block handed out for new tokens: followed from now, if sampled."""
        if self.sample_rate >= 1.0 or self._random() < self.sample_rate:
            self._followed[block_id] = _Followed(self._clock())

    def reused(self, block_id: int) -> None:
        """A prefix-cache hit on the block."""
        followed = self._followed.get(block_id)
        if followed is not None:
            followed.last_used = self._clock()
            followed.reuses.append(followed.last_used)

    def evicted(self, block_id: int) -> None:
        """The block is handed out again, for other tokens."""
        followed = self._followed.pop(block_id, None)
        if followed is None:
            return
        now = self._clock()
        gaps = [b - a for a, b in itertools.pairwise(followed.reuses)]  # (as vLLM: between reuses)
        self._events.append((now - followed.born, now - followed.last_used, gaps))

    def clear(self) -> None:
        """The prefix cache was emptied: no block of it is followed any longer."""
        self._followed.clear()

    def drain(self) -> list[ResidencyEvent]:
        events, self._events = self._events, []
        return events
