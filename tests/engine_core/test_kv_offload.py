"""KV offloading's host-memory tier: what it keeps, and the copies the scheduler asks the workers for."""

from __future__ import annotations

from engine_core.core.kv_offload import OffloadTier

from .utils import create_requests, create_scheduler, fake_model_output, step


def test_the_tier_finds_the_longest_run_from_the_start_and_touches_it():
    tier = OffloadTier(4)
    for block_id, block_hash in enumerate([b"a", b"b", b"c"]):
        tier.note_evicted(block_id, block_hash)
    stores, loads = tier.take_copies()
    assert stores == [(0, 0), (1, 1), (2, 2)] and loads == [] and len(tier) == 3
    assert tier.lookup([b"a", b"b", b"x", b"c"]) == [0, 1]
    assert tier.lookup([b"x", b"a"]) == []
    # A hash the tier holds is not saved again.
    tier.note_evicted(9, b"a")
    assert tier.take_copies() == ([], [])


def test_the_least_recently_used_slot_goes_first_but_never_one_this_pass_loads_from():
    tier = OffloadTier(2)
    tier.note_evicted(0, b"a")
    tier.note_evicted(1, b"b")
    tier.take_copies()
    tier.lookup([b"a"])  # (a lookup alone keeps nothing warm: its request may be turned away)
    tier.note_evicted(2, b"c")
    assert tier.take_copies() == ([(2, 0)], [])  # (a was still the least recently used)
    assert tier.lookup([b"a"]) == [] and tier.lookup([b"c"]) == [0]
    tier.touch([b"b"])  # (b is loaded: c is now the least recently used)
    tier.note_evicted(4, b"a")
    assert tier.take_copies() == ([(4, 0)], [])
    assert tier.lookup([b"c"]) == [] and tier.lookup([b"b"]) == [1] and tier.lookup([b"a"]) == [0]
    # Slot 0 (a) and 1 (b) are both being loaded from: a block evicted this pass finds no slot.
    tier.plan_loads([0, 1], [5, 6])
    tier.note_evicted(3, b"d")
    assert tier.take_copies() == ([], [(0, 5), (1, 6)])
    assert tier.lookup([b"d"]) == []
    assert tier.take_stats().loaded_blocks == 2 and tier.take_stats().loaded_blocks == 0
    tier.reset()
    assert len(tier) == 0 and tier.lookup([b"a"]) == []


def test_one_pass_never_stores_two_blocks_into_one_slot():
    tier = OffloadTier(3)
    tier.plan_loads([], [])
    for block_id in range(5):  # (more evictions in one pass than the tier has slots)
        tier.note_evicted(block_id, bytes([block_id]))
    stores, _ = tier.take_copies()
    assert stores == [(0, 0), (1, 1), (2, 2)]
    assert [tier.lookup([bytes([b])]) for b in range(5)] == [[0], [1], [2], [], []]
    # The next pass may reuse them again, least recently used first (0, 1, 2: lookups touch none).
    for block_id in (5, 6):
        tier.note_evicted(block_id, bytes([block_id]))
    assert tier.take_copies()[0] == [(5, 0), (6, 1)]


def test_the_tiers_changes_are_kv_cache_events_after_the_evictions_that_caused_them():
    from engine_core.core.block_pool import ALL_BLOCKS_CLEARED, BLOCKS_REMOVED, BLOCKS_STORED, TIER_REMOVED, TIER_STORED

    sched = create_scheduler(num_blocks=8, block_size=16, num_offload_blocks=2)
    pool = sched.kv_cache_manager.block_pool
    pool.record_kv_events()
    (first,) = create_requests(1, num_tokens=64, max_tokens=1)
    _finish(sched, first)
    hashes = list(first.block_hashes)  # (its four full blocks)
    assert pool.take_kv_events() == [(BLOCKS_STORED, hashes)] and len(hashes) == 4
    (other,) = create_requests(1, num_tokens=120, max_tokens=1)
    _finish(sched, other)
    events = pool.take_kv_events()
    # Evicted from the KV cache first, then two of them saved (the tier has two slots).
    kinds = [kind for kind, _ in events]
    assert kinds.index(BLOCKS_REMOVED) < kinds.index(TIER_STORED)
    stored = [h for kind, hs in events if kind == TIER_STORED for h in hs]
    assert len(stored) == 2 and set(stored) <= set(hashes) and TIER_REMOVED not in kinds
    # Applied in order, the events give what the tier holds; the engine's snapshot says the same.
    assert sorted(sched.kv_cache_manager.offload.hashes()) == sorted(stored)
    # A full tier makes room: what it drops is reported removed, before what replaces it is stored.
    (third,) = create_requests(1, num_tokens=120, max_tokens=1)
    _finish(sched, third)
    events = [(kind, h) for kind, hs in pool.take_kv_events() if kind in (TIER_STORED, TIER_REMOVED) for h in hs]
    assert sorted(h for kind, h in events if kind == TIER_REMOVED) == sorted(stored)
    assert events[0] == (TIER_REMOVED, events[0][1]) and events[1][0] == TIER_STORED
    assert sorted(sched.kv_cache_manager.offload.hashes()) == sorted(h for kind, h in events if kind == TIER_STORED)
    sched.kv_cache_manager.reset_prefix_cache()
    assert pool.take_kv_events()[-1] == (ALL_BLOCKS_CLEARED, [])


def _finish(sched, request):
    sched.add_request(request)
    outputs = []
    while not request.is_finished():
        outputs.append(step(sched)[0])
    return outputs


def test_evicted_prefix_blocks_are_saved_and_a_later_prompt_loads_them_instead_of_computing():
    sched = create_scheduler(num_blocks=8, block_size=16, num_offload_blocks=8)
    manager = sched.kv_cache_manager
    first, again = create_requests(2, num_tokens=64, max_tokens=1, same_prompt=True)
    _finish(sched, first)  # 4 blocks, the first 3 of them full prompt blocks to keep
    hashes = list(first.block_hashes[:3])
    (other,) = create_requests(1, num_tokens=120, max_tokens=1)
    sched.add_request(other)
    out = sched.schedule()  # 8 blocks: every block first's prompt left cached is handed out again
    assert len(out.kv_offload_stores) == 4 and out.kv_offload_loads == []
    assert [manager.block_pool.get_cached_block(h) for h in hashes] == [None] * 3
    sched.update_from_output(out, fake_model_output(sched, out))
    while not other.is_finished():
        step(sched)
    sched.add_request(again)
    out = sched.schedule()
    # Three blocks come from the tier (counted as cached and computed): only the last 16 tokens run.
    assert again.num_computed_tokens == 64 and again.num_cached_tokens == 48 == again.num_external_computed_tokens
    assert out.num_scheduled_tokens == {again.request_id: 16}
    slots = manager.offload.lookup(hashes)
    assert [slot for slot, _ in out.kv_offload_loads] == slots
    assert [block for _, block in out.kv_offload_loads] == manager.get_block_ids(again.request_id)[:3]
    # Once loaded they are in the device cache again, for the next prompt that shares them.
    assert [manager.block_pool.get_cached_block(h).block_id for h in hashes] == \
        manager.get_block_ids(again.request_id)[:3]
    assert sched.make_stats().kv_offload_loaded_blocks == 3


def test_the_tiers_lookups_are_counted_as_vllms_external_prefix_cache():
    """Each lookup in the tier counts the request's tokens as queried and the tokens its blocks
    found there hold as hits (vLLM's connector_prefix_cache_stats), as deltas."""
    sched = create_scheduler(num_blocks=8, block_size=16, num_offload_blocks=8)
    first, again = create_requests(2, num_tokens=64, max_tokens=1, same_prompt=True)
    _finish(sched, first)
    (other,) = create_requests(1, num_tokens=120, max_tokens=1)
    _finish(sched, other)  # (evicts first's blocks into the tier)
    sched.make_stats()
    sched.add_request(again)
    sched.schedule()
    looked_up = sched.make_stats().connector_prefix_cache_stats
    assert (looked_up.requests, looked_up.queries, looked_up.hits) == (1, 64, 48)
    assert sched.make_stats().connector_prefix_cache_stats.queries == 0


def test_a_prompt_that_waits_for_room_is_counted_once_as_an_external_lookup():
    """vLLM counts a connector lookup when the request gets in: a prompt looked up again on every
    pass while the pool has no room for it is one query."""
    sched = create_scheduler(num_blocks=8, block_size=16, num_offload_blocks=8)
    first, again = create_requests(2, num_tokens=64, max_tokens=1, same_prompt=True)
    _finish(sched, first)
    (other,) = create_requests(1, num_tokens=120, max_tokens=4)
    sched.add_request(other)  # (its 8 blocks evict first's into the tier, and it holds them 4 passes)
    step(sched)
    sched.add_request(again)
    counted = []
    while not again.is_finished():
        for outputs in step(sched)[1].values():
            if outputs.scheduler_stats is not None:
                counted.append(outputs.scheduler_stats.connector_prefix_cache_stats)
    assert len(counted) > 2  # (it waited)
    assert (sum(c.requests for c in counted), sum(c.queries for c in counted), sum(c.hits for c in counted)) == \
        (1, 64, 48)


def test_without_a_tier_nothing_is_saved():
    sched = create_scheduler(num_blocks=8, block_size=16)
    first, again = create_requests(2, num_tokens=64, max_tokens=1, same_prompt=True)
    _finish(sched, first)
    (other,) = create_requests(1, num_tokens=120, max_tokens=1)
    outs = _finish(sched, other)
    assert all(o.kv_offload_stores == [] for o in outs)
    assert sched.make_stats().connector_prefix_cache_stats is None
    sched.add_request(again)
    sched.schedule()
    assert again.num_computed_tokens == 64 and again.num_cached_tokens == 0
