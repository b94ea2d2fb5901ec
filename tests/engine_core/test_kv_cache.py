import subprocess
import sys

import pytest

from engine_core.core.block_pool import BLOCKS_STORED, TIER_STORED, BlockPool
from engine_core.core.kv_cache_manager import KVCacheManager
from engine_core.core.kv_cache_utils import (
    NONE_HASH,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    first_block_keys,
    hash_block_tokens,
)
from engine_core.outputs import LoRARequest
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams


def _req(rid: str, tokens: list[int], cache_salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(), cache_salt=cache_salt)


def test_free_queue_removes_from_the_middle_in_constant_time_and_keeps_lru_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and q.num_free_blocks == 4
    assert q.popleft() is blocks[0]
    q.append(blocks[0])
    assert [b.block_id for b in q] == [1, 3, 4, 0]
    with pytest.raises(RuntimeError):
        q.remove(blocks[2])


def test_block_hash_is_chained_and_stable_across_processes():
    h1 = hash_block_tokens(NONE_HASH, [1, 2, 3])
    assert h1 == hash_block_tokens(NONE_HASH, [1, 2, 3])
    assert hash_block_tokens(h1, [4]) != hash_block_tokens(hash_block_tokens(NONE_HASH, [9, 9, 9]), [4])
    assert hash_block_tokens(NONE_HASH, [1, 2, 3], ("salt",)) != h1
    code = ("from engine_core.core.kv_cache_utils import NONE_HASH, hash_block_tokens;"
            "print(hash_block_tokens(NONE_HASH, [1, 2, 3]).hex())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "123"}).stdout.strip()
    assert other == h1.hex()


def test_request_frees_its_blocks_in_reverse_so_its_tail_is_evicted_first():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    req = _req("a", list(range(12)))
    blocks = mgr.allocate_slots(req, 12)
    ids = blocks.get_block_ids()
    assert len(ids) == 3
    mgr.free(req)
    free_order = [b.block_id for b in mgr.block_pool.free_block_queue]
    assert free_order[-3:] == list(reversed(ids))
    mgr.block_pool.check_integrity()


def test_full_blocks_enter_the_prefix_cache_when_allocate_slots_runs():
    mgr = KVCacheManager(num_blocks=16, block_size=4)
    a = _req("a", list(range(10)))
    mgr.allocate_slots(a, 6)  # computed+new = 6 tokens: one full block
    assert len(mgr.block_pool.cached_block_hash_to_block) == 1
    a.num_computed_tokens = 6
    mgr.allocate_slots(a, 4)  # 10 tokens: two full blocks
    assert len(mgr.block_pool.cached_block_hash_to_block) == 2
    b = _req("b", list(range(10)) + [77, 78])
    hit_blocks, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 8 and hit_blocks.get_block_ids() == mgr.get_block_ids("a")[:2]
    mgr.block_pool.check_integrity()


def test_last_prompt_token_is_always_recomputed():
    mgr = KVCacheManager(num_blocks=16, block_size=4)
    a = _req("a", list(range(8)))
    mgr.allocate_slots(a, 8)
    same = _req("b", list(range(8)))
    _, num_hit = mgr.get_computed_blocks(same)
    assert num_hit == 4  # not 8: the last token's logits are needed


def test_shared_blocks_are_ref_counted_and_a_free_cached_block_can_be_touched_back():
    mgr = KVCacheManager(num_blocks=6, block_size=4)
    a = _req("a", list(range(9)))
    mgr.allocate_slots(a, 9)
    b = _req("b", list(range(9)))
    hits, n = mgr.get_computed_blocks(b)
    assert mgr.allocate_slots(b, 9 - n, n, hits) is not None
    shared = mgr.req_to_blocks["a"][0]
    assert shared.ref_cnt == 2 and mgr.req_to_blocks["b"][0] is shared
    mgr.free(a)
    mgr.free(b)
    assert shared.ref_cnt == 0 and mgr.block_pool.get_num_free_blocks() == 6
    c = _req("c", list(range(9)))
    hits, n = mgr.get_computed_blocks(c)
    assert n == 8
    mgr.allocate_slots(c, 1, n, hits)
    assert shared.ref_cnt == 1 and mgr.block_pool.get_num_free_blocks() == 3
    mgr.block_pool.check_integrity()


def test_allocate_slots_returns_none_instead_of_raising_when_the_pool_is_short():
    mgr = KVCacheManager(num_blocks=2, block_size=4)
    a = _req("a", list(range(12)))
    assert mgr.allocate_slots(a, 12) is None
    assert mgr.block_pool.get_num_free_blocks() == 2 and "a" not in mgr.req_to_blocks
    with pytest.raises(ValueError):
        mgr.block_pool.get_new_blocks(3)  # asking the pool without checking first is a bug


def test_touching_free_cached_blocks_counts_against_capacity():
    mgr = KVCacheManager(num_blocks=3, block_size=4)
    a = _req("a", list(range(9)))
    mgr.allocate_slots(a, 9)
    mgr.free(a)  # two cached blocks + one uncached, all free
    b = _req("b", list(range(8)) + [50, 51, 52, 53, 54])
    hits, n = mgr.get_computed_blocks(b)
    assert n == 8
    # 13 tokens need 4 blocks: 2 touched + 2 new > 3 in the pool.
    assert mgr.allocate_slots(b, 5, n, hits) is None
    mgr.block_pool.check_integrity()


def test_eviction_reuses_the_least_recently_freed_cached_block():
    mgr = KVCacheManager(num_blocks=2, block_size=4)
    a = _req("a", list(range(8)))
    mgr.allocate_slots(a, 8)
    mgr.free(a)
    assert len(mgr.block_pool.cached_block_hash_to_block) == 2
    b = _req("b", [100, 101, 102, 103])
    mgr.allocate_slots(b, 4)
    # a's tail block was freed first, so it was evicted first; its first block survives.
    assert len(mgr.block_pool.cached_block_hash_to_block) == 2
    _, n = mgr.get_computed_blocks(_req("c", list(range(8)) + [1]))
    assert n == 4
    mgr.block_pool.check_integrity()


def test_two_requests_filling_one_prefix_at_once_both_keep_it_cached():
    """Chunked prefill: a second request starts on the first's first chunk, and each then computes
    the rest of one prompt. Both copies of those blocks are cached (as vLLM keeps them): after one
    copy is evicted, the other still serves the prefix; KV events name each hash once."""
    mgr = KVCacheManager(num_blocks=12, block_size=4)
    mgr.block_pool.record_kv_events()
    prompt = list(range(17))
    r1 = _req("r1", prompt)
    mgr.allocate_slots(r1, 8)  # its first chunk
    r1.num_computed_tokens = 8
    r2 = _req("r2", prompt)
    hits, n = mgr.get_computed_blocks(r2)
    assert n == 8
    mgr.allocate_slots(r2, 8, n, hits)  # the rest of the prefix, first
    r2.num_computed_tokens = 16
    mgr.allocate_slots(r1, 8)  # the same blocks again: copies
    r1.num_computed_tokens = 16
    mgr.block_pool.check_integrity()
    assert [len(copies) for copies in mgr.block_pool.cached_block_hash_to_block.values()] == [1, 1, 2, 2]
    mgr.free(r2)
    filler = _req("filler", [100 + i for i in range(32)])
    assert mgr.allocate_slots(filler, 32) is not None  # (it takes every free block: r2's copies too)
    assert mgr.block_pool.get_num_free_blocks() == 0
    _, n = mgr.get_computed_blocks(_req("r3", prompt))
    assert n == 16  # r1's copies
    stored = [h for kind, hashes in mgr.block_pool.take_kv_events() if kind == BLOCKS_STORED for h in hashes]
    assert len(stored) == len(set(stored))  # (each hash once, though two blocks hold two of them)
    mgr.block_pool.check_integrity()


def test_cache_salt_separates_identical_prompts():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    mgr.allocate_slots(_req("a", list(range(9)), cache_salt="tenant-1"), 9)
    assert mgr.get_computed_blocks(_req("b", list(range(9)), cache_salt="tenant-2"))[1] == 0
    assert mgr.get_computed_blocks(_req("c", list(range(9)), cache_salt="tenant-1"))[1] == 8


def test_prefix_stats_count_requests_queries_hits_and_preempted_apart():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    mgr.allocate_slots(_req("a", list(range(9))), 9)
    b = _req("b", list(range(9)))
    mgr.get_computed_blocks(b)
    b.num_preemptions = 1
    mgr.get_computed_blocks(b)
    stats = mgr.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (1, 9, 8)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 9, 8)
    assert mgr.make_prefix_cache_stats().requests == 0  # deltas


def test_nothing_is_cached_or_counted_with_prefix_caching_off():
    mgr = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    mgr.allocate_slots(_req("a", list(range(9))), 9)
    assert not mgr.block_pool.cached_block_hash_to_block
    assert mgr.get_computed_blocks(_req("b", list(range(9))))[1] == 0
    assert mgr.make_prefix_cache_stats().requests == 0


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    a = _req("a", list(range(9)))
    mgr.allocate_slots(a, 9)
    assert mgr.reset_prefix_cache() is False
    mgr.free(a)
    assert mgr.reset_prefix_cache() is True
    assert not mgr.block_pool.cached_block_hash_to_block
    mgr.block_pool.check_integrity()


def test_check_integrity_catches_a_broken_invariant():
    pool = BlockPool(4, enable_caching=True)
    pool.check_integrity()
    pool.blocks[1].ref_cnt = 1  # referenced yet still in the free queue
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_usage_is_the_used_fraction():
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    mgr.allocate_slots(_req("a", list(range(8))), 8)
    assert mgr.usage == 0.5


def test_a_lora_adapter_keys_its_own_prefixes():
    """KV computed under one adapter is wrong for the base model and for every other adapter."""
    mgr = KVCacheManager(num_blocks=16, block_size=4)
    a, b = LoRARequest("a", 1, "/adapters/a"), LoRARequest("b", 2, "/adapters/b")

    def req(rid: str, lora: LoRARequest | None, salt: str | None = None) -> Request:
        return Request(rid, list(range(9)), SamplingParams(), cache_salt=salt, lora_request=lora)

    mgr.allocate_slots(req("a1", a), 9)
    assert mgr.get_computed_blocks(req("base", None))[1] == 0
    assert mgr.get_computed_blocks(req("b1", b))[1] == 0
    assert mgr.get_computed_blocks(req("a2", a))[1] == 8
    assert mgr.get_computed_blocks(req("a3", a, salt="tenant"))[1] == 0  # the salt still separates
    # A cache salt is a key of its own kind (the router mirrors these hashes).
    assert first_block_keys("tenant") == (("salt", "tenant"),) and first_block_keys() is None
    assert first_block_keys("longrope") != first_block_keys(long_rope=True)


def test_longrope_prompts_past_the_pretrained_length_key_their_own_prefixes():
    """A LongRoPE model (pretrained length 12 here) rotates a longer prompt with its long factors
    from the first token: such a prompt's blocks never serve a shorter one's, nor the reverse."""
    mgr = KVCacheManager(num_blocks=32, block_size=4, long_rope_after=12)
    mgr.allocate_slots(_req("short", list(range(10))), 10)
    assert mgr.get_computed_blocks(_req("short2", list(range(11))))[1] == 8
    assert mgr.get_computed_blocks(_req("long", list(range(13))))[1] == 0  # same first 8 tokens
    mgr.allocate_slots(_req("long", list(range(13))), 13)
    assert mgr.get_computed_blocks(_req("long2", list(range(14))))[1] == 12
    assert mgr.get_computed_blocks(_req("short3", list(range(9))))[1] == 8  # the short blocks, still there
    # A salt spelled like the long-factors key is still a salt: a short salted prompt does not reach
    # the long prompt's blocks (nor they its).
    assert mgr.get_computed_blocks(_req("salted", list(range(11)), cache_salt="longrope"))[1] == 0
    # Without LongRoPE, the same prompts share their prefix.
    plain = KVCacheManager(num_blocks=32, block_size=4)
    plain.allocate_slots(_req("short", list(range(10))), 10)
    assert plain.get_computed_blocks(_req("long", list(range(13))))[1] == 8


def test_blocks_behind_a_sliding_window_are_released_as_the_request_advances():
    """Window 6, block size 4: the token at position p attends to keys p-5..p, so once the request has
    computed n tokens, the blocks wholly before key n-5 go back to the pool, cached and in order."""
    from engine_core.core.kv_cache_manager import RELEASED_BLOCK

    mgr = KVCacheManager(num_blocks=8, block_size=4, sliding_window=6)
    a = _req("a", list(range(30)))
    mgr.allocate_slots(a, 8)  # blocks 0..1 (positions 0..7)
    first_two = list(mgr.req_to_blocks["a"])
    a.num_computed_tokens = 8
    mgr.allocate_slots(a, 8)  # next token 8 sees keys 3..8: nothing wholly behind yet
    assert mgr.get_num_held_blocks("a") == 4 and mgr.get_num_blocks("a") == 4
    a.num_computed_tokens = 16
    mgr.allocate_slots(a, 8)  # token 16 sees keys 11..16: blocks 0 and 1 (keys 0..7) are released
    assert mgr.req_to_blocks["a"][:2] == [RELEASED_BLOCK] * 2
    assert mgr.get_num_blocks("a") == 6 and mgr.get_num_held_blocks("a") == 4
    assert all(b.ref_cnt == 0 for b in first_two) and mgr.block_pool.get_num_free_blocks() == 4
    # Still in the prefix cache until evicted; released latest first, so the older block is evicted last.
    assert [b.block_id for b in mgr.block_pool.free_block_queue][-2:] == [first_two[1].block_id,
                                                                             first_two[0].block_id]
    assert mgr.get_block_ids("a")[:2] == [0, 0]  # the runner's table keeps positions // block_size
    b = _req("b", list(range(9)))
    _, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 8
    mgr.block_pool.check_integrity()
    mgr.free(a)  # the placeholders are not freed again
    assert mgr.block_pool.get_num_free_blocks() == 8 and "a" not in mgr.num_released_block
    mgr.block_pool.check_integrity()


def test_a_window_releases_only_blocks_the_prefix_cache_holds():
    mgr = KVCacheManager(num_blocks=8, block_size=4, sliding_window=2)
    a = _req("a", list(range(12)) + [5] * 4)
    mgr.allocate_slots(a, 12)
    mgr.num_cached_block["a"] = 1  # as if only block 0 had been registered
    a.num_computed_tokens = 12
    mgr.allocate_slots(a, 4)  # token 12 sees 11..12: blocks 0..1 behind, only block 0 cached
    assert mgr.num_released_block["a"] == 1
    # Without prefix caching, nothing is registered, and every block behind the window goes.
    plain = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False, sliding_window=2)
    c = _req("c", list(range(16)))
    plain.allocate_slots(c, 12)
    c.num_computed_tokens = 12
    plain.allocate_slots(c, 4)
    assert plain.num_released_block["c"] == 2 and plain.block_pool.get_num_free_blocks() == 6
    plain.block_pool.check_integrity()


def test_a_prefix_hit_does_not_take_blocks_already_behind_the_window():
    from engine_core.core.kv_cache_manager import RELEASED_BLOCK

    mgr = KVCacheManager(num_blocks=8, block_size=4, sliding_window=5)
    a = _req("a", list(range(17)))
    mgr.allocate_slots(a, 17)
    mgr.free(a)  # four cached blocks, all free
    b = _req("b", list(range(16)) + [99])
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 16
    # Token 16 sees keys 12..16: hit blocks 0..2 stay in the pool, only block 3 is taken.
    assert mgr.allocate_slots(b, 1, num_hit, hits) is not None
    assert mgr.req_to_blocks["b"][:3] == [RELEASED_BLOCK] * 3 and mgr.get_num_held_blocks("b") == 2
    assert [blk.ref_cnt for blk in hits.blocks] == [0, 0, 0, 1]
    mgr.free(b)
    assert mgr.block_pool.get_num_free_blocks() == 8
    mgr.block_pool.check_integrity()


def _hybrid(num_blocks: int, window: int = 6, chunked: bool = False, **kwargs) -> KVCacheManager:
    """The hybrid KV cache manager over a full-attention group and a windowed one, blocks of 4."""
    from engine_core.core.kv_cache_utils import AttentionWindow

    return KVCacheManager(num_blocks=num_blocks, block_size=4,
                          kv_cache_groups=(None, AttentionWindow(window, chunked=chunked)), **kwargs)


def test_hybrid_groups_hold_blocks_at_the_same_positions_and_release_the_windowed_ones():
    """Window 6: once 16 tokens are computed, the windowed group's blocks 0 and 1 (keys 0..7) go back to
    the pool, cached; the full group keeps all of its blocks. Every allocation costs a block a group."""
    from engine_core.core.kv_cache_manager import RELEASED_BLOCK

    mgr = _hybrid(12)
    a = _req("a", list(range(30)))
    new = mgr.allocate_slots(a, 8)
    assert len(new.blocks) == 2 and [len(g) for g in new.group_blocks] == [2]
    assert set(new.get_block_ids()).isdisjoint(new.get_group_block_ids()[0])
    assert mgr.block_pool.get_num_free_blocks() == 8
    a.num_computed_tokens = 8
    mgr.allocate_slots(a, 8)
    a.num_computed_tokens = 16
    new = mgr.allocate_slots(a, 4)  # token 16 sees keys 11..16
    windowed = mgr.groups[0]
    assert windowed.req_to_blocks["a"][:2] == [RELEASED_BLOCK] * 2 and mgr.req_to_blocks["a"][0] is not RELEASED_BLOCK
    assert mgr.get_num_blocks("a") == 5 and mgr.get_num_held_blocks("a") == 5 + 3
    assert mgr.get_group_block_ids("a")[0][:2] == [0, 0]
    assert len(new.blocks) == 1 and len(new.group_blocks[0]) == 1
    mgr.block_pool.check_integrity()
    mgr.free(a)
    assert mgr.block_pool.get_num_free_blocks() == 12 and "a" not in windowed.num_released_block
    mgr.block_pool.check_integrity()


def test_hybrid_allocation_counts_every_groups_blocks_against_the_pool():
    mgr = _hybrid(7)
    a = _req("a", list(range(16)))
    assert mgr.allocate_slots(a, 16) is None  # four blocks a group: eight, seven in the pool
    assert mgr.block_pool.get_num_free_blocks() == 7 and "a" not in mgr.req_to_blocks
    assert mgr.allocate_slots(a, 12) is not None and mgr.block_pool.get_num_free_blocks() == 1
    mgr.block_pool.check_integrity()


def test_a_hybrid_prefix_hit_needs_the_windowed_groups_blocks_of_its_window_only():
    """Four cached blocks in both groups. A prompt of 16 + 1 tokens hits 16: the token at 16 sees keys
    11..16, so the windowed group takes its blocks 2 and 3 and none before; once the windowed group's
    block 3 is evicted, the hit falls back to where its window's blocks are all cached."""
    from engine_core.core.kv_cache_manager import RELEASED_BLOCK

    mgr = _hybrid(16)
    a = _req("a", list(range(17)))
    mgr.allocate_slots(a, 17)
    mgr.free(a)
    b = _req("b", list(range(16)) + [99])
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 16 and len(hits.blocks) == 4
    assert hits.group_blocks[0][:2] == [RELEASED_BLOCK] * 2
    assert mgr.allocate_slots(b, 1, num_hit, hits) is not None
    assert [blk.ref_cnt for blk in hits.group_blocks[0][2:]] == [1, 1] and mgr.groups[0].num_released_block["b"] == 2
    mgr.block_pool.check_integrity()
    mgr.free(b)
    windowed_block_3 = mgr.groups[0].key(b.block_hashes[3])
    mgr.block_pool._evict(mgr.block_pool.get_cached_block(windowed_block_3))  # as if reused elsewhere
    c = _req("c", list(range(16)) + [98])
    hits, num_hit = mgr.get_computed_blocks(c)
    # (Block 3 is needed by any hit past 12 tokens; at 12, the token there sees keys 7..12: blocks 1, 2.)
    assert num_hit == 12 and hits.group_blocks[0][0] is RELEASED_BLOCK and len(hits.group_blocks[0]) == 3


def test_a_chunked_group_releases_the_blocks_before_the_current_chunk():
    """Llama 4's chunked layers (chunks of 8 keys): at 17 tokens computed, the token at 17 sees keys 16..17,
    so the chunked group's blocks 0..3 (keys 0..15) are released."""
    mgr = _hybrid(16, window=8, chunked=True)
    a = _req("a", list(range(24)))
    mgr.allocate_slots(a, 17)
    a.num_computed_tokens = 17
    mgr.allocate_slots(a, 1)
    assert mgr.groups[0].num_released_block["a"] == 4 and mgr.get_num_held_blocks("a") == 5 + 1
    mgr.block_pool.check_integrity()


def test_kv_events_follow_the_full_attention_group_alone():
    """The prefix-aware router follows the cached hashes: a windowed group's (group, hash) keys never reach it."""
    mgr = _hybrid(16)
    mgr.block_pool.record_kv_events()
    a = _req("a", list(range(12)))
    mgr.allocate_slots(a, 12)
    events = mgr.block_pool.take_kv_events()
    assert events == [(BLOCKS_STORED, a.block_hashes[:3])]
    assert len(mgr.block_pool.cached_block_hash_to_block) == 6
    mgr.free(a)
    mgr.block_pool.get_new_blocks(16)  # every cached block evicted: removals of the three hashes alone
    assert [h for _, hashes in mgr.block_pool.take_kv_events() for h in hashes] == list(reversed(a.block_hashes[:3]))


def test_a_hybrid_prefix_hit_takes_every_groups_hits_before_handing_out_new_blocks():
    """Free cached hit blocks sit in the free queue until taken: were group 0's new blocks taken first,
    one of them could be a windowed group's hit block, the same page then written as new keys by one
    group and read as cached ones by the other."""
    from engine_core.core.kv_cache_manager import RELEASED_BLOCK

    mgr = _hybrid(16)
    a, c = _req("a", list(range(17))), _req("c", list(range(100, 112)))
    mgr.allocate_slots(a, 17)
    mgr.allocate_slots(c, 12)
    mgr.free(a)
    mgr.free(c)
    b = _req("b", list(range(16)) + list(range(200, 209)))
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 16
    assert mgr.allocate_slots(b, 9, num_hit, hits) is not None
    full, windowed = mgr.req_to_blocks["b"], mgr.groups[0].req_to_blocks["b"]
    ids = [blk.block_id for blk in full + windowed if blk is not RELEASED_BLOCK]
    assert len(ids) == len(set(ids)) and all(blk.ref_cnt == 1 for blk in full + windowed if blk is not RELEASED_BLOCK)
    mgr.block_pool.check_integrity()


def _push_out_to_the_tier(mgr: KVCacheManager, keep: list[KVCacheBlock]) -> None:
    """Hand every free block out once (as other prompts would), ``keep`` held meanwhile: the cached ones
    evicted go to KV offloading's tier, then all come back to the pool."""
    pool = mgr.block_pool
    pool.touch(keep)
    taken = pool.get_new_blocks(pool.get_num_free_blocks())
    stores, loads = mgr.take_offload_copies()
    assert len(stores) == len(mgr.offload) and loads == []
    pool.free_blocks(taken)
    pool.free_blocks(keep)


def _admit_with_the_tier(mgr: KVCacheManager, request: Request):
    """What the scheduler does for a new request: the device hit, what the tier adds, slots, the loads."""
    computed, num_local_tokens = mgr.get_computed_blocks(request)
    offloaded = mgr.get_offloaded_blocks(request, computed)
    # (The tier's tokens count as new ones for the slots: the prompt from the device hit on.)
    assert mgr.allocate_slots(request, request.num_tokens - num_local_tokens, num_local_tokens,
                              offloaded.computed if offloaded else computed) is not None
    if offloaded:
        mgr.load_offloaded_blocks(request, offloaded)
    request.num_cached_tokens = num_local_tokens + len(offloaded) * mgr.block_size
    return num_local_tokens, offloaded, mgr.take_offload_copies()[1]


def _group_loads(offloaded, group: int) -> list[tuple[int, int]]:
    """The (position, slot) loads of one group."""
    return [(position, slot) for g, position, slot in offloaded.loads if g == group]


def _hybrid_with_a_tier_after(prompt: list[int], keep_positions: dict[int, list[int]]) -> KVCacheManager:
    """A 25-token prompt computed (six full blocks a group, window 6), freed, then pushed out to the tier
    but for each group's blocks at ``keep_positions[group]``."""
    mgr = _hybrid(40, num_offload_blocks=40)
    mgr.block_pool.record_kv_events()
    a = _req("a", prompt)
    mgr.allocate_slots(a, len(prompt))
    lists = [list(mgr.req_to_blocks["a"]), list(mgr.groups[0].req_to_blocks["a"])]
    mgr.free(a)
    _push_out_to_the_tier(mgr, [lists[g][p] for g, positions in keep_positions.items() for p in positions])
    return mgr


def test_the_offloading_tier_extends_a_hybrid_hit_with_each_groups_blocks_of_the_window():
    """Everything pushed out to the tier: a repeat of the 25-token prompt loads group 0's six full blocks
    and, the token at 24 seeing keys 19..24, the windowed group's blocks 4 and 5 alone; its blocks 0..3
    are placeholders (never allocated, never cached as if loaded)."""
    from engine_core.core.kv_cache_manager import RELEASED_BLOCK

    prompt = list(range(25))
    mgr = _hybrid_with_a_tier_after(prompt, {})
    b = _req("b", prompt)
    num_local, offloaded, loads = _admit_with_the_tier(mgr, b)
    tier, windowed, hashes = mgr.offload, mgr.groups[0], b.block_hashes
    assert num_local == 0 and len(offloaded) == 6
    # (The tier holds both groups' six blocks; what it reports to routers is group 0's hashes alone.)
    assert len(tier) == 12 and sorted(tier.hashes()) == sorted(hashes[:6])
    events = mgr.block_pool.take_kv_events()
    assert all(isinstance(h, bytes) for _, hs in events for h in hs)
    assert sorted(h for kind, hs in events if kind == TIER_STORED for h in hs) == sorted(hashes[:6])
    group_keys = [windowed.key(h) for h in hashes[4:6]]
    assert _group_loads(offloaded, 1) == list(zip([4, 5], tier.lookup(group_keys), strict=True))
    group_list = windowed.req_to_blocks["b"]
    assert group_list[:4] == [RELEASED_BLOCK] * 4 and mgr.get_num_held_blocks("b") == 7 + 3
    assert loads == [*zip(tier.lookup(hashes[:6]), mgr.get_block_ids("b")[:6], strict=True),
                     *zip(tier.lookup(group_keys), [blk.block_id for blk in group_list[4:6]], strict=True)]
    pool = mgr.block_pool
    assert [pool.get_cached_block(windowed.key(h)) for h in hashes[:4]] == [None] * 4
    assert [pool.get_cached_block(k) for k in group_keys] == group_list[4:6]
    pool.check_integrity()
    b.num_computed_tokens = 25  # (the token at 25 sees keys 20..25: block 4 goes back to the pool)
    mgr.allocate_slots(b, 1)
    assert windowed.num_released_block["b"] == 5
    mgr.free(b)
    assert pool.get_num_free_blocks() == 40
    pool.check_integrity()


def test_a_windowed_groups_block_on_neither_tier_cuts_the_hit_to_a_window_they_hold():
    """The windowed group's block 5 is neither in the tier nor on the device: a hit of six blocks needs
    it, so the hit is five blocks, whose window (keys 14..20) needs the group's blocks 3 and 4."""
    prompt = list(range(25))
    mgr = _hybrid_with_a_tier_after(prompt, {1: [5]})  # (kept on the device, so not saved)
    b = _req("b", prompt)
    mgr.get_computed_blocks(b, record=False)  # (hashes the prompt)
    mgr.block_pool.uncache_blocks([mgr.block_pool.get_cached_block(mgr.groups[0].key(b.block_hashes[5]))])
    num_local, offloaded, loads = _admit_with_the_tier(mgr, b)
    assert num_local == 0 and len(offloaded) == 5
    assert [p for p, _ in _group_loads(offloaded, 1)] == [3, 4] and len(loads) == 5 + 2
    assert mgr.get_num_held_blocks("b") == 7 + 4  # (the group's blocks 3..6: two loaded, two computed)
    mgr.block_pool.check_integrity()


def test_a_hit_the_tier_extends_takes_the_device_blocks_past_where_the_device_hit_stopped():
    """Group 0's six blocks stayed on the device and the windowed group's went to the tier: the device hit
    is none (the windowed group's window is not on the device), the longer hit takes group 0's six blocks
    from the device and loads only the windowed group's blocks 4 and 5 from the tier."""
    prompt = list(range(25))
    mgr = _hybrid_with_a_tier_after(prompt, {0: [0, 1, 2, 3, 4, 5]})
    b = _req("b", prompt)
    mgr.get_computed_blocks(b, record=False)  # (hashes the prompt)
    held = [mgr.block_pool.get_cached_block(h) for h in b.block_hashes[:6]]
    num_local, offloaded, loads = _admit_with_the_tier(mgr, b)
    assert num_local == 0 and len(offloaded) == 6 and offloaded.num_loaded_blocks == 0
    assert [(g, p) for g, p, _ in offloaded.loads] == [(1, 4), (1, 5)] and len(loads) == 2
    assert mgr.req_to_blocks["b"][:6] == held
    assert [blk.ref_cnt for blk in mgr.req_to_blocks["b"][:6]] == [1] * 6 and mgr.get_num_held_blocks("b") == 7 + 3
    # The windowed group's copies enter the prefix cache under its keys, as group 0's blocks are there.
    windowed = mgr.groups[0]
    assert [mgr.block_pool.get_cached_block(windowed.key(h)) for h in b.block_hashes[4:6]] == \
        windowed.req_to_blocks["b"][4:6]
    mgr.block_pool.check_integrity()


def test_the_tier_extends_a_device_hit_and_drops_the_windowed_device_blocks_its_window_passes():
    """Blocks 0..2 of both groups stayed on the device: the device hit is three blocks (the windowed
    group's blocks 1, 2 for its window), the tier's three more move the window past them: they are not
    taken (but kept as just used), and the group loads its blocks 4 and 5."""
    from engine_core.core.kv_cache_manager import RELEASED_BLOCK

    prompt = list(range(25))
    mgr = _hybrid_with_a_tier_after(prompt, {0: [0, 1, 2], 1: [0, 1, 2]})
    b = _req("b", prompt)
    computed, _ = mgr.get_computed_blocks(b, record=False)
    device_window = computed.group_blocks[0][1:3]
    num_local, offloaded, loads = _admit_with_the_tier(mgr, b)
    assert num_local == 12 and len(offloaded) == 3
    assert [p for p, _ in _group_loads(offloaded, 1)] == [4, 5] and len(loads) == 3 + 2
    assert mgr.groups[0].req_to_blocks["b"][:4] == [RELEASED_BLOCK] * 4
    assert [blk.ref_cnt for blk in device_window] == [0, 0] and mgr.get_num_held_blocks("b") == 7 + 3
    # (The end of a prefix other prompts share: kept as recently used, and for the tier when evicted.)
    assert list(mgr.block_pool.free_block_queue)[-2:] == device_window
    assert all(blk.in_hit_window for blk in device_window)
    mgr.block_pool.check_integrity()


def test_the_tier_keeps_a_windowed_groups_blocks_of_the_windows_a_hit_would_need_alone():
    """A 25-token prompt decoded to 41 tokens (window 6): the windowed group's blocks released behind the
    window go to the tier only where a later hit needs them: blocks 4 and 5 (the window of the prompt's
    last full block, for the prompt again) and the blocks it held at the end (8, 9: for a continuation);
    blocks 0..3, 6 and 7 are not saved. Group 0's every block is."""
    prompt = list(range(25))
    mgr = _hybrid(60, num_offload_blocks=60)
    a = _req("a", prompt)
    mgr.allocate_slots(a, 25)
    a.num_computed_tokens = 25
    for token in range(16):  # (decoding: one token a pass, the windowed blocks behind the window released)
        a.append_output_token_ids(100 + token)
        mgr.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    hashes = list(a.block_hashes)
    assert len(hashes) == 10 and mgr.groups[0].num_released_block["a"] == 8  # (keys from 35 on at 40)
    mgr.free(a)
    _push_out_to_the_tier(mgr, [])
    windowed = mgr.groups[0]
    assert [h in mgr.offload for h in hashes] == [True] * 10
    assert [windowed.key(h) in mgr.offload for h in hashes] == [False] * 4 + [True] * 2 + [False] * 2 + [True] * 2
    # The prompt again: six blocks from the tier, the windowed group's 4 and 5 among them.
    b = _req("b", prompt)
    num_local, offloaded, loads = _admit_with_the_tier(mgr, b)
    assert num_local == 0 and len(offloaded) == 6 and [p for p, _ in _group_loads(offloaded, 1)] == [4, 5]
    assert len(loads) == 6 + 2
    mgr.block_pool.check_integrity()


def test_the_tier_keeps_the_window_of_a_shared_prefix_a_prompt_found_cached():
    """A second prompt sharing the first 16 tokens found them cached: as it moves on, the windowed group's
    blocks 2 and 3 (the window of its hit) go behind its window and are flagged for the tier, so a third
    prompt sharing those 16 tokens finds them in the tier once the device cache lost them."""
    mgr = _hybrid(60, num_offload_blocks=60)
    a = _req("a", list(range(40)))
    mgr.allocate_slots(a, 40)
    a.num_computed_tokens = 40
    a.append_output_token_ids(7)
    mgr.allocate_slots(a, 1)  # (its windowed blocks 0..7 behind the window: only 7, of its prompt's, flagged)
    mgr.free(a)
    shared = list(range(16))
    b = _req("b", shared + list(range(200, 220)))
    assert _admit_with_the_tier(mgr, b)[0] == 16
    b.num_computed_tokens = 36
    mgr.allocate_slots(b, 1)  # (the token at 36 sees keys 31..36: blocks 0..6 behind its window)
    mgr.free(b)
    _push_out_to_the_tier(mgr, [])
    windowed = mgr.groups[0]
    assert [windowed.key(h) in mgr.offload for h in b.block_hashes[:4]] == [False, False, True, True]
    c = _req("c", shared + list(range(300, 310)))
    num_local, offloaded, _ = _admit_with_the_tier(mgr, c)
    assert num_local == 0 and len(offloaded) == 4 and [p for p, _ in _group_loads(offloaded, 1)] == [2, 3]
    mgr.block_pool.check_integrity()


@pytest.mark.parametrize("spare", [0, -1])
def test_a_hit_the_tier_extends_fits_a_pool_of_exactly_the_blocks_it_takes(spare):
    """Everything in the tier, the 25-token prompt again: group 0's six blocks loaded and one computed, the
    windowed group's blocks 4 and 5 loaded and one computed: ten blocks. With ten free it is admitted; with
    nine it is not, and nothing is taken."""
    prompt = list(range(25))
    mgr = _hybrid_with_a_tier_after(prompt, {})
    pool = mgr.block_pool
    pool.get_new_blocks(pool.get_num_free_blocks() - 10 - spare)  # (held elsewhere)
    b = _req("b", prompt)
    computed, num_local = mgr.get_computed_blocks(b)
    offloaded = mgr.get_offloaded_blocks(b, computed)
    assert num_local == 0 and len(offloaded) == 6
    fits = mgr.allocate_slots(b, 25, 0, offloaded.computed) is not None
    assert fits == (spare == 0)
    if fits:
        assert pool.get_num_free_blocks() == 0 and mgr.get_num_held_blocks("b") == 7 + 3
    else:
        assert pool.get_num_free_blocks() == 9 and "b" not in mgr.req_to_blocks
    pool.check_integrity()
