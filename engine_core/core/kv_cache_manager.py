"""Per-request KV block bookkeeping on top of the BlockPool, with prefix caching.

Under a sliding window that every layer attends through (Mistral v0.1, Phi-3), a request's blocks
that lie wholly before the window of its next token are released as it advances, as vLLM's
SlidingWindowManager does: they go back to the pool (still in the prefix cache until evicted) and a
placeholder keeps their place in the request's list, so block indexes stay positions // block_size.
The model runner never reads them: its attention starts at each request's window.

A model mixing full-attention and windowed layers (Gemma 2/3, GPT-OSS, Cohere2, Llama 4's chunked
layers) keeps, under the hybrid KV cache manager (vLLM's), a list of blocks per KV cache group and
request: group 0's (full attention) as above, and each further group's at the same positions, those
behind its window released the same way (``_WindowedGroup``). The groups share one pool: a block id
addresses a page of each of the workers' shared tensors (gpu_worker/kv_cache_groups.py), so a
windowed group's blocks cost as much as a full one's, and a long request holds the full group's
blocks and a window's worth of each windowed group's. A windowed group's blocks are cached under
(group, hash); a prefix hit needs the full group's blocks up to it and each windowed group's from the
window of its first token computed. KV offloading's host tier keeps the full groups' evicted blocks and a
windowed group's within a window a later hit would need (``_mark_hit_windows``), under the same keys; a
hit it extends needs the same of them, from the device or the tier (``get_offloaded_blocks``).
"""

from __future__ import annotations

from collections.abc import Callable

from engine_core.core.block_pool import BlockPool
from engine_core.core.block_residency import BlockResidency
from engine_core.core.kv_cache_utils import AttentionWindow, KVCacheBlock, extend_block_hashes
from engine_core.core.kv_offload import OffloadTier
from engine_core.core.recurrent_state_cache import RecurrentStateCache
from engine_core.outputs import PrefixCacheStats
from engine_core.request import Request


class KVCacheBlocks:
    """A set of blocks handed back by the manager (what vLLM's allocate_slots returns): group 0's, and
    under the hybrid KV cache manager each further group's at the same positions (``group_blocks``)."""

    __slots__ = ("blocks", "group_blocks")

    def __init__(self, blocks: list[KVCacheBlock], group_blocks: tuple[list[KVCacheBlock], ...] = ()) -> None:
        self.blocks = blocks
        self.group_blocks = group_blocks

    def get_block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    def get_group_block_ids(self) -> list[list[int]]:
        """Each further group's block ids (none without the hybrid KV cache manager)."""
        return [[b.block_id for b in blocks] for blocks in self.group_blocks]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        """These blocks, then ``other``'s, group by group (a request given slots twice in a pass)."""
        if not self.group_blocks or not other.group_blocks:  # (one of them has no blocks)
            return KVCacheBlocks(self.blocks + other.blocks, self.group_blocks or other.group_blocks)
        return KVCacheBlocks(self.blocks + other.blocks,
                             tuple(a + b for a, b in zip(self.group_blocks, other.group_blocks, strict=True)))

    def __len__(self) -> int:
        return len(self.blocks)

    def __bool__(self) -> bool:
        return bool(self.blocks)


class OffloadedBlocks:
    """What KV offloading's host tier adds to a request's device hit (vLLM's external tokens):
    ``num_blocks`` more prompt blocks, the tier's copies to load into them (``loads``: group, position,
    slot; group 0 the full-attention group), and the device hit as allocate_slots then takes it
    (``computed``). Without KV cache groups the blocks after the device hit are all the tier's, each a
    new block. Under the hybrid KV cache manager the device hit may stop short of blocks the device
    still holds (a windowed group's block of the window missing): ``computed`` then runs on to the longer
    hit, each position a device block or None (a new block the tier's copy is loaded into), each
    windowed group's from the window of the first token computed (placeholders before); ``passed`` are
    the windowed groups' device-hit blocks the longer window leaves behind, with their keys."""

    __slots__ = ("computed", "loads", "num_blocks", "passed")

    def __init__(self, num_blocks: int, computed: KVCacheBlocks, loads: list[tuple[int, int, int]] | None = None,
                 passed: list[tuple[KVCacheBlock, object]] | None = None) -> None:
        self.num_blocks = num_blocks
        self.computed = computed
        self.loads = loads or []
        self.passed = passed or []

    @property
    def num_loaded_blocks(self) -> int:
        """Group 0's blocks read from the tier (the prompt positions it brings)."""
        return sum(1 for group, _, _ in self.loads if group == 0)

    def __len__(self) -> int:
        return self.num_blocks

    def __bool__(self) -> bool:
        return self.num_blocks > 0


# Stands in a request's block list for a block released behind its sliding window. It belongs to no
# pool; its id (0) reaches the model runner's block table only where attention never reads.
RELEASED_BLOCK = KVCacheBlock(0)


class _WindowedGroup:
    """A windowed KV cache group of a hybrid model (after group 0, the full-attention one): each
    request's blocks at the same positions as group 0's, those wholly before the first key of its next
    token released (RELEASED_BLOCK in their place), its blocks cached under (group, hash)."""

    def __init__(self, index: int, window: AttentionWindow | None) -> None:
        self.index = index
        # (None: full attention, a further full group where there are more full layers than a group holds.)
        self.window = window
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.num_released_block: dict[str, int] = {}

    def key(self, block_hash: bytes) -> tuple[int, bytes]:
        return self.index, block_hash

    def first_needed_block(self, num_tokens: int, block_size: int) -> int:
        """The first block the token at position ``num_tokens`` attends to."""
        return 0 if self.window is None else self.window.first_key(num_tokens) // block_size

    def longest_hit(self, pool: BlockPool, block_hashes: list[bytes], num_blocks: int, block_size: int) -> int:
        """The most of the first ``num_blocks`` blocks a prefix hit may cover for this group: m such
        that its blocks from the window of position m * block_size to m are all cached. (A block missing
        below m is needed by every hit from it up to m, since a window's first block never moves back.)"""
        m = num_blocks
        while m > 0:
            first = self.first_needed_block(m * block_size, block_size)
            missing = next((j for j in range(m - 1, first - 1, -1)
                            if pool.get_cached_block(self.key(block_hashes[j])) is None), None)  # type: ignore[arg-type]
            if missing is None:
                return m
            m = missing
        return 0

    def longest_tier_hit(self, holds: Callable[[object], bool], block_hashes: list[bytes], floor: int,
                         num_blocks: int, block_size: int) -> int:
        """longest_hit past a device hit of ``floor`` blocks (whose window this group's device blocks
        cover) up to ``num_blocks``: the most m such that ``holds`` (the device cache or KV offloading's
        tier) has this group's blocks from the window of position m * block_size (or ``floor``) to m."""
        m = num_blocks
        while m > floor:
            first = max(floor, self.first_needed_block(m * block_size, block_size))
            missing = next((j for j in range(m - 1, first - 1, -1) if not holds(self.key(block_hashes[j]))), None)
            if missing is None:
                return m
            m = missing
        return floor


def _first_hole(blocks: list[KVCacheBlock | None] | tuple[()]) -> int:
    """Where a prefix hit's blocks first hold None (a new block for a tier's copy), else their count."""
    return next((i for i, b in enumerate(blocks) if b is None), len(blocks))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 log_stats: bool = True, sliding_window: int | None = None,
                 long_rope_after: int | None = None, kv_cache_metrics_sample: float | None = None,
                 max_model_len: int | None = None, num_offload_blocks: int = 0,
                 num_recurrent_state_slots: int = 0,
                 kv_cache_groups: tuple[AttentionWindow | None, ...] = ()) -> None:
        self.block_size = block_size
        # Lookahead slots (a draft model's) never reach past the longest context a request may have.
        self.max_model_len = max_model_len
        # LongRoPE models: prompts longer than this use the long rotary factors (their own prefixes).
        self.long_rope_after = long_rope_after
        # The window every layer attends through (None: full attention, every block kept).
        self.sliding_window = sliding_window
        # How many of a request's leading blocks were released behind its window.
        self.num_released_block: dict[str, int] = {}
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        # (Residency events leave with the stats: none are kept without them. An engine without a
        # prefix cache asks for none.)
        followed = kv_cache_metrics_sample is not None and log_stats
        self.block_pool = BlockPool(num_blocks, enable_caching,
                                    BlockResidency(kv_cache_metrics_sample) if followed else None)
        # KV offloading (--kv-offloading-size): the host-memory tier behind the pool's prefix cache.
        self.offload = OffloadTier(num_offload_blocks) if num_offload_blocks and enable_caching else None
        if self.offload is not None:
            self.block_pool.on_evict = self.offload.note_evicted
            self.offload.on_event = self.block_pool.record_event
        # A model with recurrent layers (--mamba-cache-mode align): the states kept at block boundaries, which
        # bound every prefix hit (engine_core/core/recurrent_state_cache.py).
        self.recurrent_states = (RecurrentStateCache(num_recurrent_state_slots)
                                 if num_recurrent_state_slots and enable_caching else None)
        # The block hash of the last state each request kept (not at a shared prefix's end).
        self._own_state: dict[str, bytes] = {}
        # Where a request's prompt leaves the run of blocks the KV cache held at its lookup, when that run
        # went on past the last state kept (the end of a prefix other prompts share): the pass that crosses
        # it keeps the state there (plan_state_saves), for the next prompt sharing it.
        self.state_junctions: dict[str, int] = {}
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of a request's leading blocks are registered (or known) in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        # The hybrid KV cache manager's groups after group 0 (these dicts' own): none otherwise.
        if kv_cache_groups and (kv_cache_groups[0] is not None or sliding_window is not None):
            raise ValueError("kv_cache_groups: group 0 attends fully (and no sliding_window beside them)")
        self.groups = [_WindowedGroup(i, w) for i, w in enumerate(kv_cache_groups[1:], start=1)]
        self.prefix_cache_stats = PrefixCacheStats()
        # The offloading tier's lookups (vLLM's connector_prefix_cache_stats: vLLM offloads through a
        # KV connector): the request's tokens queried, the tokens its blocks after the device hit hold.
        self.connector_prefix_cache_stats = PrefixCacheStats() if self.offload is not None and log_stats else None
        self._empty = KVCacheBlocks([])
        # Under the KV cache groups beside KV offloading: how many blocks each request's prefix hit at its
        # (latest) admission covered.
        self._hit_blocks: dict[str, int] = {}
        # (A request's lookup found nothing in the offloading tier, or there is none.)
        self.no_offloaded_blocks = OffloadedBlocks(0, self._empty)

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def empty_kv_cache_blocks(self) -> KVCacheBlocks:
        return self._empty

    def _long_rope(self, request: Request) -> bool:
        return self.long_rope_after is not None and request.num_prompt_tokens > self.long_rope_after

    def get_computed_blocks(self, request: Request, record: bool = True) -> tuple[KVCacheBlocks, int]:
        """Longest run of the request's full blocks already in the prefix cache, and its token count.
        ``record``: count the lookup in the prefix cache's stats now (else ``record_lookup`` does, if
        the scheduler goes on with the request)."""
        if not self.enable_caching or request.sampling_params.skip_reading_prefix_cache:
            return self._empty, 0
        block_size = self.block_size
        # The last prompt token is always recomputed: its logits are needed to sample.
        max_hit_blocks = (request.num_tokens - 1) // block_size
        extend_block_hashes(request.block_hashes, request.all_token_ids, max_hit_blocks, block_size,
                            request.cache_salt, request.lora_key, self._long_rope(request), request.prompt_embeds,
                            request.mm_features)
        get_cached = self.block_pool.get_cached_block
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = get_cached(block_hash)
            if block is None:
                break
            hits.append(block)
        group_hits: tuple[list[KVCacheBlock], ...] = ()
        if self.groups and hits:
            group_hits = self._group_hits(request.block_hashes, hits)
        if self.recurrent_states is not None:
            # (Recurrent layers start from a kept state: the hit ends where the last one stands.)
            num_kv_blocks = len(hits)
            del hits[self.recurrent_states.longest_hit(request.block_hashes, num_kv_blocks):]
            if num_kv_blocks > len(hits):
                self.state_junctions[request.request_id] = num_kv_blocks * block_size
            else:
                self.state_junctions.pop(request.request_id, None)
        num_hit_tokens = len(hits) * block_size
        if record:
            self.record_lookup(request, num_hit_tokens)
        return (KVCacheBlocks(hits, group_hits) if hits else self._empty), num_hit_tokens

    def _group_hits(self, block_hashes: list[bytes], hits: list[KVCacheBlock]) -> tuple[list[KVCacheBlock], ...]:
        """Cut group 0's ``hits`` to the longest prefix every windowed group holds too, and each such
        group's blocks for it (RELEASED_BLOCK behind the window of the first token computed)."""
        pool, block_size = self.block_pool, self.block_size
        num_hit = len(hits)
        while True:  # (each group may shorten the hit, which moves the others' windows: until none does)
            shortest = num_hit
            for group in self.groups:
                shortest = group.longest_hit(pool, block_hashes, shortest, block_size)
            if shortest == num_hit:
                break
            num_hit = shortest
        del hits[num_hit:]
        group_hits = []
        for group in self.groups:
            first = group.first_needed_block(num_hit * block_size, block_size)
            group_hits.append([RELEASED_BLOCK] * first + [pool.get_cached_block(group.key(h))  # type: ignore[misc]
                                                          for h in block_hashes[first:num_hit]])
        return tuple(group_hits)

    def record_lookup(self, request: Request, num_hit_tokens: int) -> None:
        if self.log_stats and self.enable_caching and not request.sampling_params.skip_reading_prefix_cache:
            self.prefix_cache_stats.record(request.num_tokens, num_hit_tokens, request.num_preemptions > 0)

    def get_offloaded_blocks(self, request: Request, computed: KVCacheBlocks) -> OffloadedBlocks:
        """What the offloading tier adds to the request's device hit ``computed`` (get_computed_blocks';
        nothing without a tier): the prompt's next full blocks it holds. Under the hybrid KV cache manager
        each position of the longer hit is the device's block where it still holds it, else the tier's
        copy, and the hit is cut to where every windowed group's blocks of its window are there too."""
        tier = self.offload
        if tier is None or request.sampling_params.skip_reading_prefix_cache:
            return self.no_offloaded_blocks
        block_size, block_hashes = self.block_size, request.block_hashes
        num_local = len(computed)
        max_hit_blocks = (request.num_tokens - 1) // block_size  # (the last token is computed)
        if not self.groups:
            slots = tier.lookup(block_hashes[num_local:max_hit_blocks])
            return OffloadedBlocks(len(slots), computed,
                                   [(0, p, slot) for p, slot in enumerate(slots, start=num_local)])
        get_cached = self.block_pool.get_cached_block

        def holds(key: object) -> bool:
            return key in tier or get_cached(key) is not None  # type: ignore[arg-type]

        num_hit = num_local
        while num_hit < max_hit_blocks and holds(block_hashes[num_hit]):
            num_hit += 1
        while num_hit > num_local:  # (as _group_hits: until no group shortens the hit)
            shortest = num_hit
            for group in self.groups:
                shortest = group.longest_tier_hit(holds, block_hashes, num_local, shortest, block_size)
            if shortest == num_hit:
                break
            num_hit = shortest
        if num_hit == num_local:
            return self.no_offloaded_blocks
        cut, passed = self.cut_group_hits(computed, num_hit * block_size)
        loads: list[tuple[int, int, int]] = []
        blocks = self._device_or_tier(0, lambda h: h, block_hashes, num_local, num_hit, loads)
        group_blocks = [hits + self._device_or_tier(g, group.key, block_hashes, len(hits), num_hit, loads)
                        for g, (group, hits) in enumerate(zip(self.groups, cut.group_blocks, strict=True), start=1)]
        return OffloadedBlocks(num_hit - num_local, KVCacheBlocks(cut.blocks + blocks, tuple(group_blocks)), loads,
                               passed)

    def _device_or_tier(self, group: int, key: Callable[[bytes], object], block_hashes: list[bytes], start: int,
                        end: int, loads: list[tuple[int, int, int]]) -> list[KVCacheBlock | None]:
        """A group's blocks at positions ``start`` to ``end`` of a hit the tier extends: the device's cached
        block, else None, its tier copy added to ``loads``."""
        tier = self.offload
        assert tier is not None
        blocks: list[KVCacheBlock | None] = []
        for position in range(start, end):
            block = self.block_pool.get_cached_block(key(block_hashes[position]))  # type: ignore[arg-type]
            if block is None:
                (slot,) = tier.lookup([key(block_hashes[position])])
                loads.append((group, position, slot))
            blocks.append(block)
        return blocks

    def cut_group_hits(self, computed: KVCacheBlocks, num_tokens: int
                       ) -> tuple[KVCacheBlocks, list[tuple[KVCacheBlock, object]]]:
        """A device hit ``computed`` that a longer one (through KV offloading's tier, or another engine's
        blocks) takes on to ``num_tokens`` tokens: each further group's blocks from the window of the
        token at ``num_tokens`` on (which the device hit's window starts before), placeholders before
        (its list may then reach past group 0's hit); and the device blocks so passed, with their keys
        (``keep_passed``)."""
        group_blocks, passed = [], []
        for group, hits in zip(self.groups, computed.group_blocks or ([],) * len(self.groups), strict=True):
            first = group.first_needed_block(num_tokens, self.block_size)
            group_blocks.append([RELEASED_BLOCK] * first + hits[first:])
            passed.extend((b, b.block_hash) for b in hits[:first] if b is not RELEASED_BLOCK)
        return KVCacheBlocks(computed.blocks, tuple(group_blocks)), passed

    def keep_passed(self, passed: list[tuple[KVCacheBlock, object]]) -> None:
        """After a request was admitted with a longer hit (``cut_group_hits``): the windowed groups' device
        blocks of the device hit's window, which it passes, are the end of a prefix other prompts share,
        kept as a hit that took them would have kept them (used recently, and saved to KV offloading's
        tier when evicted). Each still holding what it held at the lookup: the admission's allocation may
        have handed one out since."""
        kept = [block for block, key in passed if block.block_hash == key]
        for block in kept:
            block.in_hit_window = True
        self.block_pool.refresh(kept)

    def group_window_starts(self, num_tokens: int) -> list[int]:
        """Each further group's first block the token at position ``num_tokens`` attends to."""
        return [group.first_needed_block(num_tokens, self.block_size) for group in self.groups]

    def get_group_block_ids_from(self, request_id: str, num_tokens: int) -> list[tuple[int, list[int]]]:
        """Each further group's first block the token at ``num_tokens`` attends to, and the request's block
        ids from there on (where another engine's blocks are read in)."""
        return [(start, [b.block_id for b in group.req_to_blocks[request_id][start:]])
                for start, group in zip(self.group_window_starts(num_tokens), self.groups, strict=True)]

    def get_held_group_block_ids(self, request_id: str) -> list[list[int | None]]:
        """Each further group's block ids of the request, None where released behind the window."""
        return [[None if b is RELEASED_BLOCK else b.block_id for b in group.req_to_blocks.get(request_id, ())]
                for group in self.groups]

    def record_offload_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """A request admitted after looking its prompt up in the tier (once per admission, as vLLM
        counts its connector's lookups; one that waits for room is counted when it gets in)."""
        if self.connector_prefix_cache_stats is not None:
            self.connector_prefix_cache_stats.record(request.num_tokens, num_hit_tokens, request.num_preemptions > 0)

    def load_offloaded_blocks(self, request: Request, offloaded: OffloadedBlocks) -> None:
        """After allocate_slots gave the request device blocks for them (with ``offloaded.computed`` as
        its device hit): the tier's copies are loaded into its blocks at their positions before the pass."""
        tier, req_id, block_hashes = self.offload, request.request_id, request.block_hashes
        assert tier is not None
        lists = [self.req_to_blocks[req_id], *(group.req_to_blocks[req_id] for group in self.groups)]
        keys: list[Callable[[bytes], object]] = [lambda h: h, *(group.key for group in self.groups)]
        tier.plan_loads([slot for _, _, slot in offloaded.loads],
                        [lists[group][position].block_id for group, position, _ in offloaded.loads])
        tier.touch([keys[group](block_hashes[position]) for group, position, _ in offloaded.loads])
        self.keep_passed(offloaded.passed)

    def take_offload_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This pass's copies for the workers: (device block -> slot stores, slot -> device block loads)."""
        if self.offload is None:
            return [], []
        return self.offload.take_copies()

    def plan_state_restore(self, request: Request, num_computed_tokens: int) -> None:
        """A request admitted after a prefix hit of ``num_computed_tokens`` (get_computed_blocks'): its
        recurrent state is restored from the one kept at the hit's end (nothing without recurrent layers)."""
        if self.recurrent_states is not None and num_computed_tokens:
            self.recurrent_states.plan_restore(request.request_id,
                                               request.block_hashes[num_computed_tokens // self.block_size - 1])

    def plan_state_saves(self, request: Request, start: int, end: int) -> None:
        """A request whose pass computes its tokens ``start`` to ``end``: its recurrent states kept at the
        block boundaries in between worth keeping (nothing without recurrent layers): where its prompt
        left the blocks the KV cache held at its lookup, if they ran past the last state kept (the end
        of a prefix other prompts share: the next of them starts there); the last boundary before its
        last token (a prompt seen again starts there at most: its last token is always computed); and
        the last boundary the pass reaches (the request goes on from there). The workers copy each out
        where the pass's scan passes it."""
        block_size = self.block_size
        reached = end // block_size * block_size
        # (A position kept is a boundary in (start, end]: when the last one up to ``end`` is not past
        # ``start``, there is none; a decode between block ends, most passes.)
        if self.recurrent_states is None or reached <= start:
            return
        junction = self.state_junctions.get(request.request_id, 0)
        last = (request.num_tokens - 1) // block_size * block_size
        positions = {p for p in (junction, last, reached) if start < p <= end}
        for position in sorted(positions):
            self._plan_state_save(request, position)

    def _plan_state_save(self, request: Request, num_tokens: int) -> None:
        num_blocks = num_tokens // self.block_size
        if len(request.block_hashes) < num_blocks:  # (hashed when the pass's slots were given)
            return
        block_hash = request.block_hashes[num_blocks - 1]
        # (Its newer state makes the one it kept before the first to go, unless that one ends a prefix
        # other prompts share: the state at a junction is kept for them.)
        req_id = request.request_id
        self.recurrent_states.plan_save(req_id, block_hash, num_tokens, self._own_state.get(req_id))
        if self.state_junctions.get(req_id) != num_tokens:
            self._own_state[req_id] = block_hash

    def take_state_copies(self) -> tuple[dict[str, int], dict[str, list[tuple[int, int]]]]:
        """This pass's recurrent-state copies for the workers: restores (req_id -> slot) and saves
        (req_id -> [(position, slot)])."""
        if self.recurrent_states is None:
            return {}, {}
        return self.recurrent_states.take_copies()

    def _with_lookahead(self, num_tokens: int, num_lookahead_tokens: int) -> int:
        if not num_lookahead_tokens:
            return num_tokens
        total = num_tokens + num_lookahead_tokens
        return total if self.max_model_len is None else max(num_tokens, min(total, self.max_model_len))

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0, delay_cache_blocks: bool = False) -> KVCacheBlocks | None:
        """Give the request slots for ``num_new_tokens`` more tokens; None if the pool cannot.

        Never raises for capacity: the None sentinel is what triggers preemption in schedule().
        Full blocks covered by computed + new tokens enter the prefix cache here, unless
        ``delay_cache_blocks`` (blocks another engine's KV is still being read into: they enter it
        when the request is next given slots, once the data is there).
        """
        req_id = request.request_id
        req_blocks = self.req_to_blocks.get(req_id)
        if self.sliding_window is not None and req_blocks is not None:
            self._release_blocks_behind_window(request, req_blocks)
        if self.groups and req_blocks is not None:
            for group in self.groups:
                self._release_group_blocks(request, group)
        if new_computed_blocks is None and req_blocks is not None:
            # Fast path for a running request (every decode, every pass): usually no new block.
            num_tokens = request.num_computed_tokens + num_new_tokens
            if -(-self._with_lookahead(num_tokens, num_lookahead_tokens) // self.block_size) <= len(req_blocks):
                # Draft tokens (speculative decoding) get slots but never enter the cache: they may be rejected.
                num_tokens = min(num_tokens, request.num_tokens)
                if self.enable_caching and num_tokens // self.block_size > self.num_cached_block[req_id]:
                    self._cache_full_blocks(request, req_blocks, num_tokens)
                return self._empty
        num_req_blocks = 0 if req_blocks is None else len(req_blocks)
        computed = new_computed_blocks.blocks if new_computed_blocks is not None else ()
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_with_slots = self._with_lookahead(num_computed_tokens + num_new_tokens, num_lookahead_tokens)
        num_new_blocks = -(-num_tokens_with_slots // self.block_size) - num_req_blocks - len(computed)
        # Prefix-hit blocks already behind the window of the first token to compute are not taken.
        num_behind = 0
        if computed and self.sliding_window is not None and req_blocks is None:
            num_behind = min(max((num_computed_tokens - self.sliding_window + 1) // self.block_size, 0),
                             len(computed))
        # (A windowed group's prefix-hit blocks behind its window are RELEASED_BLOCK already. After a hit
        # the offloading tier extends, its list may reach past group 0's hit: placeholders up to the window.)
        group_computed = (new_computed_blocks.group_blocks if new_computed_blocks is not None
                          and new_computed_blocks.group_blocks else ((),) * len(self.groups))
        pool = self.block_pool
        if num_new_blocks > 0 or computed:
            # Each group's new blocks fill its list to group 0's positions.
            num_positions = num_req_blocks + len(computed) + max(num_new_blocks, 0)
            num_group_new = sum(num_positions - (len(hits) if req_blocks is None else num_req_blocks)
                                for hits in group_computed)
            # Touching a free cached block takes it out of the free queue, so it costs capacity too. (A hit
            # KV offloading's tier extends may hold None: a new block its copy is loaded into.)
            num_evictable = sum(1 for b in computed[num_behind:] if b is not None and b.ref_cnt == 0) + sum(
                1 for blocks in group_computed for b in blocks
                if b is not None and b.ref_cnt == 0 and b is not RELEASED_BLOCK)
            num_holes = sum(1 for b in computed if b is None) + sum(1 for bs in group_computed for b in bs if b is None)
            if (max(num_new_blocks, 0) + num_group_new + num_holes + num_evictable
                    > pool.free_block_queue.num_free_blocks):
                return None
            if req_blocks is None:
                req_blocks = self.req_to_blocks[req_id] = []
                # Prefix-hit blocks are already in the cache map (up to the first a tier's copy comes into).
                self.num_cached_block[req_id] = _first_hole(computed)
                if self.offload is not None and self.groups:  # (where its prefix hit ends: _mark_hit_windows)
                    self._hit_blocks[req_id] = len(computed)
            if computed:
                if num_behind:
                    self.num_released_block[req_id] = num_behind
                    req_blocks.extend([RELEASED_BLOCK] * num_behind)
                    computed = computed[num_behind:]
                pool.touch([b for b in computed if b is not None] if num_holes else computed)
                req_blocks.extend(computed)
            # (Every group's hits are taken before any new block: a free hit block must not be handed out.)
            group_lists = [self._take_group_hits(request, group, hit)
                           for group, hit in zip(self.groups, group_computed, strict=True)]
            if num_holes:
                # (Caching goes on from group 0's count: where a group's first tier copy lies before it,
                # group 0 counts from there, its blocks cached already skipped.)
                self.num_cached_block[req_id] = min(self.num_cached_block[req_id],
                                                    *(group.num_cached_block[req_id] for group in self.groups))
                for blocks in (req_blocks, *group_lists):
                    holes = [i for i, b in enumerate(blocks) if b is None]
                    for i, block in zip(holes, pool.get_new_blocks(len(holes)), strict=True):
                        blocks[i] = block
            new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
            req_blocks.extend(new_blocks)
            group_new = tuple(self._extend_group(blocks, len(req_blocks)) for blocks in group_lists)
        else:
            new_blocks, group_new = [], ()
        if self.enable_caching and req_blocks is not None and not delay_cache_blocks:
            self._cache_full_blocks(request, req_blocks, min(num_computed_tokens + num_new_tokens, request.num_tokens))
        return KVCacheBlocks(new_blocks, group_new) if new_blocks else self._empty

    def _take_group_hits(self, request: Request, group: _WindowedGroup,
                         computed: list[KVCacheBlock] | tuple[()]) -> list[KVCacheBlock]:
        """A windowed group's prefix-hit blocks for a new request (RELEASED_BLOCK behind its window);
        returns the group's list of the request's blocks."""
        req_id = request.request_id
        blocks = group.req_to_blocks.get(req_id)
        if blocks is None:
            blocks = group.req_to_blocks[req_id] = []
            group.num_cached_block[req_id] = _first_hole(computed)
            num_released = sum(1 for b in computed if b is RELEASED_BLOCK)
            if num_released:
                group.num_released_block[req_id] = num_released
            self.block_pool.touch([b for b in computed[num_released:] if b is not None])
            blocks.extend(computed)
        return blocks

    def _extend_group(self, blocks: list[KVCacheBlock], num_positions: int) -> list[KVCacheBlock]:
        """New blocks at the end of a windowed group's list up to group 0's ``num_positions``; returns them."""
        assert len(blocks) <= num_positions, "a KV cache group's blocks left group 0's positions"
        num_new_blocks = num_positions - len(blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        blocks.extend(new_blocks)
        return new_blocks

    def _release_blocks_behind_window(self, request: Request, req_blocks: list[KVCacheBlock]) -> None:
        """Release the blocks wholly before the first key the request's next token attends to
        (position num_computed_tokens sees keys from num_computed_tokens - window + 1 on)."""
        num_behind = (request.num_computed_tokens - self.sliding_window + 1) // self.block_size
        self._release_behind(request.request_id, req_blocks, num_behind, self.num_cached_block,
                             self.num_released_block)

    def _release_group_blocks(self, request: Request, group: _WindowedGroup) -> None:
        """_release_blocks_behind_window for a windowed group of the hybrid KV cache manager."""
        if group.window is not None:
            req_id = request.request_id
            blocks = group.req_to_blocks[req_id]
            num_behind = group.window.first_key(request.num_computed_tokens) // self.block_size
            if self.offload is not None:
                self._mark_hit_windows(request, group, blocks, group.num_released_block.get(req_id, 0), num_behind)
            # (Earliest first: a windowed group's hit needs the blocks just before it, so the latest go last.)
            self._release_behind(req_id, blocks, num_behind, group.num_cached_block, group.num_released_block,
                                 latest_first=False)

    def _mark_hit_windows(self, request: Request, group: _WindowedGroup, blocks: list[KVCacheBlock], start: int,
                          end: int) -> None:
        """Of a windowed group's cached blocks about to go behind the window (``blocks[start:end]``), flag for
        KV offloading's tier those in the window of a hit a later prompt may have: the request's prompt again
        (a hit up to its last full block before the last token), or another prompt sharing what the request
        found cached at its latest admission. (The rest of a windowed group's blocks are not saved: a hit
        ending elsewhere is cut back to one of these windows.)"""
        if end <= start:
            return
        block_size = self.block_size
        for num_hit in {(request.num_prompt_tokens - 1) // block_size, self._hit_blocks.get(request.request_id, 0)}:
            first = group.first_needed_block(num_hit * block_size, block_size)
            for block in blocks[max(first, start):min(num_hit, end)]:
                if block.block_hash is not None:
                    block.in_hit_window = True

    def _release_behind(self, req_id: str, blocks: list[KVCacheBlock], num_behind: int, num_cached: dict[str, int],
                        num_released_block: dict[str, int], latest_first: bool = True) -> None:
        """Release ``blocks``' first ``num_behind``, RELEASED_BLOCK taking their places. Only blocks already
        registered in the prefix cache go, so none is ever cached as a placeholder. ``latest_first``: the
        latest block joins the free queue first (is evicted first), else the earliest."""
        if self.enable_caching:
            num_behind = min(num_behind, num_cached[req_id])
        num_released = num_released_block.get(req_id, 0)
        if num_behind <= num_released:
            return
        released = blocks[num_released:num_behind]
        blocks[num_released:num_behind] = [RELEASED_BLOCK] * len(released)
        num_released_block[req_id] = num_behind
        # Latest first, like free(): a prefix stays in the cache longer than what follows it (a hit of one
        # window-wide group needs every block from the first, as group 0's lookup does).
        self.block_pool.free_blocks(reversed(released) if latest_first else released)

    def _cache_full_blocks(self, request: Request, req_blocks: list[KVCacheBlock], num_tokens: int) -> None:
        """Register the blocks that the first ``num_tokens`` tokens fill (once computed this pass)."""
        req_id = request.request_id
        num_full_blocks = num_tokens // self.block_size
        num_cached = self.num_cached_block[req_id]
        if num_full_blocks <= num_cached:
            return
        extend_block_hashes(request.block_hashes, request.all_token_ids, num_full_blocks, self.block_size,
                            request.cache_salt, request.lora_key, self._long_rope(request), request.prompt_embeds,
                            request.mm_features)
        self.block_pool.cache_full_blocks(req_blocks, request.block_hashes, num_cached, num_full_blocks)
        self.num_cached_block[req_id] = num_full_blocks
        for group in self.groups:
            # (A windowed group's blocks from where it last cached: never a released one, which goes only once cached.)
            num_group_cached = group.num_cached_block[req_id]
            if num_full_blocks > num_group_cached:
                self.block_pool.cache_full_blocks(group.req_to_blocks[req_id], request.block_hashes, num_group_cached,
                                                  num_full_blocks, key=group.key)
                group.num_cached_block[req_id] = num_full_blocks

    def uncache_uncomputed_blocks(self, request: Request) -> None:
        """Undo the caching of blocks this pass allocated but will not compute (a victim of
        priority preemption that had already been scheduled in the same pass)."""
        req_blocks = self.req_to_blocks.get(request.request_id)
        if not req_blocks:
            return
        first_uncomputed = request.num_computed_tokens // self.block_size
        self.block_pool.uncache_blocks(req_blocks[first_uncomputed:])
        for group in self.groups:
            self.block_pool.uncache_blocks(group.req_to_blocks.get(request.request_id, ())[first_uncomputed:])

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its tail is evicted before its prefix."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        self._own_state.pop(request.request_id, None)
        self.state_junctions.pop(request.request_id, None)
        self._hit_blocks.pop(request.request_id, None)
        num_released = self.num_released_block.pop(request.request_id, 0)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks[num_released:]))
        for group in self.groups:
            group_blocks = group.req_to_blocks.pop(request.request_id, None)
            group.num_cached_block.pop(request.request_id, None)
            num_released = group.num_released_block.pop(request.request_id, 0)
            if group_blocks:
                if self.offload is not None:  # (the window of its last token: where a continuation's hit ends)
                    for block in group_blocks[num_released:]:
                        if block.block_hash is not None:
                            block.in_hit_window = True
                self.block_pool.free_blocks(reversed(group_blocks[num_released:]))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block ids in each group after group 0 (none without the hybrid KV cache manager)."""
        return [[b.block_id for b in group.req_to_blocks.get(request_id, ())] for group in self.groups]

    def get_num_blocks(self, request_id: str) -> int:
        """The request's block positions (a block released behind its window still counts)."""
        blocks = self.req_to_blocks.get(request_id)
        return len(blocks) if blocks else 0

    def get_num_held_blocks(self, request_id: str) -> int:
        """The blocks the request holds in the pool (its released ones not counted), in every group."""
        return self.get_num_blocks(request_id) - self.num_released_block.get(request_id, 0) + sum(
            len(group.req_to_blocks.get(request_id, ())) - group.num_released_block.get(request_id, 0)
            for group in self.groups)

    def reset_prefix_cache(self) -> bool:
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.offload is not None:
            self.offload.reset()
        if self.recurrent_states is not None:
            self.recurrent_states.reset()
        return True

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Counters since the previous call (the delta), then start counting afresh."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def make_connector_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The offloading tier's lookups since the previous call (None without a tier)."""
        stats = self.connector_prefix_cache_stats
        if stats is not None:
            self.connector_prefix_cache_stats = PrefixCacheStats()
        return stats
