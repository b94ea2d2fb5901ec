"""The pool of KV blocks: allocation, reference counts, LRU eviction and the prefix-cache map."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence

from engine_core.core.block_residency import BlockResidency
from engine_core.core.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock

# KV cache events (vLLM's BlockStored / BlockRemoved / AllBlocksCleared), in the order they happened:
# (kind, block hashes). Applied in order to a set, they give the set of hashes the pool caches.
# TIER_STORED / TIER_REMOVED are the same for KV offloading's host tier (vLLM's events with medium
# "CPU"); ALL_BLOCKS_CLEARED empties both.
BLOCKS_STORED, BLOCKS_REMOVED, ALL_BLOCKS_CLEARED, TIER_STORED, TIER_REMOVED = 0, 1, 2, 3, 4
KVEvent = tuple[int, list[BlockHash]]


class BlockPool:
    """Invariants (``check_integrity``): a block is free xor referenced; free + used == total;
    the hash map and the blocks' own ``block_hash`` agree."""

    def __init__(self, num_blocks: int, enable_caching: bool, residency: BlockResidency | None = None) -> None:
        self.num_blocks = num_blocks
        # --kv-cache-metrics: a sample of the blocks followed from allocation to eviction.
        self.residency = residency
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # Each cached hash's blocks, by block id: two requests computing one prefix at once (chunked
        # prefill) each fill a block of it, and both stay hits until evicted (as vLLM keeps them).
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        # Recorded while someone listens (a prefix-aware router): None when nobody does.
        self.kv_events: list[KVEvent] | None = None
        # Told of each cached block handed out again, with its key (KV offloading's tier saves it).
        self.on_evict: Callable[[int, BlockHash], None] | None = None

    def record_kv_events(self) -> None:
        if self.kv_events is None:
            self.kv_events = []

    def stop_kv_events(self) -> None:
        self.kv_events = None

    def take_kv_events(self) -> list[KVEvent]:
        """The events since the last call (none while not recording)."""
        if not self.kv_events:
            return []
        events, self.kv_events = self.kv_events, []
        return events

    def record_event(self, kind: int, block_hash: BlockHash | None) -> None:
        """Add an event to the pool's (for KV offloading's tier, whose events interleave with ours)."""
        self._event(kind, block_hash)

    def _event(self, kind: int, block_hash: BlockHash | None) -> None:
        events = self.kv_events
        if events is None:
            return
        if kind == ALL_BLOCKS_CLEARED:
            events.append((kind, []))
        elif events and events[-1][0] == kind:
            events[-1][1].append(block_hash)  # type: ignore[arg-type]
        else:
            events.append((kind, [block_hash]))  # type: ignore[list-item]

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        blocks = self.cached_block_hash_to_block.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.free_block_queue.num_free_blocks:
            # Callers check capacity first (allocate_slots returns None): reaching here is a bug.
            raise ValueError(f"cannot get {num_blocks} blocks, {self.get_num_free_blocks()} free")
        popleft = self.free_block_queue.popleft
        residency = self.residency
        new_blocks = []
        for _ in range(num_blocks):
            block = popleft()
            if residency is not None:  # (as vLLM: a followed block handed out again ends its residency)
                residency.evicted(block.block_id)
                residency.allocated(block.block_id)
            if block.block_hash is not None:
                block_hash, in_hit_window = block.block_hash, block.in_hit_window
                # (KV offloading saves an evicted prefix block, unless another copy stays cached; of a
                # windowed group's blocks, only those within a window a hit would need.)
                if (self._evict(block) and self.on_evict is not None
                        and (in_hit_window or isinstance(block_hash, bytes))):
                    self.on_evict(block.block_id, block_hash)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def _evict(self, block: KVCacheBlock) -> bool:
        """Take the block out of the prefix cache; whether it was its hash's last cached copy (then
        the hash leaves the cache, and KV events say so)."""
        block_hash, block.block_hash = block.block_hash, None
        in_hit_window, block.in_hit_window = block.in_hit_window, False
        copies = self.cached_block_hash_to_block.get(block_hash)  # type: ignore[arg-type]
        if copies is None or copies.pop(block.block_id, None) is None:
            return False
        if copies:
            if in_hit_window:  # (the copy left keeps its worth for KV offloading's tier)
                next(iter(copies.values())).in_hit_window = True
            return False
        del self.cached_block_hash_to_block[block_hash]  # type: ignore[arg-type]
        # (A windowed group's (group, hash) key is no event: the events follow group 0's hashes alone.)
        if self.kv_events is not None and isinstance(block_hash, bytes):
            self._event(BLOCKS_REMOVED, block_hash)
        return True

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash],
                          start: int, end: int, key: Callable[[BlockHash], Hashable] | None = None) -> None:
        """Register blocks[start:end] under their hashes; a hash another block already holds gets
        this block as a further copy (KV events report a hash once, when its first copy is cached).
        ``key``: the cache's key for a hash (a hybrid model's windowed group keys its blocks by
        (group, hash): KV events follow the full-attention group's, the plain hashes, alone)."""
        cached = self.cached_block_hash_to_block
        for i in range(start, end):
            block = blocks[i]
            if block.block_hash is not None:
                continue
            block_hash = block_hashes[i] if key is None else key(block_hashes[i])
            copies = cached.get(block_hash)
            if copies is None:
                copies = cached[block_hash] = {}
                if self.kv_events is not None and key is None:
                    self._event(BLOCKS_STORED, block_hash)
            block.block_hash = block_hash
            copies[block.block_id] = block

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop blocks from the prefix cache whose contents will not be computed after all."""
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on shared (prefix-hit) blocks; a free one leaves the free queue."""
        residency = self.residency
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1
            if residency is not None:
                residency.reused(block.block_id)

    def refresh(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Move the free ones among ``blocks`` to the end of the eviction order, as if just freed (a
        prefix hit used them without taking them)."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
                queue.append(block)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each; blocks reaching zero join the free queue in this order
        (first freed, first evicted)."""
        append = self.free_block_queue.append
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for copies in self.cached_block_hash_to_block.values():
            for block in copies.values():
                block.block_hash, block.in_hit_window = None, False
        self.cached_block_hash_to_block.clear()
        if self.residency is not None:
            self.residency.clear()
        self._event(ALL_BLOCKS_CLEARED, None)
        return True

    def check_integrity(self) -> None:
        """Raise AssertionError if any pool invariant is broken (tests call this after every step)."""
        free_ids = set()
        for block in self.free_block_queue:
            assert block.block_id not in free_ids, f"block {block.block_id} twice in the free queue"
            free_ids.add(block.block_id)
        assert len(free_ids) == self.free_block_queue.num_free_blocks, "free count out of sync"
        used = 0
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"{block} has a negative ref count"
            is_free = block.block_id in free_ids
            assert is_free == (block.ref_cnt == 0), f"{block}: free={is_free} but ref_cnt={block.ref_cnt}"
            used += not is_free
            if block.block_hash is not None:
                assert self.cached_block_hash_to_block.get(block.block_hash, {}).get(block.block_id) is block, \
                    f"{block} has a hash the cache map does not point back to it under"
        assert used + len(free_ids) == self.num_blocks, "free + used != total"
        for block_hash, copies in self.cached_block_hash_to_block.items():
            assert copies, "a cached hash with no block"
            for block_id, block in copies.items():
                assert block.block_id == block_id and block.block_hash == block_hash, \
                    f"cache map entry for {block} has the wrong hash or id"
