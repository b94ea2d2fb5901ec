"""The prefix cache's recurrent states (--mamba-cache-mode align): which states it keeps, the chunks
the scheduler cuts so that they end on block boundaries, and the copies it asks the workers for."""

from __future__ import annotations

from engine_core.core.recurrent_state_cache import RecurrentStateCache

from .utils import create_requests, create_scheduler, step


def test_a_hit_runs_to_the_last_kept_state_within_the_cached_blocks():
    cache = RecurrentStateCache(4)
    cache.plan_save("r", b"b")
    cache.plan_save("s", b"d")
    assert cache.take_copies() == ({}, {"r": 0, "s": 1}) and len(cache) == 2
    hashes = [b"a", b"b", b"c", b"d", b"e"]
    assert cache.longest_hit(hashes, 5) == 4
    assert cache.longest_hit(hashes, 3) == 2  # (the KV cache holds three blocks: d lies past them)
    assert cache.longest_hit(hashes, 1) == 0
    assert cache.longest_hit([b"x", b"y"], 2) == 0
    # A prefix already kept is not saved again (the state would be the same).
    cache.plan_save("t", b"b")
    assert cache.take_copies() == ({}, {})
    cache.reset()
    assert len(cache) == 0 and cache.longest_hit(hashes, 5) == 0


def test_the_least_recently_used_state_goes_first_but_never_one_this_pass_restores_or_saves():
    cache = RecurrentStateCache(2)
    cache.plan_save("r", b"a")
    cache.plan_save("s", b"b")
    cache.take_copies()
    cache.plan_restore("t", b"a")  # (a is restored this pass: b is the least recently used, and a pinned)
    cache.plan_save("u", b"c")
    assert cache.take_copies() == ({"t": 0}, {"u": 1})
    assert cache.longest_hit([b"b"], 1) == 0 and cache.longest_hit([b"c"], 1) == 1
    # Both slots pinned (one restored, one just saved into): a third save this pass finds none.
    cache.plan_restore("v", b"c")
    cache.plan_save("w", b"d")
    cache.plan_save("x", b"e")
    assert cache.take_copies() == ({"v": 1}, {"w": 0})
    assert cache.longest_hit([b"e"], 1) == 0 and cache.num_saved == 4 and cache.num_restored == 2


def test_an_answers_longer_state_makes_its_earlier_one_the_first_to_go():
    cache = RecurrentStateCache(3)
    cache.plan_save("prompt", b"p")
    cache.plan_save("r", b"g1")
    cache.take_copies()
    # (without superseding, p would be the first to go: the least recently used)
    cache.plan_save("r", b"g2", supersedes=b"g1")
    cache.take_copies()
    cache.plan_save("s", b"q")
    assert cache.take_copies() == ({}, {"s": 1})  # (g1's slot)
    assert cache.longest_hit([b"p"], 1) == 1 and cache.longest_hit([b"g1"], 1) == 0


def test_prefill_chunks_end_on_block_boundaries_and_keep_the_state_there():
    """Block 16, a 100-token prompt, 40 tokens a pass: chunks of 32 (cut back from 40), 32, 32 (the
    prompt's last full block ends one of its own), then the 4-token tail; each chunk's end is kept."""
    scheduler = create_scheduler(max_num_batched_tokens=40, num_recurrent_state_slots=8)
    (request,) = create_requests(1, num_tokens=100, max_tokens=20)
    scheduler.add_request(request)
    chunks, saves = [], []
    for _ in range(4):
        so, _ = step(scheduler)
        chunks.append(so.num_scheduled_tokens[request.request_id])
        saves.append(so.recurrent_state_saves)
        assert so.recurrent_state_restores == {}
    assert chunks == [32, 32, 32, 4]
    rid = request.request_id
    assert saves == [{rid: 0}, {rid: 1}, {rid: 2}, {}]
    # Decodes: the pass reaching token 112 (a block's end) keeps its state.
    kept_at = []
    for _ in range(14):
        so, _ = step(scheduler)
        if so.recurrent_state_saves:
            kept_at.append(request.num_computed_tokens)
    assert kept_at == [112]


def test_a_prompt_seen_again_starts_from_its_kept_state_and_a_longer_kv_hit_is_cut_back():
    scheduler = create_scheduler(max_num_batched_tokens=64, num_recurrent_state_slots=8)
    (first,) = create_requests(1, num_tokens=100, max_tokens=1, same_prompt=True)
    scheduler.add_request(first)
    while scheduler.has_unfinished_requests():
        step(scheduler)
    # The same prompt: its KV blocks (6) and the state at their end (96) are kept.
    (again,) = create_requests(1, num_tokens=100, max_tokens=1, same_prompt=True)
    scheduler.add_request(again)
    so, _ = step(scheduler)
    assert again.num_cached_tokens == 96 and so.num_scheduled_tokens[again.request_id] == 4
    assert so.recurrent_state_restores == {again.request_id: 1}  # (the state saved second: at 96)
    while scheduler.has_unfinished_requests():
        step(scheduler)
    # A prompt sharing the first 90 tokens: the KV cache holds 5 of its blocks (80 tokens), but no state
    # stands at 80 (the first prompt's chunks ended at 64 and 96): it starts at 64.
    (shared,) = create_requests(1, num_tokens=90, max_tokens=1, prefix=list(range(85)), same_prompt=True)
    assert shared.prompt_token_ids[84:] == [84, 0, 1, 2, 3, 4]
    scheduler.add_request(shared)
    so, _ = step(scheduler)
    assert shared.num_cached_tokens == 64 and so.recurrent_state_restores == {shared.request_id: 0}
    # (its chunk runs to 80, its last full block: kept there)
    assert so.num_scheduled_tokens[shared.request_id] == 16 and shared.request_id in so.recurrent_state_saves


def test_without_kept_states_the_scheduler_cuts_nothing_and_asks_for_no_copies():
    scheduler = create_scheduler(max_num_batched_tokens=40)
    (request,) = create_requests(1, num_tokens=100, max_tokens=2)
    scheduler.add_request(request)
    so, _ = step(scheduler)
    assert so.num_scheduled_tokens[request.request_id] == 40
    assert so.recurrent_state_saves == {} and so.recurrent_state_restores == {}
    assert not scheduler.aligns_chunks and scheduler.kv_cache_manager.recurrent_states is None


def test_a_prompt_of_whole_blocks_ends_a_chunk_a_block_before_its_end_so_a_repeat_can_start_there():
    """A repeat always computes its last token: a 48-token prompt (three blocks of 16) may start from 32
    at most, so its first chunk ends there (a state kept at 48 alone would never be hit)."""
    scheduler = create_scheduler(max_num_batched_tokens=64, num_recurrent_state_slots=8)
    (first,) = create_requests(1, num_tokens=48, max_tokens=1, same_prompt=True)
    scheduler.add_request(first)
    chunks = []
    while scheduler.has_unfinished_requests():
        so, _ = step(scheduler)
        chunks.append(so.num_scheduled_tokens[first.request_id])
    assert chunks == [32, 16]
    (again,) = create_requests(1, num_tokens=48, max_tokens=1, same_prompt=True)
    scheduler.add_request(again)
    so, _ = step(scheduler)
    assert again.num_cached_tokens == 32 and so.recurrent_state_restores == {again.request_id: 0}


def test_without_chunked_prefill_prompts_run_whole_and_decodes_keep_the_states():
    scheduler = create_scheduler(max_num_batched_tokens=128, max_model_len=128, enable_chunked_prefill=False,
                                 num_recurrent_state_slots=8)
    (request,) = create_requests(1, num_tokens=100, max_tokens=20)
    scheduler.add_request(request)
    so, _ = step(scheduler)
    assert so.num_scheduled_tokens[request.request_id] == 100 and so.recurrent_state_saves == {}
    kept_at = []
    while scheduler.has_unfinished_requests():
        so, _ = step(scheduler)
        if so.recurrent_state_saves:
            kept_at.append(request.num_computed_tokens)
    assert kept_at == [112]


def _image_prompt_passes(budget: int, image_at: int, image_len: int, num_tokens: int
                         ) -> tuple[list[int], list[dict[str, int]]]:
    """One prompt with an image that must be computed whole (--disable-chunked-mm-input), blocks of 16,
    ``budget`` tokens a pass: each pass's chunk and recurrent-state saves."""
    import dataclasses

    from tests.engine_core.test_scheduler_encoder import prompt_with, request

    scheduler = create_scheduler(max_num_batched_tokens=budget, max_tokens_per_mm_item=image_len, block_size=16,
                                 num_recurrent_state_slots=8)
    scheduler.scheduler_config = dataclasses.replace(scheduler.scheduler_config, disable_chunked_mm_input=True)
    tokens, features = prompt_with([("a", image_at)], num_tokens, length=image_len)
    scheduler.add_request(request("r", tokens, features, max_tokens=1))
    chunks, saves = [], []
    while scheduler.has_unfinished_requests():
        so, _ = step(scheduler)
        chunks.append(so.num_scheduled_tokens["r"])
        saves.append(so.recurrent_state_saves)
    return chunks, saves


def test_a_chunk_is_not_cut_inside_an_image_that_must_be_computed_whole():
    """A 40-token image at 10..50, 50 tokens a pass. Cut to the block boundary at 48 the first chunk
    would end inside the image, and then stop before it (and every later chunk with it); there is no
    boundary before the image to go back to: it runs to 50 uncut (no state kept there); the next is cut
    at 96 as usual."""
    assert _image_prompt_passes(50, 10, 40, 100) == ([50, 46, 4], [{}, {"r": 0}, {}])


def test_where_a_prompt_leaves_a_shared_prefix_the_kv_cache_holds_a_chunk_ends_so_the_next_starts_there():
    """Prompts that share their first 70 tokens (a system prompt), 48 tokens a pass, blocks of 16. The
    first keeps states at 48 and 96 (its chunk ends). The second finds four blocks (64 tokens) in the KV
    cache but a state at 48 only: it starts at 48 and its chunk ends at 64, where the shared blocks end,
    keeping the state there; the third starts at 64."""
    scheduler = create_scheduler(max_num_batched_tokens=48, num_recurrent_state_slots=8)
    shared = list(range(70))
    prompts = [shared + [1000 * (k + 1) + j for j in range(30)] for k in range(3)]
    starts, first_chunks = [], []
    for prompt in prompts:
        (request,) = create_requests(1, num_tokens=100, max_tokens=1, prefix=prompt)
        scheduler.add_request(request)
        so, _ = step(scheduler)
        starts.append(request.num_cached_tokens)
        first_chunks.append(so.num_scheduled_tokens[request.request_id])
        while scheduler.has_unfinished_requests():
            step(scheduler)
    assert starts == [0, 48, 64] and first_chunks == [48, 16, 32]
    assert scheduler.kv_cache_manager.state_junctions == {}


def test_a_cut_inside_an_image_that_must_be_computed_whole_goes_back_to_the_boundary_before_it():
    """An image at 90..110 of a 130-token prompt, 100 tokens a pass: the cut at 96 would end inside the
    image; it goes back to 80, the boundary before it (a state kept there)."""
    assert _image_prompt_passes(100, 90, 20, 130) == ([80, 48, 2], [{"r": 0}, {"r": 1}, {}])
