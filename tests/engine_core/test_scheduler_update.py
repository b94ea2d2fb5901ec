"""update_from_output: folding tokens back, stop checks, batched removal, fan-out by client."""

from engine_core.outputs import ModelRunnerOutput
from engine_core.request import RequestStatus

from .utils import EOS_TOKEN_ID, create_requests, create_scheduler, fake_model_output, step


def _one(sched, **kw):
    req = create_requests(1, **kw)[0]
    sched.add_request(req)
    return req


def _run_tokens(sched, req, tokens):
    outs = []
    for t in tokens:
        if req.is_finished():
            break
        _, o = step(sched, tokens={req.request_id: t})
        outs.extend(o[req.client_index].outputs if req.client_index in o else [])
    return outs


def test_eos_stops_unless_ignore_eos():
    sched = create_scheduler()
    req = _one(sched, max_tokens=10)
    outs = _run_tokens(sched, req, [3, EOS_TOKEN_ID, 4])
    assert req.status == RequestStatus.FINISHED_STOPPED and req.output_token_ids == [3, EOS_TOKEN_ID]
    assert outs[-1].finish_reason.name == "STOP" and outs[-1].stop_reason is None
    sched2 = create_scheduler()
    req2 = _one(sched2, max_tokens=3, ignore_eos=True)
    _run_tokens(sched2, req2, [EOS_TOKEN_ID] * 3)
    assert req2.status == RequestStatus.FINISHED_LENGTH_CAPPED and req2.num_output_tokens == 3


def test_stop_token_id_stops_with_stop_reason():
    sched = create_scheduler()
    req = _one(sched, max_tokens=10, stop_token_ids=[42])
    outs = _run_tokens(sched, req, [1, 42, 2])
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == 42
    assert outs[-1].stop_reason == 42 and outs[-1].new_token_ids == [42]


def test_max_tokens_and_max_model_len_cap_length():
    sched = create_scheduler()
    req = _one(sched, max_tokens=2)
    _run_tokens(sched, req, [1, 1, 1])
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED and req.num_output_tokens == 2
    sched2 = create_scheduler(max_model_len=12)
    req2 = _one(sched2, num_tokens=10, max_tokens=100)
    _run_tokens(sched2, req2, [1] * 5)
    assert req2.status == RequestStatus.FINISHED_LENGTH_CAPPED and req2.num_tokens == 12


def test_min_tokens_keeps_eos_and_stop_ids_from_ending_early():
    sched = create_scheduler()
    req = _one(sched, max_tokens=10, min_tokens=3, stop_token_ids=[42])
    _run_tokens(sched, req, [EOS_TOKEN_ID, 42, 5, EOS_TOKEN_ID])
    assert req.output_token_ids == [EOS_TOKEN_ID, 42, 5, EOS_TOKEN_ID]
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_tokens_after_a_stop_are_trimmed():
    sched = create_scheduler()
    req = _one(sched, max_tokens=10)
    so = sched.schedule()
    mro = ModelRunnerOutput([req.request_id], {req.request_id: 0}, [[5, EOS_TOKEN_ID, 6, 7]])
    outs = sched.update_from_output(so, mro)
    assert outs[0].outputs[0].new_token_ids == [5, EOS_TOKEN_ID]
    assert req.output_token_ids == [5, EOS_TOKEN_ID]


def test_removal_is_batched_and_running_is_rebuilt_once():
    sched = create_scheduler()
    a, b, c = create_requests(3, max_tokens=1)
    for r in (a, b, c):
        sched.add_request(r)
    old_running = sched.running
    so = sched.schedule()
    assert sched.running is old_running
    sched.update_from_output(so, fake_model_output(sched, so))
    assert sched.running is not old_running and sched.running == []
    assert old_running == [a, b, c]  # the old list was not mutated in place


def test_only_scheduled_requests_are_visited():
    sched = create_scheduler()
    a, b = create_requests(2, max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    so = sched.schedule()
    del so.num_scheduled_tokens[b.request_id]
    sched.update_from_output(so, fake_model_output(sched, so))
    assert a.num_output_tokens == 1 and b.num_output_tokens == 0


def test_stale_token_for_request_preempted_this_pass_is_appended_and_can_stop_it_out_of_waiting():
    sched = create_scheduler(block_size=4, num_blocks=2)
    a, b = create_requests(2, num_tokens=4, max_tokens=2, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    first = sched.schedule()  # a and b prefill
    # Before the first pass's output arrives, a second schedule() runs (async scheduling):
    a.append_output_token_ids(9)
    b.append_output_token_ids(9)
    second = sched.schedule()
    assert b.request_id in second.preempted_req_ids and b in sched.waiting
    # Now the stale output of the first pass arrives: b's token is appended and b stops (max_tokens=2).
    ids = list(first.num_scheduled_tokens)
    outs = sched.update_from_output(first, ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, [[4], [4]]))
    assert b.output_token_ids == [9, 4] and b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert b not in sched.waiting and b.request_id not in sched.requests
    assert any(o.request_id == b.request_id and o.finish_reason is not None for o in outs[0].outputs)
    sched.kv_cache_manager.block_pool.check_integrity()


def test_outputs_are_grouped_by_client_index_with_stats_on_exactly_one():
    sched = create_scheduler()
    reqs = create_requests(2, client_index=0) + create_requests(2, client_index=3)
    for r in reqs:
        sched.add_request(r)
    _, outs = step(sched)
    assert set(outs) == {0, 3}
    assert {o.request_id for o in outs[3].outputs} == {r.request_id for r in reqs[2:]}
    assert sum(eco.scheduler_stats is not None for eco in outs.values()) == 1


def test_stats_are_returned_even_when_no_request_produced_output():
    sched = create_scheduler(max_num_batched_tokens=8)
    sched.add_request(create_requests(1, num_tokens=50)[0])
    _, outs = step(sched)
    assert list(outs) == [0] and not outs[0].outputs and outs[0].scheduler_stats is not None


def test_finished_requests_set_per_client_when_enabled():
    sched = create_scheduler(include_finished_set=True)
    a = create_requests(1, max_tokens=1, client_index=1)[0]
    b = create_requests(1, max_tokens=5, client_index=2)[0]
    sched.add_request(a)
    sched.add_request(b)
    _, outs = step(sched)
    assert outs[1].finished_requests == {a.request_id}
    sched.finish_requests(b.request_id, RequestStatus.FINISHED_ABORTED)
    _, outs = step(sched)
    assert outs[2].finished_requests == {b.request_id}
    assert create_scheduler().finished_req_ids_dict is None


def test_finish_requests_aborts_from_any_collection_and_frees_blocks():
    sched = create_scheduler(max_num_seqs=1, num_blocks=100)
    running, waiting, skipped = create_requests(3, num_tokens=40)
    skipped.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    for r in (running, waiting, skipped):
        sched.add_request(r)
    step(sched)
    assert running in sched.running and waiting in sched.waiting and skipped in sched.skipped_waiting
    sched.finish_requests([running.request_id, waiting.request_id], RequestStatus.FINISHED_ABORTED)
    sched.finish_requests(skipped.request_id, RequestStatus.FINISHED_ABORTED)
    assert not sched.running and not sched.waiting and not sched.skipped_waiting and not sched.requests
    assert all(r.get_finished_reason().name == "ABORT" for r in (running, waiting, skipped))
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 100
    so = sched.schedule()
    assert {running.request_id, waiting.request_id, skipped.request_id} <= so.finished_req_ids
    assert sched.schedule().finished_req_ids == set()  # covered once


def test_abort_of_an_unknown_or_finished_id_is_a_no_op():
    sched = create_scheduler()
    sched.finish_requests(["nope"], RequestStatus.FINISHED_ABORTED)
    assert sched.get_num_unfinished_requests() == 0 and not sched.has_unfinished_requests()


def test_make_stats_gauges_are_instant_and_counters_are_deltas():
    sched = create_scheduler(block_size=4, num_blocks=2)
    a, b = create_requests(2, num_tokens=4, max_tokens=10, ignore_eos=True)
    c = create_requests(1)[0]
    c.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    for r in (a, b, c):
        sched.add_request(r)
    step(sched)
    so = sched.schedule()
    assert so.preempted_req_ids
    stats = sched.make_stats()
    assert stats.num_running_reqs == 1 and stats.num_waiting_reqs == 1 and stats.num_skipped_waiting_reqs == 1
    assert stats.num_preemptions == 1 and stats.kv_cache_usage == 1.0
    assert stats.prefix_cache_stats.requests == 0  # already counted and reset by the step's stats
    again = sched.make_stats()
    assert again.num_preemptions == 0 and again.num_running_reqs == 1


def test_log_stats_off_returns_no_stats():
    sched = create_scheduler(log_stats=False)
    sched.add_request(create_requests(1)[0])
    _, outs = step(sched)
    assert sched.make_stats() is None and outs[0].scheduler_stats is None
