"""schedule(): the token budget, the two loops, admission rules and blocked requests."""

import pytest

from engine_core.request import RequestStatus
from engine_core.sched.scheduler import PauseState

from .utils import create_requests, create_scheduler, fake_model_output, step


def test_token_budget_seeds_from_max_num_scheduled_tokens_when_set():
    sched = create_scheduler(max_num_batched_tokens=1000, max_num_scheduled_tokens=30)
    sched.add_request(create_requests(1, num_tokens=100)[0])
    assert sched.schedule().total_num_scheduled_tokens == 30


def test_num_computed_tokens_advances_at_end_of_schedule_so_two_calls_schedule_next_chunks():
    sched = create_scheduler(max_num_batched_tokens=40)
    req = create_requests(1, num_tokens=100)[0]
    sched.add_request(req)
    first = sched.schedule()
    assert first.num_scheduled_tokens[req.request_id] == 40 and req.num_computed_tokens == 40
    second = sched.schedule()
    assert second.num_scheduled_tokens[req.request_id] == 40 and req.num_computed_tokens == 80
    assert second.scheduled_cached_reqs.new_token_ids[0] == req.all_token_ids[40:80]


def test_mid_prefill_request_gets_no_output():
    sched = create_scheduler(max_num_batched_tokens=40)
    req = create_requests(1, num_tokens=100)[0]
    sched.add_request(req)
    so = sched.schedule()
    mro = fake_model_output(sched, so)
    assert mro.sampled_token_ids == [[]]
    assert sched.update_from_output(so, mro).get(0) is None or not sched.update_from_output(so, mro)[0].outputs


def test_running_loop_runs_first_and_running_requests_are_clamped_never_rejected():
    sched = create_scheduler(max_num_batched_tokens=50)
    old, new = create_requests(2, num_tokens=120)
    sched.add_request(old)
    step(sched)  # old: 50 computed
    sched.add_request(new)
    so = sched.schedule()
    # old wanted 70, got the whole budget; new got nothing this pass.
    assert so.num_scheduled_tokens == {old.request_id: 50}


def test_long_prefill_threshold_clamps_each_request_then_the_budget_has_the_last_word():
    sched = create_scheduler(max_num_batched_tokens=100, long_prefill_token_threshold=30)
    a, b, c, d = create_requests(4, num_tokens=80)
    for r in (a, b, c, d):
        sched.add_request(r)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {a.request_id: 30, b.request_id: 30, c.request_id: 30, d.request_id: 10}


def test_zero_threshold_disables_the_clamp():
    sched = create_scheduler(max_num_batched_tokens=100, long_prefill_token_threshold=0)
    req = create_requests(1, num_tokens=80)[0]
    sched.add_request(req)
    assert sched.schedule().num_scheduled_tokens[req.request_id] == 80


def test_admission_cap_counts_running_plus_sessions_waiting_for_streaming_input():
    sched = create_scheduler(max_num_seqs=2)
    session = create_requests(1, num_tokens=5, max_tokens=1, ignore_eos=True, resumable=True)[0]
    sched.add_request(session)
    step(sched)
    assert session.status == RequestStatus.WAITING_FOR_STREAMING_REQ
    a, b = create_requests(2)
    sched.add_request(a)
    sched.add_request(b)
    so = sched.schedule()
    # One slot is held by the idle session, so only one of the two is admitted.
    assert list(so.num_scheduled_tokens) == [a.request_id]
    assert len(sched.running) == 1


def test_max_num_seqs_caps_admission():
    sched = create_scheduler(max_num_seqs=3)
    for r in create_requests(5):
        sched.add_request(r)
    sched.schedule()
    assert len(sched.running) == 3 and len(sched.waiting) == 2


def test_without_chunked_prefill_a_waiting_request_that_does_not_fit_stops_admission():
    sched = create_scheduler(max_num_batched_tokens=100, enable_chunked_prefill=False, max_model_len=100)
    a, b, c = create_requests(1, num_tokens=60) + create_requests(1, num_tokens=60) + create_requests(1, num_tokens=10)
    for r in (a, b, c):
        sched.add_request(r)
    so = sched.schedule()
    # b does not fit in the 40 left and breaks the loop; c behind it is not looked at.
    assert so.num_scheduled_tokens == {a.request_id: 60}


def test_with_chunked_prefill_the_waiting_request_is_clamped_instead():
    sched = create_scheduler(max_num_batched_tokens=100)
    a, b = create_requests(2, num_tokens=60)
    for r in (a, b):
        sched.add_request(r)
    assert sched.schedule().num_scheduled_tokens == {a.request_id: 60, b.request_id: 40}


def test_prefix_hit_lands_in_the_local_num_computed_tokens():
    sched = create_scheduler(block_size=4)
    prefix = list(range(500, 520))
    a = create_requests(1, num_tokens=24, prefix=prefix)[0]
    sched.add_request(a)
    step(sched)
    b = create_requests(1, num_tokens=26, prefix=prefix)[0]
    sched.add_request(b)
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 20
    assert so.num_scheduled_tokens[b.request_id] == 6
    assert b.num_cached_tokens == 20


def test_identical_prompt_still_recomputes_its_last_token():
    sched = create_scheduler(block_size=4)
    a = create_requests(1, num_tokens=16, same_prompt=True)[0]
    sched.add_request(a)
    step(sched)
    b = create_requests(1, num_tokens=16, same_prompt=True)[0]
    sched.add_request(b)
    so = sched.schedule()
    assert so.num_scheduled_tokens[b.request_id] == 4  # last full block is recomputed, not 0 tokens


def test_the_admission_append_is_the_only_way_into_running():
    sched = create_scheduler(max_num_seqs=2)
    for r in create_requests(4, max_tokens=3, ignore_eos=True):
        sched.add_request(r)
    while sched.has_unfinished_requests():
        step(sched)
        assert len(sched.running) <= 2


def test_fcfs_drains_skipped_waiting_before_waiting():
    sched = create_scheduler(max_num_seqs=1)
    first, blocked = create_requests(2)
    blocked.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    sched.add_request(first)
    sched.add_request(blocked)
    sched.on_grammar_ready(blocked.request_id)
    assert blocked.status == RequestStatus.WAITING
    so = sched.schedule()
    # The promoted request, in skipped_waiting, is looked at before the waiting queue.
    assert list(so.num_scheduled_tokens) == [blocked.request_id]


def test_blocked_requests_are_set_aside_and_prepended_onto_skipped_waiting():
    sched = create_scheduler()
    g1, g2, plain = create_requests(3)
    g1.status = g2.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    for r in (g1, g2, plain):
        sched.add_request(r)
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == [plain.request_id]
    # Each declined request was prepended onto the pass's local queue, which then went in front.
    assert set(sched.skipped_waiting) == {g1, g2} and len(sched.skipped_waiting) == 2


def test_grammar_ready_promotes_and_a_later_pass_admits():
    sched = create_scheduler()
    req = create_requests(1)[0]
    req.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    sched.add_request(req)
    assert not sched.schedule().num_scheduled_tokens
    sched.on_grammar_ready(req.request_id)
    assert req.request_id in sched.schedule().num_scheduled_tokens
    assert req.status == RequestStatus.RUNNING


def test_remote_kvs_ready_promotes_the_request():
    sched = create_scheduler()
    req = create_requests(1)[0]
    req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    sched.add_request(req)
    assert not sched.schedule().num_scheduled_tokens
    sched.on_remote_kvs_ready(req.request_id)
    assert req.status == RequestStatus.WAITING
    assert req.request_id in sched.schedule().num_scheduled_tokens


def test_grammar_failure_finishes_only_that_request_with_error_in_next_update():
    sched = create_scheduler()
    bad, good = create_requests(2)
    bad.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    sched.add_request(bad)
    sched.add_request(good)
    sched.on_grammar_failed(bad.request_id, "invalid regex")
    assert bad.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    _, outputs = step(sched)
    finished = {o.request_id: o for o in outputs[0].outputs if o.finish_reason is not None}
    assert finished[bad.request_id].finish_reason.name == "ERROR"
    assert finished[bad.request_id].stop_reason == "invalid regex"
    assert bad.status == RequestStatus.FINISHED_ERROR and bad not in sched.skipped_waiting
    assert good.status == RequestStatus.RUNNING


def test_pause_new_stops_admissions_but_running_requests_continue():
    sched = create_scheduler()
    a, b = create_requests(2, max_tokens=5, ignore_eos=True)
    sched.add_request(a)
    step(sched)
    sched.pause(PauseState.PAUSED_NEW)
    sched.add_request(b)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {a.request_id: 1}
    sched.resume()
    assert b.request_id in sched.schedule().num_scheduled_tokens


def test_pause_all_sets_the_budget_to_zero():
    sched = create_scheduler()
    a = create_requests(1, max_tokens=5, ignore_eos=True)[0]
    sched.add_request(a)
    step(sched)
    sched.pause(PauseState.PAUSED_ALL)
    so = sched.schedule()
    assert so.total_num_scheduled_tokens == 0 and not so.num_scheduled_tokens
    sched.resume()
    assert sched.schedule().num_scheduled_tokens == {a.request_id: 1}


def test_running_request_with_nothing_new_is_skipped_not_a_reason_to_stop():
    sched = create_scheduler()
    a, b = create_requests(2, max_tokens=5, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    sched.schedule()  # both fully scheduled; no update yet, so a has zero new tokens next pass
    a.append_output_token_ids(3)  # only a has a new token in flight
    so = sched.schedule()
    assert so.num_scheduled_tokens == {a.request_id: 1}


def test_partial_prefill_caps_only_apply_above_one():
    sched = create_scheduler(max_num_batched_tokens=1000, max_num_partial_prefills=1)
    for r in create_requests(4, num_tokens=100):
        sched.add_request(r)
    assert len(sched.schedule().num_scheduled_tokens) == 4


def test_partial_prefill_cap_skips_waiting_requests_without_stopping_admission():
    sched = create_scheduler(max_num_batched_tokens=1000, max_model_len=1000, max_num_partial_prefills=2,
                             max_long_partial_prefills=1, long_prefill_token_threshold=50)
    long1, long2 = create_requests(2, num_tokens=200)
    short1, short2 = create_requests(2, num_tokens=30)
    for r in (long1, long2, short1, short2):
        sched.add_request(r)
    so = sched.schedule()
    # long2 is refused by the long cap, short1 fills the second partial slot, short2 is refused.
    assert set(so.num_scheduled_tokens) == {long1.request_id, short1.request_id}
    assert set(sched.skipped_waiting) == {long2, short2}


def test_running_prefill_chunks_count_against_the_partial_prefill_cap():
    sched = create_scheduler(max_num_batched_tokens=100, max_model_len=1000, max_num_partial_prefills=2,
                             max_long_partial_prefills=2, long_prefill_token_threshold=40)
    a, b, c = create_requests(3, num_tokens=300)
    for r in (a, b):
        sched.add_request(r)
    step(sched)  # a and b each mid-prefill
    sched.add_request(c)
    so = sched.schedule()
    assert c.request_id not in so.num_scheduled_tokens and c in sched.skipped_waiting


def test_a_full_partial_prefill_cap_looks_nothing_up_and_keeps_the_waiting_order():
    """While the cap is full, the prompts waiting behind it are set aside without a prefix-cache
    lookup (each pass counted one per waiting request in the stats) and keep their order."""
    sched = create_scheduler(max_num_batched_tokens=100, max_model_len=4000, max_num_partial_prefills=2,
                             max_long_partial_prefills=2, long_prefill_token_threshold=40)
    longs = create_requests(2, num_tokens=2000)
    def lookups(outputs) -> int:
        return next(eco.scheduler_stats for eco in outputs.values() if eco.scheduler_stats).prefix_cache_stats.requests

    for r in longs:
        sched.add_request(r)
    assert lookups(step(sched)[1]) == 2  # (both mid-prefill, looked up once each)
    shorts = create_requests(5, num_tokens=20)
    for r in shorts:
        sched.add_request(r)
    for _ in range(3):
        so, outputs = step(sched)
        assert set(so.num_scheduled_tokens) == {r.request_id for r in longs}
        assert list(sched.skipped_waiting) == shorts
        assert lookups(outputs) == 0


def test_request_too_long_for_the_model_is_finished_as_ignored():
    sched = create_scheduler(max_model_len=50)
    too_long, ok = create_requests(1, num_tokens=60) + create_requests(1, num_tokens=10)
    sched.add_request(too_long)
    sched.add_request(ok)
    _, outputs = step(sched)
    by_id = {o.request_id: o for o in outputs[0].outputs}
    assert too_long.status == RequestStatus.FINISHED_IGNORED
    assert by_id[too_long.request_id].finish_reason.name == "LENGTH"
    assert ok.status == RequestStatus.RUNNING


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_sliding_window_serves_a_request_longer_than_the_pool(prefix_caching):
    """8 blocks of 4 hold 32 tokens. With full attention, a 100-token prompt can never fit and is
    ignored; with a window of 6 the blocks behind it are released chunk by chunk, so it prefills,
    decodes to its end, and never holds more than (5 keys + 8 new) / 4 + 1 = 5 blocks."""
    ignored = create_scheduler(max_num_batched_tokens=8, block_size=4, num_blocks=8, max_model_len=200)
    [too_long] = create_requests(1, num_tokens=100, max_tokens=3)
    ignored.add_request(too_long)
    step(ignored)
    assert too_long.status == RequestStatus.FINISHED_IGNORED
    sched = create_scheduler(max_num_batched_tokens=8, block_size=4, num_blocks=8, max_model_len=200,
                             sliding_window=6, enable_prefix_caching=prefix_caching)
    [long] = create_requests(1, num_tokens=100, max_tokens=3, ignore_eos=True)
    sched.add_request(long)
    kv = sched.kv_cache_manager
    held = []
    for _ in range(20):
        so, _ = step(sched)
        if long.request_id in so.num_scheduled_tokens:
            held.append(kv.get_num_held_blocks(long.request_id))
        kv.block_pool.check_integrity()
        if long.is_finished():
            break
    assert long.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(long.output_token_ids) == 3
    assert max(held) <= 5 and kv.block_pool.get_num_free_blocks() == 8


def test_new_and_cached_request_data_shapes():
    sched = create_scheduler(max_num_batched_tokens=64, block_size=16)
    a = create_requests(1, num_tokens=40, max_tokens=20, ignore_eos=True)[0]
    sched.add_request(a)
    so, _ = step(sched)
    new = so.scheduled_new_reqs[0]
    assert new.req_id == a.request_id and new.prompt_token_ids == a.prompt_token_ids
    assert len(new.block_ids) == 3 and new.num_computed_tokens == 0
    so = sched.schedule()
    cached = so.scheduled_cached_reqs
    assert cached.req_ids == [a.request_id] and cached.resumed_from_preemption == [False]
    assert cached.new_token_ids == [[7]] and cached.num_computed_tokens == [40] and cached.new_block_ids == [None]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_end_of_pass_budget_assertions_hold(policy):
    sched = create_scheduler(max_num_batched_tokens=64, num_blocks=12, block_size=8, policy=policy)
    for r in create_requests(10, num_tokens=30, max_tokens=8, ignore_eos=True):
        sched.add_request(r)
    while sched.has_unfinished_requests():
        so, _ = step(sched)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values()) <= 64
