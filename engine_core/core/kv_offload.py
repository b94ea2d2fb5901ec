"""KV cache offloading to host memory (vLLM's ``--kv-offloading-size``, its native CPU backend): a
second tier of the prefix cache, behind the device's block pool.

When the pool hands out a free block that still holds a cached prefix (an eviction), the tier keeps
a copy of that block under its hash, in one of its own slots (least recently used slots are reused
first). When a new request's prompt continues past the blocks the device cache holds, the blocks
the tier holds next are copied back into freshly allocated device blocks and count as computed, as
vLLM counts a KV connector's hits: the prompt skips that compute.

This module only decides (no torch): the scheduler gets each pass's copies as two lists in its
SchedulerOutput, ``kv_offload_stores`` (device block -> slot) and ``kv_offload_loads`` (slot ->
device block), and the workers run them before the pass's forward, stores first. So a block
evicted in a pass is saved before that pass overwrites it, and a slot a pass loads from is never
reused by the same pass's stores (its loads pin it).

Under the hybrid KV cache manager a windowed group's blocks are cached, evicted and kept here under
(group, hash) keys, beside group 0's plain hashes: a slot holds any group's block (a block id is a page
of each of the groups' shared tensors, whichever group holds it). KV cache events, and ``hashes()``,
follow the plain hashes alone, as the pool's do.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from engine_core.core.block_pool import TIER_REMOVED, TIER_STORED
from engine_core.core.kv_cache_utils import BlockHash


@dataclass
class OffloadStats:
    """Counters since the previous take (blocks copied each way, and prompt blocks found in the tier)."""

    stored_blocks: int = 0
    loaded_blocks: int = 0


class OffloadTier:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the offloading tier needs at least one block, got {num_slots}")
        self.num_slots = num_slots
        # Key (a hash, or a windowed group's (group, hash)) -> slot, least recently used first.
        self._slot_of: OrderedDict[Hashable, int] = OrderedDict()
        self._free_slots = list(range(num_slots - 1, -1, -1))
        # This pass: device blocks evicted with their hashes (saved when the pass's copies are taken),
        # and the loads planned, whose slots no store may take.
        self._evicted: list[tuple[int, Hashable]] = []
        self._loads: list[tuple[int, int]] = []
        self._pinned: set[int] = set()
        self.stats = OffloadStats()
        # Told of each hash the tier starts or stops holding (KV cache events, for prefix-aware routers).
        self.on_event: Callable[[int, BlockHash], None] | None = None

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slot_of

    def note_evicted(self, block_id: int, block_hash: Hashable) -> None:
        """The block pool handed out a block that held ``block_hash``: save it before the pass writes it."""
        self._evicted.append((block_id, block_hash))

    def lookup(self, block_hashes: Sequence[Hashable]) -> list[int]:
        """The slots holding the longest run of ``block_hashes`` from its start. Not touched: a
        request the scheduler then turns away (no room, a partial-prefill cap) must not keep them
        warm; ``touch`` marks those a pass loads."""
        slots = []
        slot_of = self._slot_of
        for block_hash in block_hashes:
            slot = slot_of.get(block_hash)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def touch(self, block_hashes: Sequence[Hashable]) -> None:
        """Mark these held hashes most recently used."""
        slot_of = self._slot_of
        for block_hash in block_hashes:
            if block_hash in slot_of:
                slot_of.move_to_end(block_hash)

    def plan_loads(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy these slots into these device blocks before the pass (the blocks' hashes are the slots')."""
        self._loads.extend(zip(slots, block_ids, strict=True))
        self._pinned.update(slots)
        self.stats.loaded_blocks += len(slots)

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This pass's (stores, loads): each evicted block saved in a free or least recently used
        slot that no load and no other store of the pass uses (a hash the tier holds already is not
        saved again). A pass evicting more blocks than that saves the first ones only: two stores
        into one slot would leave it a mix of both blocks."""
        stores: list[tuple[int, int]] = []
        slot_of = self._slot_of
        for block_id, block_hash in self._evicted:
            if block_hash in slot_of:
                slot_of.move_to_end(block_hash)
                continue
            slot = self._take_slot()
            if slot is None:
                break  # (every slot is loaded from or stored to this pass: the rest are not saved)
            self._pinned.add(slot)
            slot_of[block_hash] = slot
            stores.append((block_id, slot))
            if self.on_event is not None and isinstance(block_hash, bytes):
                self.on_event(TIER_STORED, block_hash)
        self.stats.stored_blocks += len(stores)
        loads = self._loads
        self._evicted, self._loads, self._pinned = [], [], set()
        return stores, loads

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for block_hash, slot in self._slot_of.items():
            if slot not in self._pinned:
                del self._slot_of[block_hash]
                if self.on_event is not None and isinstance(block_hash, bytes):
                    self.on_event(TIER_REMOVED, block_hash)
                return slot
        return None

    def hashes(self) -> list[BlockHash]:
        """Every plain hash the tier holds (least recently used first; no windowed group's key)."""
        return [key for key in self._slot_of if isinstance(key, bytes)]

    def reset(self) -> None:
        """Forget every saved block (the prefix cache was reset: what they hold may be stale)."""
        self._slot_of.clear()
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self._evicted, self._loads, self._pinned = [], [], set()

    def take_stats(self) -> OffloadStats:
        stats, self.stats = self.stats, OffloadStats()
        return stats
