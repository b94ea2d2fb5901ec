from collections import Counter

import pytest

from router.routing import (
    LeastLoadedPolicy,
    NoHealthyEngineError,
    PrefixAwarePolicy,
    RoundRobinPolicy,
    RoutingContext,
    SessionAffinityPolicy,
    create_routing_policy,
)


def ctx(loads, healthy=None, tokens=(), session=None, cache_salt=None):
    return RoutingContext(list(tokens), list(loads), list(healthy or [True] * len(loads)), session,
                          cache_salt=cache_salt)


def test_round_robin_cycles_and_skips_unhealthy_engines():
    p = RoundRobinPolicy()
    assert [p.choose(ctx([0, 0, 0])) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    assert {p.choose(ctx([0, 0, 0], [True, False, True])) for _ in range(6)} == {0, 2}
    with pytest.raises(NoHealthyEngineError):
        p.choose(ctx([0, 0], [False, False]))


def test_least_loaded_picks_the_lighter_of_two_samples():
    p = LeastLoadedPolicy(seed=1)
    assert all(p.choose(ctx([5, 0])) == 1 for _ in range(20))
    # With three engines, the most loaded one is never chosen (it always loses its pair).
    counts = Counter(p.choose(ctx([1, 9, 2])) for _ in range(300))
    assert counts[1] == 0 and counts[0] > counts[2] > 0
    assert p.choose(ctx([0, 0], [False, True])) == 1


def lora_ctx(loads, active, lora="sql", healthy=None):
    """Adapters by name here; the context keys them by (id, name), as the engines tell them apart."""
    ids = {"sql": 1, "chat": 2, "web": 3}
    return RoutingContext([], list(loads), list(healthy or [True] * len(loads)),
                          lora_key=None if lora is None else (ids[lora], lora),
                          active_adapters=[{(ids[name], name): n for name, n in a.items()} for a in active])


def test_least_loaded_keeps_an_adapter_on_the_engines_running_it():
    """LoRA affinity: an adapter's requests go where it runs unless that engine is more than the
    margin above an engine with a free slot; a new adapter goes where a slot is free; when no engine
    can take it without holding it back, load decides. Base-model requests and policies without
    max_loras are plain power of two choices."""
    p = LeastLoadedPolicy(seed=1, max_loras=1)
    # "sql" runs on engine 1, one request above the idle engine 0: it goes there, leaving 0's slot free.
    assert all(p.choose(lora_ctx([0, 1], [{}, {"sql": 1}])) == 1 for _ in range(20))
    # Two above: the engine with a free slot takes it (one adapter does not pile onto one engine).
    assert all(p.choose(lora_ctx([0, 2], [{}, {"sql": 2}])) == 0 for _ in range(20))
    # ... unless that engine's slot is taken by another adapter: then it stays, up to the load margin.
    assert all(p.choose(lora_ctx([0, 6], [{"chat": 1}, {"sql": 6}])) == 1 for _ in range(20))
    assert all(p.choose(lora_ctx([0, 9], [{"chat": 1}, {"sql": 9}])) == 0 for _ in range(20))
    # A reloaded adapter (a new id under the same name) is another adapter to the engines.
    # Engine 1 still runs requests under the earlier load: its one slot is taken; engine 0's is free.
    reloaded = RoutingContext([], [0, 1], [True, True], lora_key=(7, "sql"), active_adapters=[{}, {(1, "sql"): 1}])
    assert all(p.choose(reloaded) == 0 for _ in range(20))

    # Of two engines running it, the less loaded.
    assert all(p.choose(lora_ctx([2, 1, 0], [{"sql": 2}, {"sql": 1}, {"web": 1}])) == 1 for _ in range(20))
    # A new adapter: the engine whose slot is free (engine 0 runs "chat", max_loras 1), though busier.
    assert all(p.choose(lora_ctx([0, 4], [{"chat": 1}, {}])) == 1 for _ in range(20))
    # No slot free anywhere: the lighter of two samples.
    assert all(p.choose(lora_ctx([0, 3], [{"chat": 1}, {"web": 3}])) == 0 for _ in range(20))
    # An unhealthy engine running it is left out.
    assert all(p.choose(lora_ctx([3, 0], [{"sql": 3}, {}], healthy=[False, True])) == 1 for _ in range(20))
    # Base-model requests, and a policy that does not know max_loras, ignore adapters.
    assert all(p.choose(lora_ctx([0, 1], [{}, {"sql": 1}], lora=None)) == 0 for _ in range(20))
    assert all(LeastLoadedPolicy(seed=1).choose(lora_ctx([0, 1], [{}, {"sql": 1}])) == 0 for _ in range(20))
    # prefix_aware's misses follow the same affinity, and so does a match on an engine beyond the load margin.
    from engine_core.core.block_pool import BLOCKS_STORED
    from engine_core.core.kv_cache_utils import extend_block_hashes

    held = PrefixAwarePolicy(num_engines=3, block_size=4, seed=0, max_loras=1, load_margin=2)
    prompt, hashes = list(range(100, 108)), []
    extend_block_hashes(hashes, prompt, 2, 4, lora_key=(1, "sql"))
    held.apply_kv_events(2, [(BLOCKS_STORED, hashes)])
    ctx_held = RoutingContext(prompt, [0, 1, 9], [True] * 3, lora_key=(1, "sql"),
                              active_adapters=[{(2, "chat"): 1}, {}, {(1, "sql"): 9}])
    assert all(held.choose(ctx_held) == 1 for _ in range(10))  # (engine 0, the least loaded, holds chat's slot)
    # No engine has a slot for it: the least loaded takes it (not a draw that may land on the overloaded one).
    full = RoutingContext(prompt, [20, 20, 0], [True] * 3, lora_key=(1, "sql"),
                          active_adapters=[{(2, "chat"): 1}, {(3, "web"): 1}, {(2, "chat"): 1}])
    for seed in range(20):
        only_first = PrefixAwarePolicy(num_engines=3, block_size=4, seed=seed, max_loras=1, load_margin=2)
        only_first.apply_kv_events(0, [(BLOCKS_STORED, hashes)])
        assert only_first.choose(full) == 2
    prefix = PrefixAwarePolicy(num_engines=2, block_size=4, seed=0, max_loras=1)
    assert all(prefix.choose(lora_ctx([0, 6], [{"chat": 1}, {"sql": 6}])) == 1 for _ in range(5))


def test_prefix_aware_sends_a_shared_prefix_to_the_engine_that_holds_it():
    p = PrefixAwarePolicy(num_engines=3, block_size=4, seed=0)
    prefix = list(range(100, 132))
    first = p.choose(ctx([0, 0, 0], tokens=prefix + [1, 2, 3]))
    loads = [0, 0, 0]
    loads[first] = 2  # busier, but within the margin
    for tail in ([7, 8, 9, 10, 11], [20, 21], [30]):
        assert p.choose(ctx(loads, tokens=prefix + tail)) == first
    assert p.match_lengths(p_hashes(p, prefix))[first] == 8


def p_hashes(p, tokens):
    from engine_core.core.kv_cache_utils import extend_block_hashes
    out: list[bytes] = []
    extend_block_hashes(out, tokens, len(tokens) // p.block_size, p.block_size)
    return out


def test_prefix_aware_falls_back_to_least_loaded_beyond_the_margin():
    p = PrefixAwarePolicy(num_engines=2, block_size=4, load_margin=3, seed=0)
    prefix = list(range(64))
    holder = p.choose(ctx([0, 0], tokens=prefix))
    loads = [0, 0]
    loads[holder] = 10
    assert p.choose(ctx(loads, tokens=prefix)) == 1 - holder


def test_prefix_aware_matches_hashes_of_the_engine_block_size_and_chain():
    p = PrefixAwarePolicy(num_engines=2, block_size=4, seed=0)
    a = p.choose(ctx([0, 0], tokens=[1, 2, 3, 4, 5, 6, 7, 8]))
    # Same second block but a different first block: the chain differs, so no match.
    assert p.match_lengths(p_hashes(p, [9, 9, 9, 9, 5, 6, 7, 8]))[a] == 0
    p.forget_engine(a)
    assert p.match_lengths(p_hashes(p, [1, 2, 3, 4]))[a] == 0


def test_session_affinity_is_sticky_and_moves_only_the_dead_engines_sessions():
    p = SessionAffinityPolicy(num_engines=4, seed=0)
    sessions = [f"user-{i}" for i in range(200)]
    placed = {s: p.choose(ctx([0] * 4, session=s)) for s in sessions}
    assert set(placed.values()) == {0, 1, 2, 3}
    assert all(p.choose(ctx([9, 0, 0, 0], session=s)) == e for s, e in placed.items())
    moved = {s: p.choose(ctx([0] * 4, [True, False, True, True], session=s)) for s in sessions}
    for s, e in placed.items():
        if e != 1:
            assert moved[s] == e
        else:
            assert moved[s] != 1


def test_session_without_header_goes_least_loaded():
    p = SessionAffinityPolicy(num_engines=2, seed=0)
    assert p.choose(ctx([4, 0])) == 1


def test_unknown_policy_name_is_a_value_error():
    with pytest.raises(ValueError, match="routing_policy"):
        create_routing_policy("random", 2)


def test_prefix_aware_follows_what_the_engines_report_they_cache():
    """KV cache events: blocks another replica filled count, an evicted prefix stops attracting
    requests, a cleared cache forgets everything, and this replica's own unreported routes expire."""
    from engine_core.core.block_pool import ALL_BLOCKS_CLEARED, BLOCKS_REMOVED, BLOCKS_STORED

    now = [0.0]
    p = PrefixAwarePolicy(num_engines=2, block_size=4, seed=0, pending_ttl_s=10.0, clock=lambda: now[0])
    prefix = list(range(200, 216))
    hashes = p_hashes(p, prefix)
    p.apply_kv_events(0, [(ALL_BLOCKS_CLEARED, []), (BLOCKS_STORED, [])])
    p.apply_kv_events(1, [(ALL_BLOCKS_CLEARED, []), (BLOCKS_STORED, hashes)])  # filled via another replica
    assert p.num_cached_blocks() == [0, 4]
    assert all(p.choose(ctx([1, 0], tokens=prefix + [t])) == 1 for t in range(5))
    p.apply_kv_events(1, [(BLOCKS_REMOVED, hashes[2:])])  # evicted the tail of the prefix
    assert p.match_lengths(hashes)[1] == 2
    p.apply_kv_events(1, [(ALL_BLOCKS_CLEARED, [])])
    assert p.match_lengths(hashes) == [0, 0]
    # A route this replica just made counts until the engine reports the blocks, for pending_ttl_s.
    other = list(range(300, 312))
    first = p.choose(ctx([0, 0], tokens=other))
    assert p.match_lengths(p_hashes(p, other))[first] == 3
    now[0] = 11.0
    assert p.match_lengths(p_hashes(p, other))[first] == 0
    # Reported, it stays (whatever the time) until evicted.
    p.apply_kv_events(first, [(BLOCKS_STORED, p_hashes(p, other))])
    now[0] = 1000.0
    assert p.match_lengths(p_hashes(p, other))[first] == 3
    # A health flap forgets this replica's routes, not what the engine reports (its own events clear that).
    p.forget_engine(first)
    assert p.match_lengths(p_hashes(p, other))[first] == 3
    p.apply_kv_events(first, [(ALL_BLOCKS_CLEARED, [])])
    assert p.match_lengths(p_hashes(p, other))[first] == 0 and p.num_cached_blocks()[first] == 0


def test_prefix_aware_counts_blocks_an_engines_host_tier_holds_after_its_kv_cache():
    """KV offloading's events: blocks an engine moved to host memory still attract their prefix (the
    engine copies them back rather than computing them), counted after its KV cache's run as the
    engine looks them up; a cleared cache forgets the tier too."""
    from engine_core.core.block_pool import (
        ALL_BLOCKS_CLEARED,
        BLOCKS_REMOVED,
        BLOCKS_STORED,
        TIER_REMOVED,
        TIER_STORED,
    )

    p = PrefixAwarePolicy(num_engines=2, block_size=4, seed=0)
    prefix = list(range(400, 420))
    hashes = p_hashes(p, prefix)  # five blocks
    for engine in (0, 1):
        p.apply_kv_events(engine, [(ALL_BLOCKS_CLEARED, [])])
    p.apply_kv_events(0, [(BLOCKS_STORED, hashes[:2])])
    # Engine 1 cached all five, then evicted the last three to its tier (removed, then stored there).
    p.apply_kv_events(1, [(BLOCKS_STORED, hashes), (BLOCKS_REMOVED, hashes[2:]), (TIER_STORED, hashes[2:])])
    assert p.match_lengths(hashes) == [2, 5]
    # Only a run from the KV cache's end counts: a tier block after a gap does not.
    p.apply_kv_events(1, [(TIER_REMOVED, hashes[2:3])])
    assert p.match_lengths(hashes) == [2, 2]
    # Loaded back into the KV cache: a device block again.
    p.apply_kv_events(1, [(BLOCKS_STORED, hashes[2:3])])
    assert p.match_lengths(hashes) == [2, 5]
    assert p.choose(ctx([0, 3], tokens=prefix + [1])) == 1
    p.apply_kv_events(1, [(ALL_BLOCKS_CLEARED, [])])
    assert p.match_lengths(hashes) == [2, 0]


def test_prefix_aware_hashes_a_longrope_models_prompts_as_its_engines_do():
    """A LongRoPE model's engines key prompts past the pretrained length (12 here) apart: the policy
    hashes them the same way, so a long prompt follows the blocks an engine reports for long ones,
    and a short prompt with the same prefix does not."""
    from engine_core.core.block_pool import BLOCKS_STORED
    from engine_core.core.kv_cache_manager import KVCacheManager
    from engine_core.request import Request
    from engine_core.sampling_params import SamplingParams

    long_prompt = list(range(200, 216))  # 16 tokens
    engine_side = KVCacheManager(num_blocks=16, block_size=4, long_rope_after=12)
    request = Request("r", long_prompt, SamplingParams())
    engine_side.allocate_slots(request, len(long_prompt))
    p = PrefixAwarePolicy(num_engines=2, block_size=4, seed=0, long_rope_after=12)
    p.apply_kv_events(0, [(BLOCKS_STORED, [])])
    p.apply_kv_events(1, [(BLOCKS_STORED, request.block_hashes)])
    assert all(p.choose(ctx([1, 0], tokens=long_prompt + [t])) == 1 for t in range(3))
    assert p.match_lengths(p_hashes(p, long_prompt[:8]))[1] == 0  # a short prompt's hashes differ
    # Without the model's length the policy would hash a long prompt as a short one, and miss.
    plain = PrefixAwarePolicy(num_engines=2, block_size=4, seed=0)
    plain.apply_kv_events(1, [(BLOCKS_STORED, request.block_hashes)])
    assert plain.match_lengths(p_hashes(plain, long_prompt))[1] == 0


def test_prefix_aware_matches_a_salted_prompt_only_to_blocks_cached_under_its_salt():
    """vLLM's cache_salt keys a prompt's first block in the engine; the policy hashes it the same way,
    so a salted prompt follows the engine holding it under that salt, and not one holding it unsalted."""
    from engine_core.core.block_pool import BLOCKS_STORED
    from engine_core.core.kv_cache_manager import KVCacheManager
    from engine_core.request import Request
    from engine_core.sampling_params import SamplingParams

    prompt = list(range(300, 316))
    hashes = {}
    for salt in ("tenant-a", None):
        engine_side = KVCacheManager(num_blocks=16, block_size=4)
        request = Request("r", prompt, SamplingParams(), cache_salt=salt)
        engine_side.allocate_slots(request, len(prompt))
        hashes[salt] = request.block_hashes
    p = PrefixAwarePolicy(num_engines=2, block_size=4, seed=0)
    p.apply_kv_events(0, [(BLOCKS_STORED, hashes[None])])
    p.apply_kv_events(1, [(BLOCKS_STORED, hashes["tenant-a"])])
    assert all(p.choose(ctx([1, 0], tokens=prompt + [t], cache_salt="tenant-a")) == 1 for t in range(3))
    assert all(p.choose(ctx([0, 1], tokens=prompt + [t])) == 0 for t in range(3))
    # Another tenant's salt matches neither: the less loaded engine gets it, whichever holds the prompt.
    assert all(p.choose(ctx(loads, tokens=prompt, cache_salt=f"tenant-b{i}")) == loads.index(0)
               for i, loads in enumerate(([0, 1], [1, 0], [0, 1], [1, 0])))


def test_prefix_aware_cached_tokens_counts_what_an_engine_reports_not_what_was_sent_there():
    """Selective prefill/decode disaggregation asks how much of a prompt its decode engine holds: a
    prompt routed there a moment ago (this one included) is not held until the engine says so."""
    from engine_core.core.block_pool import ALL_BLOCKS_CLEARED, BLOCKS_STORED

    p = PrefixAwarePolicy(num_engines=2, block_size=4, seed=0)
    for engine in (0, 1):
        p.apply_kv_events(engine, [(ALL_BLOCKS_CLEARED, [])])
    prompt = list(range(500, 522))  # five full blocks and two tokens
    engine = p.choose(ctx([0, 0], tokens=prompt))
    assert p.match_lengths(p_hashes(p, prompt))[engine] == 5  # (sent there: routing counts it)
    assert p.cached_tokens(ctx([0, 0], tokens=prompt), engine) == 0
    p.apply_kv_events(engine, [(BLOCKS_STORED, p_hashes(p, prompt)[:3])])
    assert p.cached_tokens(ctx([0, 0], tokens=prompt), engine) == 12
    assert p.cached_tokens(ctx([0, 0], tokens=prompt), 1 - engine) == 0
