"""The allocate-or-preempt branch of the running loop."""

from engine_core.request import RequestStatus

from .utils import create_requests, create_scheduler, fake_model_output, step


def _fill(sched, n, num_tokens, **kw):
    reqs = create_requests(n, num_tokens=num_tokens, ignore_eos=True, **kw)
    for r in reqs:
        sched.add_request(r)
    return reqs


def test_fcfs_victim_is_the_last_of_running_and_goes_to_the_front_of_waiting():
    # Two requests of exactly one block each; the pool holds two blocks.
    sched = create_scheduler(block_size=4, num_blocks=2)
    a, b = _fill(sched, 2, num_tokens=4, max_tokens=10)
    waiting_c = _fill(sched, 1, num_tokens=2, max_tokens=10)[0]
    step(sched)  # a, b prefilled and each sampled a token: both need a second block now
    assert waiting_c in sched.waiting
    so = sched.schedule()
    # a needs a block, none free: the victim is running.pop() == b (most recently admitted).
    assert so.preempted_req_ids == {b.request_id}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert sched.waiting.peek_request() is b  # prepended, ahead of c
    assert so.num_scheduled_tokens == {a.request_id: 1}
    sched.kv_cache_manager.block_pool.check_integrity()


def test_one_preemption_cancels_every_admission_that_pass():
    sched = create_scheduler(block_size=4, num_blocks=3)
    _a, b = _fill(sched, 2, num_tokens=4, max_tokens=10)
    step(sched)
    c = _fill(sched, 1, num_tokens=1, max_tokens=10)[0]
    so = sched.schedule()
    # a preempted b; a free block remains after b's release, budget remains, yet c is not admitted.
    assert so.preempted_req_ids == {b.request_id}
    assert c not in sched.running and c.request_id not in so.num_scheduled_tokens
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() >= 1


def test_retry_loop_preempts_until_allocation_succeeds():
    sched = create_scheduler(block_size=4, num_blocks=6, max_num_batched_tokens=100)
    # Prompts of 3 tokens: after one output each request still fits in its one block.
    big = _fill(sched, 1, num_tokens=3, max_tokens=30)[0]
    smalls = _fill(sched, 5, num_tokens=3, max_tokens=30)
    step(sched)
    assert len(sched.running) == 6
    for _ in range(5):
        big.append_output_token_ids(5)  # big now holds 9 tokens: 3 blocks, 2 more than it has
    so = sched.schedule()
    assert so.preempted_req_ids == {smalls[-1].request_id, smalls[-2].request_id}
    assert big.request_id in so.num_scheduled_tokens


def test_self_eviction_breaks_the_running_loop():
    sched = create_scheduler(block_size=4, num_blocks=2)
    a, b = _fill(sched, 2, num_tokens=4, max_tokens=10)
    step(sched)
    sched.running.reverse()  # now b runs first and a is last
    so = sched.schedule()
    # b preempts a (the last), then a... b gets a's block; a evicted. Next: a never reached.
    assert so.preempted_req_ids == {a.request_id} and so.num_scheduled_tokens == {b.request_id: 1}
    # Now only b runs with both blocks; make b need a third block: it can only evict itself.
    for _ in range(4):
        b.append_output_token_ids(1)
    so = sched.schedule()
    assert so.preempted_req_ids == {b.request_id} and not so.num_scheduled_tokens
    assert not sched.running and b.status == RequestStatus.PREEMPTED


def test_priority_victim_is_the_worst_priority_even_when_that_is_the_request_itself():
    sched = create_scheduler(block_size=4, num_blocks=3, policy="priority", max_num_batched_tokens=100)
    low = _fill(sched, 1, num_tokens=4, max_tokens=10, priority=5)[0]
    mid = _fill(sched, 1, num_tokens=4, max_tokens=10, priority=1)[0]
    high = _fill(sched, 1, num_tokens=4, max_tokens=10, priority=0)[0]
    step(sched)
    # The pool is full and every request needs a second block. Walk low first.
    sched.running = [low, high, mid]
    so = sched.schedule()
    # max(priority, arrival) is low itself: self-eviction breaks the running loop for this pass.
    assert so.preempted_req_ids == {low.request_id} and not so.num_scheduled_tokens
    assert low.status == RequestStatus.PREEMPTED and sched.running == [high, mid]
    # Next pass, low's freed block lets high grow; mid then needs one and there is none.
    so = sched.schedule()
    assert high.request_id in so.num_scheduled_tokens
    sched.kv_cache_manager.block_pool.check_integrity()


def test_priority_undo_returns_tokens_and_steps_req_index_back():
    # Pool: 4 blocks of 4. low holds 1 block and can grow into the free block; high and mid need new blocks.
    sched = create_scheduler(block_size=4, num_blocks=4, policy="priority", max_num_batched_tokens=100)
    low = _fill(sched, 1, num_tokens=4, max_tokens=10, priority=9)[0]
    high = _fill(sched, 1, num_tokens=4, max_tokens=10, priority=0)[0]
    mid = _fill(sched, 1, num_tokens=4, max_tokens=10, priority=1)[0]
    step(sched)
    sched.running = [low, high, mid]
    so = sched.schedule()
    # low took the free block first; high then found none and preempted low (already scheduled):
    # low's token went back to the budget and the walk stepped back so mid was not skipped.
    assert so.preempted_req_ids == {low.request_id}
    assert so.num_scheduled_tokens == {high.request_id: 1, mid.request_id: 1}
    assert so.total_num_scheduled_tokens == 2
    assert low.request_id not in so.scheduled_cached_reqs.req_ids
    sched.kv_cache_manager.block_pool.check_integrity()


def test_priority_undo_drops_blocks_cached_for_tokens_that_will_not_be_computed():
    sched = create_scheduler(block_size=4, num_blocks=3, policy="priority", max_num_batched_tokens=100,
                             long_prefill_token_threshold=4)
    high = _fill(sched, 1, num_tokens=4, max_tokens=10, priority=0)[0]
    low = _fill(sched, 1, num_tokens=8, max_tokens=10, priority=9)[0]
    step(sched)  # high prefilled (1 block), low's first chunk of 4 (1 block)
    sched.running = [low, high]
    so = sched.schedule()
    # low's second chunk filled (and cached) a new block, then high preempted low.
    assert so.preempted_req_ids == {low.request_id} and so.num_scheduled_tokens == {high.request_id: 1}
    probe = create_requests(1, num_tokens=9, prefix=low.prompt_token_ids)[0]
    _, num_hit = sched.kv_cache_manager.get_computed_blocks(probe)
    assert num_hit == 4  # only the block that was really computed is a hit
    sched.kv_cache_manager.block_pool.check_integrity()


def test_resumed_request_travels_in_cached_reqs_with_all_its_tokens():
    sched = create_scheduler(block_size=4, num_blocks=2)
    _a, b = _fill(sched, 2, num_tokens=4, max_tokens=10)
    step(sched)
    so = sched.schedule()
    assert so.preempted_req_ids == {b.request_id}
    sched.update_from_output(so, fake_model_output(sched, so))
    # a finishes eventually; then b is readmitted as resumed.
    resumed_seen = False
    while sched.has_unfinished_requests() and not resumed_seen:
        so = sched.schedule()
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid == b.request_id and cached.resumed_from_preemption[i]:
                resumed_seen = True
                assert cached.new_token_ids[i] == b.all_token_ids
                assert cached.new_block_ids[i] == sched.kv_cache_manager.get_block_ids(b.request_id)
        sched.update_from_output(so, fake_model_output(sched, so))
    assert resumed_seen


def test_preempted_request_finishes_with_all_its_tokens():
    sched = create_scheduler(block_size=4, num_blocks=4, max_num_batched_tokens=64)
    reqs = _fill(sched, 4, num_tokens=6, max_tokens=6)
    while sched.has_unfinished_requests():
        step(sched)
        sched.kv_cache_manager.block_pool.check_integrity()
    assert sum(r.num_preemptions for r in reqs) > 0
    assert all(r.num_output_tokens == 6 for r in reqs)
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 4
