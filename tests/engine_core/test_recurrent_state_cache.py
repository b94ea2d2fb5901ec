"""The prefix cache's recurrent states (--mamba-cache-mode align): which states it keeps, where in a
pass's chunks the scheduler asks for them (chunks are never cut for them), and the copies it asks the
workers for."""

from __future__ import annotations

from engine_core.core.recurrent_state_cache import RecurrentStateCache, RecurrentStateStats

from .utils import create_requests, create_scheduler, step


def test_a_hit_runs_to_the_last_kept_state_within_the_cached_blocks():
    cache = RecurrentStateCache(4)
    cache.plan_save("r", b"b", 32)
    cache.plan_save("s", b"d", 64)
    cache.plan_save("s", b"e", 80)
    assert cache.take_copies() == ({}, {"r": [(32, 0)], "s": [(64, 1), (80, 2)]}) and len(cache) == 3
    hashes = [b"a", b"b", b"c", b"d", b"e"]
    assert cache.longest_hit(hashes, 5) == 5
    assert cache.longest_hit(hashes, 4) == 4
    assert cache.longest_hit(hashes, 3) == 2  # (the KV cache holds three blocks: d lies past them)
    assert cache.longest_hit(hashes, 1) == 0
    assert cache.longest_hit([b"x", b"y"], 2) == 0
    # A prefix already kept is not saved again (the state would be the same).
    cache.plan_save("t", b"b", 32)
    assert cache.take_copies() == ({}, {})
    cache.reset()
    assert len(cache) == 0 and cache.longest_hit(hashes, 5) == 0


def test_the_least_recently_used_state_goes_first_but_never_one_this_pass_restores_or_saves():
    cache = RecurrentStateCache(2)
    cache.plan_save("r", b"a", 16)
    cache.plan_save("s", b"b", 16)
    cache.take_copies()
    cache.plan_restore("t", b"a")  # (a is restored this pass: b is the least recently used, and a pinned)
    cache.plan_save("u", b"c", 16)
    assert cache.take_copies() == ({"t": 0}, {"u": [(16, 1)]})
    assert cache.longest_hit([b"b"], 1) == 0 and cache.longest_hit([b"c"], 1) == 1
    # Both slots pinned (one restored, one just saved into): a third save this pass finds none.
    cache.plan_restore("v", b"c")
    cache.plan_save("w", b"d", 16)
    cache.plan_save("x", b"e", 16)
    assert cache.take_copies() == ({"v": 1}, {"w": [(16, 0)]})
    assert cache.longest_hit([b"e"], 1) == 0
    # (b's and a's slots taken by newer states; e not kept)
    assert cache.take_stats() == RecurrentStateStats(saved=4, restored=2, evicted=2, skipped=1)
    assert cache.take_stats() == RecurrentStateStats()


def test_an_answers_longer_state_makes_its_earlier_one_the_first_to_go():
    cache = RecurrentStateCache(3)
    cache.plan_save("prompt", b"p", 16)
    cache.plan_save("r", b"g1", 32)
    cache.take_copies()
    # (without superseding, p would be the first to go: the least recently used)
    cache.plan_save("r", b"g2", 48, supersedes=b"g1")
    cache.take_copies()
    cache.plan_save("s", b"q", 16)
    assert cache.take_copies() == ({}, {"s": [(16, 1)]})  # (g1's slot)
    assert cache.longest_hit([b"p"], 1) == 1 and cache.longest_hit([b"g1"], 1) == 0


def _passes(scheduler, request) -> tuple[list[int], list[list[tuple[int, int]]]]:
    """Every pass of ``request`` (added alone) to its end: its chunk and the states kept in it."""
    scheduler.add_request(request)
    chunks, saves = [], []
    while scheduler.has_unfinished_requests():
        so, _ = step(scheduler)
        chunks.append(so.num_scheduled_tokens[request.request_id])
        saves.append(so.recurrent_state_saves.get(request.request_id, []))
    return chunks, saves


def test_prefill_chunks_keep_the_states_at_the_last_boundary_each_reaches_and_before_the_last_token():
    """Block 16, a 100-token prompt, 40 tokens a pass: chunks of 40, 40 and 20, uncut; each keeps the
    state at the last block boundary it reaches (32, 80; 96, which is also the last before the prompt's
    last token); then the decodes keep theirs where they reach a block's end (112)."""
    scheduler = create_scheduler(max_num_batched_tokens=40, num_recurrent_state_slots=8)
    (request,) = create_requests(1, num_tokens=100, max_tokens=20)
    chunks, saves = _passes(scheduler, request)
    assert chunks == [40, 40, 20] + [1] * 19
    assert saves[:3] == [[(32, 0)], [(80, 1)], [(96, 2)]]
    assert [(i, kept) for i, kept in enumerate(saves[3:]) if kept] == [(11, [(112, 3)])]


def test_a_prompt_seen_again_starts_from_its_kept_state_and_a_longer_kv_hit_is_cut_back():
    scheduler = create_scheduler(max_num_batched_tokens=64, num_recurrent_state_slots=8)
    (first,) = create_requests(1, num_tokens=100, max_tokens=1, same_prompt=True)
    assert _passes(scheduler, first) == ([64, 36], [[(64, 0)], [(96, 1)]])
    # The same prompt: its KV blocks (6) and the state at their end (96) are kept.
    (again,) = create_requests(1, num_tokens=100, max_tokens=1, same_prompt=True)
    scheduler.add_request(again)
    so, _ = step(scheduler)
    assert again.num_cached_tokens == 96 and so.num_scheduled_tokens[again.request_id] == 4
    assert so.recurrent_state_restores == {again.request_id: 1} and so.recurrent_state_saves == {}
    while scheduler.has_unfinished_requests():
        step(scheduler)
    # A prompt sharing the first 85 tokens: the KV cache holds 5 of its blocks (80 tokens), but no state
    # stands at 80 (the first prompt's stand at 64 and 96): it starts at 64, and keeps the state at 80,
    # where the blocks it shares end (its last full block too).
    (shared,) = create_requests(1, num_tokens=90, max_tokens=1, prefix=list(range(85)), same_prompt=True)
    assert shared.prompt_token_ids[84:] == [84, 0, 1, 2, 3, 4]
    scheduler.add_request(shared)
    so, _ = step(scheduler)
    assert shared.num_cached_tokens == 64 and so.recurrent_state_restores == {shared.request_id: 0}
    assert so.num_scheduled_tokens[shared.request_id] == 26
    assert so.recurrent_state_saves == {shared.request_id: [(80, 2)]}


def test_without_kept_states_the_scheduler_asks_for_no_copies():
    scheduler = create_scheduler(max_num_batched_tokens=40)
    (request,) = create_requests(1, num_tokens=100, max_tokens=2)
    scheduler.add_request(request)
    so, _ = step(scheduler)
    assert so.num_scheduled_tokens[request.request_id] == 40
    assert so.recurrent_state_saves == {} and so.recurrent_state_restores == {}
    assert not scheduler.keeps_recurrent_states and scheduler.kv_cache_manager.recurrent_states is None


def test_a_prompt_of_whole_blocks_keeps_the_state_a_block_before_its_end_so_a_repeat_can_start_there():
    """A repeat always computes its last token: a 48-token prompt (three blocks of 16) may start from 32
    at most, so its one chunk keeps the states at 32 and at its end, 48 (where its answer goes on)."""
    scheduler = create_scheduler(max_num_batched_tokens=64, num_recurrent_state_slots=8)
    (first,) = create_requests(1, num_tokens=48, max_tokens=1, same_prompt=True)
    assert _passes(scheduler, first) == ([48], [[(32, 0), (48, 1)]])
    (again,) = create_requests(1, num_tokens=48, max_tokens=1, same_prompt=True)
    scheduler.add_request(again)
    so, _ = step(scheduler)
    assert again.num_cached_tokens == 32 and so.recurrent_state_restores == {again.request_id: 0}


def test_without_chunked_prefill_prompts_run_whole_and_keep_their_states_all_the_same():
    scheduler = create_scheduler(max_num_batched_tokens=128, max_model_len=128, enable_chunked_prefill=False,
                                 num_recurrent_state_slots=8)
    (request,) = create_requests(1, num_tokens=100, max_tokens=20)
    chunks, saves = _passes(scheduler, request)
    assert chunks == [100] + [1] * 19
    assert [(i, kept) for i, kept in enumerate(saves) if kept] == [(0, [(96, 0)]), (12, [(112, 1)])]


def test_kept_states_never_change_the_chunks_a_prompt_runs_in():
    """The same prompts, with and without kept states, through thresholds, budgets below a block and
    images that must be computed whole (--disable-chunked-mm-input): the same chunks pass for pass."""
    import dataclasses

    from tests.engine_core.test_scheduler_encoder import prompt_with
    from tests.engine_core.test_scheduler_encoder import request as image_request

    cases = [({"max_num_batched_tokens": 40}, 100, None), ({"max_num_batched_tokens": 7}, 50, None),
             ({"max_num_batched_tokens": 64, "long_prefill_token_threshold": 24}, 90, None),
             ({"max_num_batched_tokens": 50}, 100, (10, 40)), ({"max_num_batched_tokens": 100}, 130, (90, 20))]
    for flags, num_tokens, image in cases:
        runs = []
        for slots in (0, 8):
            if image is None:
                scheduler = create_scheduler(num_recurrent_state_slots=slots, **flags)
                (request,) = create_requests(1, num_tokens=num_tokens, max_tokens=3)
            else:
                scheduler = create_scheduler(max_tokens_per_mm_item=image[1], num_recurrent_state_slots=slots,
                                             **flags)
                scheduler.scheduler_config = dataclasses.replace(scheduler.scheduler_config,
                                                                 disable_chunked_mm_input=True)
                tokens, features = prompt_with([("a", image[0])], num_tokens, length=image[1])
                request = image_request("r", tokens, features, max_tokens=3)
            runs.append(_passes(scheduler, request))
        assert runs[0][0] == runs[1][0], (flags, num_tokens, image)
        assert not any(runs[0][1]) and any(runs[1][1])


def test_where_a_prompt_leaves_a_shared_prefix_the_kv_cache_holds_its_state_is_kept_for_the_next():
    """Prompts that share their first 70 tokens (a system prompt), 48 tokens a pass, blocks of 16. The
    first keeps states at 48 and 96 (its chunks' last boundaries). The second finds four blocks (64
    tokens) in the KV cache but a state at 48 only: it starts at 48 and keeps the state at 64, where the
    shared blocks end, besides 96; the third starts at 64."""
    scheduler = create_scheduler(max_num_batched_tokens=48, num_recurrent_state_slots=8)
    shared = list(range(70))
    prompts = [shared + [1000 * (k + 1) + j for j in range(30)] for k in range(3)]
    starts, first_passes = [], []
    for prompt in prompts:
        (request,) = create_requests(1, num_tokens=100, max_tokens=1, prefix=prompt)
        scheduler.add_request(request)
        so, _ = step(scheduler)
        starts.append(request.num_cached_tokens)
        first_passes.append((so.num_scheduled_tokens[request.request_id],
                             [p for p, _ in so.recurrent_state_saves[request.request_id]]))
        while scheduler.has_unfinished_requests():
            step(scheduler)
    assert starts == [0, 48, 64] and first_passes == [(48, [48]), (48, [64, 96]), (36, [96])]
    assert scheduler.kv_cache_manager.state_junctions == {}
