"""add_request: create vs continue, and the enqueue helper's routing by status."""

from engine_core.request import Request, RequestStatus
from engine_core.sampling_params import SamplingParams

from .utils import create_requests, create_scheduler, step


def test_add_request_does_not_allocate_or_check_capacity():
    sched = create_scheduler(num_blocks=1, max_num_seqs=1)
    for req in create_requests(5, num_tokens=100):
        sched.add_request(req)
    assert len(sched.waiting) == 5 and sched.kv_cache_manager.block_pool.get_num_free_blocks() == 1
    assert not sched.running


def test_enqueue_helper_routes_waiting_for_statuses_to_skipped_waiting():
    sched = create_scheduler()
    plain, grammar, remote, streaming = create_requests(4)
    grammar.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    remote.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    streaming.status = RequestStatus.WAITING_FOR_STREAMING_REQ
    for r in (plain, grammar, remote, streaming):
        sched.add_request(r)
    assert list(sched.waiting) == [plain]
    assert list(sched.skipped_waiting) == [grammar, remote, streaming]
    assert all(r.request_id in sched.requests for r in (plain, grammar, remote, streaming))


def test_structured_output_request_goes_to_skipped_waiting_on_its_first_add():
    sched = create_scheduler()
    req = Request("g", [1, 2, 3], SamplingParams(structured_output={"choice": ["yes", "no"]}))
    sched.add_request(req)
    assert req in sched.skipped_waiting and req not in sched.waiting


def test_resumable_requests_get_a_streaming_queue():
    sched = create_scheduler()
    plain, session = create_requests(2)
    session.resumable = True
    sched.add_request(plain)
    sched.add_request(session)
    assert plain.streaming_queue is None and session.streaming_queue is not None and not session.streaming_queue


def _session(sched, max_tokens=2):
    req = create_requests(1, num_tokens=5, max_tokens=max_tokens, ignore_eos=True, resumable=True)[0]
    sched.add_request(req)
    return req


def _continuation(req, tokens=(11, 12, 13), resumable=True, max_tokens=2):
    return Request(req.request_id, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   resumable=resumable)


def test_live_id_is_a_continuation_queued_while_the_session_is_busy():
    sched = create_scheduler()
    session = _session(sched)
    step(sched)
    sched.add_request(_continuation(session))
    assert len(session.streaming_queue) == 1 and len(sched.requests) == 1
    assert session.status == RequestStatus.RUNNING


def test_session_that_stops_waits_for_streaming_input_with_its_blocks_kept():
    sched = create_scheduler()
    session = _session(sched)
    step(sched)
    _, outputs = step(sched)
    assert outputs[0].outputs[0].finish_reason is not None  # the turn ended
    assert session.status == RequestStatus.WAITING_FOR_STREAMING_REQ
    assert session in sched.skipped_waiting and session not in sched.running
    assert sched.kv_cache_manager.get_num_blocks(session.request_id) > 0
    assert sched.num_waiting_for_streaming_input == 1
    assert session.request_id not in sched.finished_req_ids


def test_update_applied_at_once_when_session_waits_for_streaming_input():
    sched = create_scheduler()
    session = _session(sched)
    step(sched)
    step(sched)
    computed = session.num_computed_tokens
    sched.add_request(_continuation(session, tokens=(21, 22, 23)))
    assert session.status == RequestStatus.WAITING and sched.num_waiting_for_streaming_input == 0
    assert session.all_token_ids[-3:] == [21, 22, 23] and session.num_output_tokens == 0
    so, _ = step(sched)
    # Blocks were kept: only the tokens not yet computed are scheduled.
    assert so.num_scheduled_tokens[session.request_id] == session.num_prompt_tokens - computed


def test_queued_update_is_applied_when_the_turn_stops():
    sched = create_scheduler()
    session = _session(sched)
    step(sched)
    sched.add_request(_continuation(session, tokens=(31, 32)))
    step(sched)
    assert session.status == RequestStatus.WAITING and session in sched.waiting
    assert session.all_token_ids[-2:] == [31, 32]


def test_a_turn_that_a_stop_token_ended_names_it_when_the_next_turn_is_already_queued():
    """The queued continuation resets the session's stop reason when the turn stops; the turn's
    output still carries the stop token that ended it."""
    sched = create_scheduler()
    session = create_requests(1, num_tokens=5, max_tokens=8, stop_token_ids=[99], resumable=True)[0]
    sched.add_request(session)
    step(sched)
    sched.add_request(_continuation(session, tokens=(31, 32)))
    _, outputs = step(sched, token_id=99)
    [output] = outputs[0].outputs
    assert output.finish_reason is not None and output.stop_reason == 99
    assert session.stop_reason is None and session.all_token_ids[-2:] == [31, 32]  # the next turn has begun


def test_non_resumable_repeat_of_an_idle_session_aborts_it():
    sched = create_scheduler()
    session = _session(sched)
    step(sched)
    step(sched)
    sched.add_request(_continuation(session, resumable=False))
    assert session.status == RequestStatus.FINISHED_ABORTED
    assert session.request_id not in sched.requests and session not in sched.skipped_waiting
    assert sched.num_waiting_for_streaming_input == 0
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == sched.cache_config.num_blocks


def test_non_resumable_repeat_of_a_busy_session_ends_it_when_the_turn_stops():
    sched = create_scheduler()
    session = _session(sched)
    step(sched)
    sched.add_request(_continuation(session, resumable=False))
    assert list(session.streaming_queue) == [None]
    step(sched)
    assert session.is_finished() and session.request_id not in sched.requests


def test_a_longrope_session_outgrowing_the_pretrained_length_is_recomputed_whole():
    """Its KV so far was rotated with LongRoPE's short factors, which a prompt past the pretrained
    length (8 here) no longer takes: the continuation starts over, from blocks keyed as long."""
    sched = create_scheduler(block_size=4, long_rope_after=8)
    session = _session(sched)  # 5 prompt tokens + 2 outputs: short
    step(sched)
    step(sched)
    assert session.num_computed_tokens > 0 and sched.kv_cache_manager.get_num_blocks(session.request_id) > 0
    short_first_block = session.block_hashes[0]
    sched.add_request(_continuation(session, tokens=(21, 22, 23)))  # 7 + 3 = 10 > 8
    assert session.num_computed_tokens == 0 and not session.block_hashes
    assert sched.kv_cache_manager.get_num_blocks(session.request_id) == 0
    so, _ = step(sched)
    assert so.num_scheduled_tokens[session.request_id] == session.num_prompt_tokens == 10
    assert session.block_hashes[0] != short_first_block  # (same first 4 tokens, keyed long)
    # A session that stays short keeps its blocks, as any session does.
    kept = create_scheduler(block_size=4, long_rope_after=64)
    other = _session(kept)
    step(kept)
    step(kept)
    computed = other.num_computed_tokens
    kept.add_request(_continuation(other, tokens=(21, 22, 23)))
    assert other.num_computed_tokens == computed


def test_requests_the_admission_loop_sets_aside_keep_their_order_pass_after_pass():
    """Declined requests are prepended onto the pass's local queue, which is prepended whole onto
    skipped_waiting: arrival order survives every pass (it flipped at each one, so the last of
    several blocked requests could be admitted first)."""
    sched = create_scheduler(max_num_seqs=4)
    blocked = create_requests(3)
    for r in blocked:
        r.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
        sched.add_request(r)
    for _ in range(3):
        step(sched)
        assert list(sched.skipped_waiting) == blocked
    for r in blocked:
        r.status = RequestStatus.WAITING  # (their grammars are ready)
    sched.max_num_running_reqs = 1
    step(sched)
    assert list(sched.running) == blocked[:1]  # the first to arrive goes first
