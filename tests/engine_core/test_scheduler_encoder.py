"""The scheduler's encoder inputs (images of vision-language prompts): the per-pass encoder budget,
the encoder cache's holds and evictions, chunks that stop before an image, preemption, and the
images' identifiers in the prefix cache's block keys. A real Scheduler; the model is faked."""

from __future__ import annotations

import dataclasses

from engine_core.multimodal import MultiModalFeature, TensorData
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from tests.engine_core.utils import create_scheduler, fake_model_output, step

IMAGE = 999  # the placeholder token id
PIXELS = TensorData("float32", (1,), b"\0\0\0\0")


def image(identifier: str, offset: int, length: int = 16) -> MultiModalFeature:
    return MultiModalFeature("image", identifier, offset, length, PIXELS)


def prompt_with(images: list[tuple[str, int]], num_tokens: int, length: int = 16, text: int = 1) -> tuple[
        list[int], list[MultiModalFeature]]:
    """A prompt of ``num_tokens`` tokens (``text``-based ids) with images at the given offsets."""
    tokens = [text * 100 + i for i in range(num_tokens)]
    features = []
    for identifier, offset in images:
        tokens[offset:offset + length] = [IMAGE] * length
        features.append(image(identifier, offset, length))
    return tokens, features


def request(req_id: str, tokens: list[int], features: list[MultiModalFeature], max_tokens: int = 4,
            priority: int = 0) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=max_tokens), eos_token_id=0, priority=priority,
                   mm_features=features)


def test_an_image_is_encoded_in_the_pass_its_placeholders_are_first_scheduled():
    scheduler = create_scheduler(max_num_batched_tokens=8, max_tokens_per_mm_item=16, block_size=4)
    assert scheduler.max_num_encoder_input_tokens == 16  # (an image larger than the budget still fits)
    tokens, features = prompt_with([("a", 4)], 24)
    scheduler.add_request(request("r", tokens, features))
    so, _ = step(scheduler)
    assert so.num_scheduled_tokens == {"r": 8}  # tokens 0..7 reach the image at 4
    assert so.scheduled_encoder_inputs == {"r": [0]}
    so, _ = step(scheduler)  # 8..15: inside the image, encoded already
    assert so.num_scheduled_tokens == {"r": 8} and so.scheduled_encoder_inputs == {}
    so, _ = step(scheduler)
    assert so.num_scheduled_tokens == {"r": 8} and so.scheduled_encoder_inputs == {}
    # Its placeholders are all computed: the hold is gone, the rows stay cached (freeable).
    assert scheduler.encoder_cache_manager.cached == {"a": set()}
    # (One image encoded; the later chunks inside it are no hit of the encoder cache.)
    assert (scheduler.num_images_encoded, scheduler.num_images_found_encoded) == (1, 0)
    assert list(scheduler.encoder_cache_manager.freeable) == ["a"]


def test_a_chunk_stops_before_an_image_the_encoder_budget_cannot_take():
    # Five images of 16 rows: four fit a pass's encoder budget of 64, the fifth must wait.
    tokens, features = prompt_with([(f"img{i}", 2 + 20 * i) for i in range(5)], 110)
    scheduler = create_scheduler(max_num_batched_tokens=200, max_tokens_per_mm_item=16)
    assert scheduler.max_num_encoder_input_tokens == 200 == scheduler.encoder_cache_manager.cache_size
    scheduler.max_num_encoder_input_tokens = 64
    scheduler.add_request(request("r", tokens, features))
    so, _ = step(scheduler)
    assert so.scheduled_encoder_inputs == {"r": [0, 1, 2, 3]}
    assert so.num_scheduled_tokens == {"r": 82}  # up to the fifth image's first placeholder
    so, _ = step(scheduler)
    assert so.scheduled_encoder_inputs == {"r": [4]} and so.num_scheduled_tokens == {"r": 110 - 82}


def test_a_second_request_waits_when_the_pass_budget_is_spent_and_a_chunk_inside_an_image_gets_none():
    scheduler = create_scheduler(max_num_batched_tokens=64, max_tokens_per_mm_item=16, block_size=4)
    scheduler.max_num_encoder_input_tokens = 16  # (one image per pass)
    a_tokens, a_features = prompt_with([("a", 0)], 20, text=1)
    b_tokens, b_features = prompt_with([("b", 0)], 20, text=2)
    scheduler.add_request(request("a", a_tokens, a_features))
    scheduler.add_request(request("b", b_tokens, b_features))
    so, _ = step(scheduler)
    # b's prompt starts with its image: nothing of it can run this pass, and admission stops there.
    assert so.num_scheduled_tokens == {"a": 20} and so.scheduled_encoder_inputs == {"a": [0]}
    assert [r.request_id for r in scheduler.waiting] == ["b"]
    so, _ = step(scheduler)
    assert so.num_scheduled_tokens == {"a": 1, "b": 20} and so.scheduled_encoder_inputs == {"b": [0]}


def test_the_same_image_in_another_prompt_is_not_encoded_again():
    scheduler = create_scheduler(max_tokens_per_mm_item=16, block_size=4)
    first, features = prompt_with([("cat", 2)], 24, text=1)
    scheduler.add_request(request("one", first, features))
    so, _ = step(scheduler)
    assert so.scheduled_encoder_inputs == {"one": [0]}
    # Another prompt (other text first: no prefix hit) with the same image: cached, not re-encoded.
    second, features = prompt_with([("cat", 6)], 30, text=3)
    scheduler.add_request(request("two", second, features))
    so, _ = step(scheduler)
    assert so.num_scheduled_tokens["two"] == 30 and so.scheduled_encoder_inputs == {}
    assert scheduler.encoder_cache_manager.cached == {"cat": set()}  # (both chunks done: freeable)
    assert (scheduler.num_images_encoded, scheduler.num_images_found_encoded) == (1, 1)


def test_a_full_cache_evicts_freeable_images_oldest_first_and_tells_the_workers():
    scheduler = create_scheduler(max_num_batched_tokens=32, max_tokens_per_mm_item=16, block_size=4)
    assert scheduler.encoder_cache_manager.cache_size == 32  # (two images)
    for name, text in (("a", 1), ("b", 2)):
        tokens, features = prompt_with([(name, 0)], 16, text=text)
        scheduler.add_request(request(name, tokens, features, max_tokens=1))
        so, _ = step(scheduler)
        assert so.scheduled_encoder_inputs == {name: [0]} and so.free_encoder_mm_hashes == []
    tokens, features = prompt_with([("c", 0)], 16, text=3)
    scheduler.add_request(request("c", tokens, features, max_tokens=1))
    so, _ = step(scheduler)
    assert so.scheduled_encoder_inputs == {"c": [0]} and so.free_encoder_mm_hashes == ["a"]
    manager = scheduler.encoder_cache_manager
    assert set(manager.cached) == {"b", "c"} and manager.num_free_slots == 0
    # A prefix-cache reset (new weights may follow) evicts what nobody holds, and tells the workers.
    assert scheduler.reset_prefix_cache()
    assert manager.cached == {} and manager.num_free_slots == 32
    assert scheduler.schedule().free_encoder_mm_hashes == ["b", "c"]


def test_a_held_image_is_never_evicted_and_a_chunk_needing_room_waits():
    scheduler = create_scheduler(max_num_batched_tokens=16, max_tokens_per_mm_item=16, block_size=4)
    assert scheduler.encoder_cache_manager.cache_size == 16  # (one image)
    # A long prompt's image is held while its placeholders are computed over two passes.
    a_tokens, a_features = prompt_with([("a", 8)], 40, text=1)
    b_tokens, b_features = prompt_with([("b", 0)], 16, text=2)
    scheduler.add_request(request("a", a_tokens, a_features))
    so, _ = step(scheduler)
    assert so.num_scheduled_tokens == {"a": 16} and so.scheduled_encoder_inputs == {"a": [0]}
    scheduler.add_request(request("b", b_tokens, b_features))
    so, _ = step(scheduler)  # a's image is half computed: still held, so b's image has no room
    assert so.num_scheduled_tokens == {"a": 16} and so.scheduled_encoder_inputs == {}
    so, _ = step(scheduler)  # a's image is in its KV now (freeable): b's evicts it
    assert so.scheduled_encoder_inputs == {"b": [0]} and so.free_encoder_mm_hashes == ["a"]


def test_preemption_and_finishing_release_the_holds():
    scheduler = create_scheduler(max_num_batched_tokens=8, max_tokens_per_mm_item=16, block_size=4)
    tokens, features = prompt_with([("a", 4)], 24)
    scheduler.add_request(request("r", tokens, features))
    so = scheduler.schedule()
    assert scheduler.encoder_cache_manager.cached == {"a": {"r"}}
    running = scheduler.running.pop()
    scheduler._preempt_request(running, 0.0)
    assert scheduler.encoder_cache_manager.cached == {"a": set()}  # (freeable: it was encoded)
    scheduler.update_from_output(so, fake_model_output(scheduler, so))
    # Readmitted from the start: its image is cached still, so the chunk runs without encoding it.
    so, _ = step(scheduler)
    assert so.num_scheduled_tokens == {"r": 8} and so.scheduled_encoder_inputs == {}
    assert scheduler.encoder_cache_manager.cached == {"a": {"r"}}
    scheduler.finish_requests(["r"], scheduler.requests["r"].status.__class__.FINISHED_ABORTED)
    assert scheduler.encoder_cache_manager.cached == {"a": set()}


def test_a_victim_scheduled_earlier_in_the_pass_gives_its_image_back():
    """Priority preemption of a request scheduled earlier in the same pass: the image it was to
    encode is forgotten (nobody may find it cached) and the cache's room comes back."""
    scheduler = create_scheduler(max_num_batched_tokens=64, max_tokens_per_mm_item=16, block_size=4,
                                 long_prefill_token_threshold=2, policy="priority")
    high = Request("high", [5] * 9, SamplingParams(max_tokens=20), eos_token_id=0, priority=0)
    scheduler.add_request(high)
    step(scheduler)  # high's prompt: 9 tokens... in 2-token chunks
    while high.num_computed_tokens < 9:
        step(scheduler)
    low_tokens, low_features = prompt_with([("low", 6)], 40, text=1)
    low = request("low", low_tokens, low_features, priority=5)
    scheduler.add_request(low)
    while low.num_computed_tokens < 6:  # low's chunks before its image; high decodes beside them
        so, _ = step(scheduler)
        assert so.scheduled_encoder_inputs == {}
    # Next pass: low (first in running) reaches its image inside the blocks it holds; high's next
    # token needs a new block, and the pool has none: low, the worse priority, is preempted.
    assert high.num_computed_tokens % 4 == 0, "high must need a new block in the next pass"
    scheduler.running.sort(key=lambda r: r is not low)
    pool = scheduler.kv_cache_manager.block_pool
    grabbed = pool.get_new_blocks(pool.get_num_free_blocks())
    so = scheduler.schedule()
    assert so.preempted_req_ids == {"low"} and so.num_scheduled_tokens == {"high": 1}
    assert so.scheduled_encoder_inputs == {}
    manager = scheduler.encoder_cache_manager
    assert "low" not in manager.cached
    assert manager.num_free_slots == manager.num_freeable_slots == manager.cache_size
    pool.free_blocks(grabbed)


def test_images_key_the_blocks_they_reach_into():
    """Equal token ids (placeholders), different images: no prefix-cache hit past the image's
    first block; the same image: a hit."""
    scheduler = create_scheduler(max_tokens_per_mm_item=16, block_size=4)
    tokens, features = prompt_with([("a", 8)], 32)
    scheduler.add_request(request("first", tokens, features, max_tokens=1))
    step(scheduler)
    step(scheduler)
    tokens_b, features_b = prompt_with([("b", 8)], 32)
    assert tokens_b == tokens
    other = request("other-image", tokens_b, features_b, max_tokens=1)
    scheduler.add_request(other)
    so, _ = step(scheduler)
    assert other.num_cached_tokens == 8  # (the two blocks before the image)
    assert so.scheduled_encoder_inputs == {"other-image": [0]}
    same = request("same-image", tokens, features, max_tokens=1)
    scheduler.add_request(same)
    so, _ = step(scheduler)
    assert same.num_cached_tokens == 28  # (every full block: the last token is always computed)
    assert so.scheduled_encoder_inputs == {}  # (its placeholders are all in the cached blocks)


def _fill_pool_but(scheduler, free: int) -> None:
    pool = scheduler.kv_cache_manager.block_pool
    pool.get_new_blocks(pool.get_num_free_blocks() - free)


def test_an_image_whose_reserver_is_preempted_is_encoded_by_the_request_that_found_it_reserved():
    """A (worse priority) reserves image X; B, later in the same pass, finds X reserved and also
    reserves its own Y; B's blocks preempt A. B must encode both (X was A's to encode)."""
    scheduler = create_scheduler(max_num_batched_tokens=64, max_tokens_per_mm_item=16, block_size=4,
                                 long_prefill_token_threshold=20, policy="priority", num_blocks=64)
    a_tokens, a_features = prompt_with([("X", 20)], 40, text=1)
    b_tokens, b_features = prompt_with([("X", 20), ("Y", 36)], 56, text=2)
    low, high = request("A", a_tokens, a_features, priority=5), request("B", b_tokens, b_features, priority=0)
    scheduler.add_request(low)
    scheduler.add_request(high)
    step(scheduler)  # both prefill their first 20 tokens (text only)
    scheduler.running.sort(key=lambda r: r is not low)  # (A first in the running loop)
    _fill_pool_but(scheduler, 5)
    so = scheduler.schedule()
    assert so.preempted_req_ids == {"A"} and so.num_scheduled_tokens == {"B": 20}
    assert so.scheduled_encoder_inputs == {"B": [0, 1]}
    manager = scheduler.encoder_cache_manager
    assert set(manager.cached) == {"X", "Y"}
    assert manager.num_free_slots == manager.cache_size - 32


def test_an_image_whose_requests_are_all_preempted_in_the_pass_is_forgotten():
    """A reserves X, B finds it reserved, then B's own blocks preempt A and then B itself: nobody
    encodes X this pass, so nothing may find it cached."""
    scheduler = create_scheduler(max_num_batched_tokens=64, max_tokens_per_mm_item=16, block_size=4,
                                 long_prefill_token_threshold=4, policy="priority", num_blocks=64)
    a_tokens, a_features = prompt_with([("X", 4)], 21, text=1)
    b_tokens, b_features = prompt_with([("X", 40)], 60, text=2)
    low, high = request("A", a_tokens, a_features, priority=5), request("B", b_tokens, b_features, priority=0)
    scheduler.add_request(low)
    scheduler.add_request(high)
    step(scheduler)
    scheduler.scheduler_config = dataclasses.replace(scheduler.scheduler_config, long_prefill_token_threshold=0)
    scheduler.running.sort(key=lambda r: r is not low)
    _fill_pool_but(scheduler, 5)
    so = scheduler.schedule()
    assert so.preempted_req_ids == {"A", "B"} and so.num_scheduled_tokens == {}
    assert so.scheduled_encoder_inputs == {}
    manager = scheduler.encoder_cache_manager
    assert manager.cached == {} and manager.num_free_slots == manager.num_freeable_slots == manager.cache_size


def test_disable_chunked_mm_input_never_ends_a_chunk_inside_an_image():
    """vLLM's --disable-chunked-mm-input: a chunk that would end inside an image stops before it;
    the next chunk starts at the image and takes it whole."""
    tokens, features = prompt_with([("a", 6)], 30)
    for whole, first in ((False, 10), (True, 6)):
        scheduler = create_scheduler(max_num_batched_tokens=64, max_tokens_per_mm_item=16, block_size=4,
                                     long_prefill_token_threshold=10)
        if whole:
            scheduler.scheduler_config = dataclasses.replace(scheduler.scheduler_config,
                                                             disable_chunked_mm_input=True)
        scheduler.add_request(request("r", tokens, features))
        so, _ = step(scheduler)
        assert so.num_scheduled_tokens == {"r": first}
        assert so.scheduled_encoder_inputs == ({} if whole else {"r": [0]})
    # (An image larger than a chunk still splits: it starts a chunk, which takes what it can.)
    so, _ = step(scheduler)
    assert so.num_scheduled_tokens == {"r": 10} and so.scheduled_encoder_inputs == {"r": [0]}


def test_an_image_a_prefix_hit_ends_inside_is_found_encoded():
    """The same image at the prompt's start, another question after it: the second prompt's prefix
    hit ends inside the image (its last block is not full), whose rows are found in the encoder
    cache (counted as found, not encoded again). With --disable-chunked-mm-input a cached image may
    still be split, as in vLLM (nothing is left to encode)."""
    first_tokens, features = prompt_with([("cat", 2)], 24, text=1)  # (the image at 2..17)
    scheduler = create_scheduler(max_tokens_per_mm_item=16, block_size=4)
    scheduler.add_request(request("one", first_tokens, features, max_tokens=1))
    step(scheduler)
    second = request("two", first_tokens[:18] + [777 + i for i in range(10)], features)
    scheduler.add_request(second)
    so, _ = step(scheduler)
    assert second.num_cached_tokens == 16 and so.scheduled_encoder_inputs == {}
    assert (scheduler.num_images_encoded, scheduler.num_images_found_encoded) == (1, 1)
    whole = create_scheduler(max_tokens_per_mm_item=16, block_size=4, long_prefill_token_threshold=8)
    whole.scheduler_config = dataclasses.replace(whole.scheduler_config, disable_chunked_mm_input=True)
    whole.add_request(request("one", first_tokens, features, max_tokens=1))
    while whole.requests:
        step(whole)
    whole.add_request(request("three", [5] + first_tokens[1:], features, max_tokens=1))  # (no prefix hit)
    so, _ = step(whole)
    assert so.num_scheduled_tokens == {"three": 8} and so.scheduled_encoder_inputs == {}  # (split: cached)
