"""Prefill/decode disaggregation: the connector's config, the scheduler's two halves (holding a
prefill's blocks, parking a decode until its KV is read) and two real engines handing a prompt on."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import pytest
import torch

from engine_core.kv_transfer import KVConnector, KVTransferConfig, kv_digest
from engine_core.outputs import EngineCoreRequest
from engine_core.request import RequestStatus
from engine_core.sampling_params import SamplingParams

from .utils import create_requests, create_scheduler, step


def test_config_takes_vllms_json_and_refuses_what_is_not_built():
    config = KVTransferConfig.from_dict('{"kv_connector": "NixlConnector", "kv_role": "kv_both", '
                                        '"kv_buffer_device": "cuda", '
                                        '"kv_connector_extra_config": {"abort_request_timeout": 30}}')
    assert config is not None and config.is_producer and config.is_consumer and config.abort_request_timeout_s == 30
    assert config.load_timeout_s == 120
    producer = KVTransferConfig.from_dict({"kv_role": "kv_producer"})
    assert producer is not None and producer.is_producer and not producer.is_consumer
    assert producer.kv_connector == "RayKVConnector" and producer.kv_load_failure_policy == "recompute"
    assert KVTransferConfig.from_dict(None) is None
    for bad, message in (({"kv_role": "kv_sender"}, "kv_role must be one of"),
                         ({"kv_role": "kv_both", "kv_connector": "LMCacheConnectorV1"}, "is not built here"),
                         ({"kv_connector": "NixlConnector"}, "kv_role is required"),
                         ({"kv_role": "kv_both", "kv_load_failure_policy": "retry"}, "kv_load_failure_policy"),
                         ({"kv_role": "kv_both", "kv_connector_extra_config": {"backends": ["UCX"]}},
                          "not taken here"),
                         ({"kv_role": "kv_both", "kv_connector_extra_config": {"abort_request_timeout": 0}},
                          "abort_request_timeout"),
                         ({"kv_role": "kv_both", "kv_connector_extra_config": {"load_timeout": "1"}},
                          "load_timeout"),
                         ({"kv_role": "kv_both", "kv_rule": 1}, "not taken"),
                         ("{nope", "not JSON")):
        with pytest.raises(ValueError, match=message):
            KVTransferConfig.from_dict(bad)


def _connector(scheduler, role: str, clock=time.monotonic, timeout: float = 480.0) -> KVConnector:
    connector = KVConnector(KVTransferConfig(kv_role=role, abort_request_timeout_s=timeout),  # type: ignore[arg-type]
                            scheduler.block_size, {"remote_engine_id": "engine-0", "tp_size": 1}, clock)
    scheduler.connector = connector
    return connector


def test_a_prefill_for_a_remote_decode_keeps_its_blocks_until_read_or_expired():
    now = [100.0]
    sched = create_scheduler(num_blocks=20, block_size=16)
    connector = _connector(sched, "kv_producer", clock=lambda: now[0], timeout=30.0)
    pool = sched.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    (prefill,) = create_requests(1, num_tokens=40, max_tokens=1)
    prefill.kv_transfer_params = {"do_remote_decode": True}
    (plain,) = create_requests(1, num_tokens=40, max_tokens=1)
    sched.add_request(prefill)
    sched.add_request(plain)
    _, outputs = step(sched)
    by_id = {o.request_id: o for eco in outputs.values() for o in eco.outputs}
    params = by_id[prefill.request_id].kv_transfer_params
    block_ids = params["remote_block_ids"]
    assert params["do_remote_prefill"] and not params["do_remote_decode"] and len(block_ids) == 3
    assert params["remote_request_id"] == prefill.request_id and params["remote_engine_id"] == "engine-0"
    assert by_id[plain.request_id].kv_transfer_params is None  # (nobody asked it to hand its KV on)
    # The prefill's three blocks stay held (the plain request's went back); the request itself is done.
    assert pool.get_num_free_blocks() == free_before - 3 and prefill.request_id not in sched.requests
    nonce = params["remote_nonce"]
    digest = kv_digest(prefill.prompt_token_ids[:39], None)
    assert connector.held_blocks(prefill.request_id, nonce, block_ids, 0, digest, 39)
    assert connector.held_blocks(prefill.request_id, nonce, block_ids[1:], 1, digest, 39)
    # Without the nonce the parameters carry, nothing is held for the reader (a request id is not enough).
    assert not connector.held_blocks(prefill.request_id, "guess", block_ids, 0, digest, 39)
    assert connector.release(prefill.request_id, "guess") is None and connector.is_held(prefill.request_id)
    # Another prompt's reader, or blocks out of their order, are refused (a client's parameters cannot
    # bring other KV into a prefix cache).
    with pytest.raises(ValueError, match="computed another prompt"):
        connector.held_blocks(prefill.request_id, nonce, block_ids, 0, kv_digest([1] * 39, None), 39)
    for blocks, first in (([block_ids[1], block_ids[0], block_ids[2]], 0), ([block_ids[0]] * 3, 0),
                          (block_ids[:2], 1)):
        with pytest.raises(ValueError, match="not request"):
            connector.held_blocks(prefill.request_id, nonce, blocks, first, digest, 39)
    # Read: released.
    released = connector.release(prefill.request_id, nonce)
    sched.kv_cache_manager.free(released)
    assert pool.get_num_free_blocks() == free_before and connector.release(prefill.request_id, nonce) is None
    # Never read: freed at the deadline, not before.
    (other,) = create_requests(1, num_tokens=20, max_tokens=1)
    other.kv_transfer_params = {"do_remote_decode": True}
    sched.add_request(other)
    step(sched)
    now[0] += 29.0
    assert connector.expired() == []
    now[0] += 2.0
    (gone,) = connector.expired()
    assert gone.request_id == other.request_id and connector.num_held_requests == 0


def test_an_aborted_or_stopped_prefill_holds_nothing():
    sched = create_scheduler(num_blocks=20, block_size=16)
    connector = _connector(sched, "kv_both")
    pool = sched.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    aborted, stopped = create_requests(2, num_tokens=40, max_tokens=4)
    for request in (aborted, stopped):
        request.kv_transfer_params = {"do_remote_decode": True}
        sched.add_request(request)
    sched.schedule()
    sched.finish_requests(aborted.request_id, RequestStatus.FINISHED_ABORTED)
    sched.finish_requests(stopped.request_id, RequestStatus.FINISHED_STOPPED)
    assert connector.num_held_requests == 0 and pool.get_num_free_blocks() == free_before


def test_a_decode_waits_for_its_kv_then_computes_only_the_last_prompt_token():
    sched = create_scheduler(num_blocks=20, block_size=16)
    connector = _connector(sched, "kv_consumer")
    # A local prefix hit of one block: only the blocks after it are read.
    (warm,) = create_requests(1, num_tokens=40, max_tokens=1, same_prompt=True)
    sched.add_request(warm)
    step(sched)
    (decode,) = create_requests(1, num_tokens=40, max_tokens=3, same_prompt=True)
    decode.kv_transfer_params = {"do_remote_prefill": True, "remote_engine_id": "engine-9",
                                 "remote_request_id": "p-1", "remote_block_ids": [11, 12, 13]}
    sched.add_request(decode)
    out, _ = step(sched)
    assert out.total_num_scheduled_tokens == 0 and decode.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # The prompt's first two blocks are in the local cache (warm's): only the third is read.
    (load,) = connector.take_pending_loads()
    own_blocks = sched.kv_cache_manager.get_block_ids(decode.request_id)
    assert load.remote_block_ids == [13] and load.block_ids == own_blocks[2:3] and len(own_blocks) == 3
    assert decode.num_computed_tokens == 39 and decode.kv_transfer_params is None
    assert load.num_tokens == 39 and load.digest == kv_digest(decode.prompt_token_ids[:39], None)
    # Still waiting: nothing runs, the blocks stay.
    out, _ = step(sched)
    assert out.total_num_scheduled_tokens == 0
    sched.on_remote_kvs_ready(decode.request_id)
    out, outputs = step(sched)
    assert out.num_scheduled_tokens == {decode.request_id: 1}
    (first,) = [o for eco in outputs.values() for o in eco.outputs]
    assert first.new_token_ids == [7] and first.num_cached_tokens == 39
    assert decode.num_external_computed_tokens == 7


def test_a_failed_read_makes_the_decode_engine_compute_the_prompt_itself():
    sched = create_scheduler(num_blocks=20, block_size=16)
    connector = _connector(sched, "kv_consumer")
    pool = sched.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    (decode,) = create_requests(1, num_tokens=40, max_tokens=2)
    decode.kv_transfer_params = {"do_remote_prefill": True, "remote_request_id": "p-1",
                                 "remote_block_ids": [1, 2, 3]}
    sched.add_request(decode)
    step(sched)
    assert len(connector.take_pending_loads()) == 1 and pool.get_num_free_blocks() == free_before - 3
    # The blocks waiting for data are not in the prefix cache: another prompt cannot hit them.
    (twin,) = create_requests(1, num_tokens=40, max_tokens=1)
    twin.prompt_token_ids[:] = decode.prompt_token_ids
    twin.all_token_ids[:] = decode.all_token_ids
    assert sched.kv_cache_manager.get_computed_blocks(twin, record=False)[1] == 0
    sched.on_remote_kvs_failed(decode.request_id)
    assert decode.status == RequestStatus.WAITING and pool.get_num_free_blocks() == free_before
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {decode.request_id: 40}  # (the whole prompt, here)
    assert connector.take_pending_loads() == []


def test_a_remote_prefill_of_a_one_token_prompt_or_short_block_list_is_computed_here():
    sched = create_scheduler(num_blocks=20, block_size=16)
    connector = _connector(sched, "kv_consumer")
    (one,) = create_requests(1, num_tokens=1, max_tokens=1)
    (short,) = create_requests(1, num_tokens=40, max_tokens=1)
    one.kv_transfer_params = {"do_remote_prefill": True, "remote_request_id": "p1", "remote_block_ids": [1]}
    short.kv_transfer_params = {"do_remote_prefill": True, "remote_request_id": "p2",
                                "remote_block_ids": [1, 2]}  # (three needed)
    sched.add_request(one)
    sched.add_request(short)
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {one.request_id: 1, short.request_id: 40}
    assert connector.take_pending_loads() == []
    # Their producers are told to free what they hold for them.
    assert [p["remote_request_id"] for p in connector.take_declined()] == ["p1", "p2"]


def test_producers_hear_of_every_read_that_will_not_happen():
    sched = create_scheduler(num_blocks=20, block_size=16, max_num_seqs=1)
    connector = _connector(sched, "kv_consumer")
    # The whole prompt but its last token cached here already: nothing to read.
    (warm,) = create_requests(1, num_tokens=33, max_tokens=1, same_prompt=True)
    sched.add_request(warm)
    step(sched)
    (cached,) = create_requests(1, num_tokens=33, max_tokens=2, same_prompt=True)
    cached.kv_transfer_params = {"do_remote_prefill": True, "remote_request_id": "p1", "remote_block_ids": [1, 2, 3]}
    sched.add_request(cached)
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {cached.request_id: 1} and connector.take_pending_loads() == []
    assert [p["remote_request_id"] for p in connector.take_declined()] == ["p1"]
    # Aborted while still queued (max_num_seqs is full): never admitted, never read.
    (queued,) = create_requests(1, num_tokens=40, max_tokens=3)
    queued.kv_transfer_params = {"do_remote_prefill": True, "remote_request_id": "p2", "remote_block_ids": [1, 2, 3]}
    sched.add_request(queued)
    step(sched)
    assert queued.status == RequestStatus.WAITING
    sched.finish_requests(queued.request_id, RequestStatus.FINISHED_ABORTED)
    assert [p["remote_request_id"] for p in connector.take_declined()] == ["p2"]


def test_a_prefill_for_several_readers_is_freed_after_the_last():
    sched = create_scheduler(num_blocks=20, block_size=16)
    connector = _connector(sched, "kv_producer")
    (prefill,) = create_requests(1, num_tokens=40, max_tokens=1)
    prefill.kv_transfer_params = {"do_remote_decode": True, "num_readers": 3}
    sched.add_request(prefill)
    _, outputs = step(sched)
    (out,) = [o for eco in outputs.values() for o in eco.outputs]
    nonce = out.kv_transfer_params["remote_nonce"]
    assert connector.release(prefill.request_id, nonce) is None and connector.release(prefill.request_id, nonce) is None
    assert connector.is_held(prefill.request_id)
    assert connector.release(prefill.request_id, nonce) is prefill and not connector.is_held(prefill.request_id)


def test_an_admission_for_remote_kv_saves_what_it_evicts_to_the_host_tier(tiny_model_dir):
    """A pass that schedules no token still runs the workers when KV offloading has blocks to save:
    parking a request for remote KV can evict cached blocks, whose host copies must exist before the
    tier answers for them."""
    engine = _engine(tiny_model_dir, {"kv_role": "kv_consumer"}, num_gpu_blocks=8, kv_offloading_size=0.001)
    try:
        prompt = [(3 * i + 2) % 200 + 5 for i in range(97)]
        first = _run(engine, [EngineCoreRequest(request_id="warm", prompt_token_ids=prompt,
                                                sampling_params=_greedy(6))])["warm"]["tokens"]
        engine.step()  # (the pass telling the workers that "warm" finished: the next runs nothing else)
        engine.kv_fetcher = lambda load: concurrent.futures.Future()  # (a read that never ends)
        engine.add_request(EngineCoreRequest(
            request_id="d", prompt_token_ids=[(5 * i + 1) % 200 + 5 for i in range(97)],
            sampling_params=_greedy(2), kv_transfer_params={"do_remote_prefill": True, "remote_request_id": "p",
                                                            "remote_block_ids": list(range(7))}))
        outputs = engine.step()
        assert not any(eco.outputs for eco in outputs.values())
        assert engine.stats().kv_offload_stored_blocks > 0
        engine.abort_requests(["d"])
        # The evicted prompt comes back from the host tier with the same answer.
        again = _run(engine, [EngineCoreRequest(request_id="again", prompt_token_ids=prompt,
                                                sampling_params=_greedy(6))])["again"]
        assert again["tokens"] == first and again["cached"] > 0 and engine.stats().kv_offload_loaded_blocks > 0
    finally:
        engine.shutdown()


# -- two real engines ----------------------------------------------------------------------------


def _engine(model_dir, transfer: dict[str, Any] | None, **spec: Any):
    from cluster.config import ClusterConfig, EngineSpec
    from engine_core.engine_core import EngineCore
    from gpu_worker.executor import create_executor

    config = ClusterConfig(model=str(model_dir), defaults=EngineSpec(
        **({"num_gpu_blocks": 32, "max_model_len": 128} | spec), kv_transfer_config=transfer)).engine_configs()[0]
    return EngineCore(config, create_executor(config))


def _run(engine, requests: list[EngineCoreRequest], timeout: float = 60.0) -> dict[str, dict[str, Any]]:
    for request in requests:
        engine.add_request(request)
    results: dict[str, dict[str, Any]] = {r.request_id: {"tokens": []} for r in requests}
    deadline = time.monotonic() + timeout
    while any("finish" not in r for r in results.values()) and time.monotonic() < deadline:
        for eco in engine.step().values():
            for out in eco.outputs:
                result = results[out.request_id]
                result["tokens"] += out.new_token_ids
                result["cached"] = out.num_cached_tokens
                if out.finish_reason is not None:
                    result["finish"] = out.finish_reason
                    result["params"] = out.kv_transfer_params
    return results


def reading_from(producer, reads: list[tuple[str, list[int]]] | None = None):
    """A consumer's ``kv_fetcher`` reading ``producer``'s held blocks in this process (each read's
    request id and block ids noted in ``reads``)."""
    def fetch(load):
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if reads is not None:
            reads.append((load.params["remote_request_id"], load.remote_block_ids))
        try:
            future.set_result(producer.read_held_kv(load.params["remote_request_id"], load.params["remote_nonce"],
                                                    load.remote_block_ids, load.first_block, load.digest,
                                                    load.num_tokens, load.remote_group_block_ids))
        except Exception as e:
            future.set_exception(e)
        return future

    return fetch


def _greedy(max_tokens: int, **params: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params)


def test_two_engines_hand_a_prompt_on_and_decode_what_one_engine_would(tiny_model_dir):
    prompt = [(7 * i + 3) % 200 + 5 for i in range(45)]
    reference = _engine(tiny_model_dir, None)
    producer = _engine(tiny_model_dir, {"kv_role": "kv_producer"})
    consumer = _engine(tiny_model_dir, {"kv_role": "kv_consumer"})
    reads: list[tuple[str, list[int]]] = []
    consumer.kv_fetcher = reading_from(producer, reads)
    try:
        expected = _run(reference, [EngineCoreRequest(request_id="r", prompt_token_ids=prompt,
                                                      sampling_params=_greedy(10))])["r"]["tokens"]
        prefill = _run(producer, [EngineCoreRequest(request_id="p", prompt_token_ids=prompt,
                                                    sampling_params=_greedy(1),
                                                    kv_transfer_params={"do_remote_decode": True})])["p"]
        params = prefill["params"]
        assert params["do_remote_prefill"] and len(params["remote_block_ids"]) == 3
        free_held = producer.stats().num_free_blocks
        decoded = _run(consumer, [EngineCoreRequest(request_id="d", prompt_token_ids=prompt,
                                                    sampling_params=_greedy(10), kv_transfer_params=params)])["d"]
        assert decoded["tokens"] == expected and decoded["cached"] == 44
        assert reads == [("p", params["remote_block_ids"])]
        # Read once, the producer's blocks are let go; a second read is refused.
        assert producer.stats().num_free_blocks == free_held + 3
        with pytest.raises(KeyError, match="holds no KV blocks"):
            producer.read_held_kv("p", params["remote_nonce"], params["remote_block_ids"], 0, "", 0)
        # The consumer's scheduled tokens: the last prompt token, then one per output token.
        assert consumer.stats().kv_transfer_received_blocks == 3 and producer.stats().kv_transfer_sent_blocks == 3
        assert producer.stats().kv_transfer_held_requests == 0
        # The same prompt again: the blocks read entered the consumer's prefix cache.
        again = _run(consumer, [EngineCoreRequest(request_id="d2", prompt_token_ids=prompt,
                                                  sampling_params=_greedy(10))])["d2"]
        assert again["tokens"] == expected and again["cached"] == 32
        # Parameters naming a read already done: the consumer computes the prompt itself, same answer.
        retry = _run(consumer, [EngineCoreRequest(request_id="d3", prompt_token_ids=prompt[:40] + [9] * 5,
                                                  sampling_params=_greedy(10), kv_transfer_params=params)])["d3"]
        local = _run(reference, [EngineCoreRequest(request_id="r3", prompt_token_ids=prompt[:40] + [9] * 5,
                                                   sampling_params=_greedy(10))])["r3"]
        assert retry["tokens"] == local["tokens"] and consumer.stats().kv_transfer_failures == 1
    finally:
        for engine in (reference, producer, consumer):
            engine.shutdown()


def test_a_fail_policy_fails_the_request_whose_kv_cannot_be_read(tiny_model_dir):
    from engine_core.request import FinishReason

    consumer = _engine(tiny_model_dir, {"kv_role": "kv_consumer", "kv_load_failure_policy": "fail"})
    try:
        params = {"do_remote_prefill": True, "remote_engine_id": "engine-7", "remote_request_id": "p",
                  "remote_block_ids": [0, 1, 2]}
        result = _run(consumer, [EngineCoreRequest(request_id="d", prompt_token_ids=list(range(5, 50)),
                                                   sampling_params=_greedy(4), kv_transfer_params=params)])["d"]
        assert result["finish"] == FinishReason.ERROR and result["tokens"] == []
        assert consumer.stats().num_free_blocks == 32
    finally:
        consumer.shutdown()


def test_a_read_the_producer_never_answers_gives_up_at_load_timeout(tiny_model_dir):
    """A producer alive but stuck: the decode engine stops waiting after load_timeout and computes the
    prompt itself (same answer as one engine); the answer arriving after that is dropped."""
    prompt = [(11 * i + 4) % 200 + 5 for i in range(45)]
    reference = _engine(tiny_model_dir, None)
    consumer = _engine(tiny_model_dir, {"kv_role": "kv_consumer",
                                        "kv_connector_extra_config": {"load_timeout": 1.0}})
    reads: list[concurrent.futures.Future[Any]] = []

    def fetch(load):
        reads.append(concurrent.futures.Future())
        return reads[-1]

    consumer.kv_fetcher = fetch
    try:
        expected = _run(reference, [EngineCoreRequest(request_id="r", prompt_token_ids=prompt,
                                                      sampling_params=_greedy(6))])["r"]["tokens"]
        params = {"do_remote_prefill": True, "remote_engine_id": "engine-0", "remote_request_id": "p",
                  "remote_block_ids": [0, 1, 2], "remote_nonce": "n"}
        consumer.add_request(EngineCoreRequest(request_id="d", prompt_token_ids=prompt, sampling_params=_greedy(6),
                                               kv_transfer_params=params))
        started = time.monotonic()
        consumer.step()
        assert len(reads) == 1 and consumer.scheduler.requests["d"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        for _ in range(3):
            consumer.step()
        if time.monotonic() - started < 0.9:  # (before its deadline, however many passes run: parked)
            assert consumer.scheduler.requests["d"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        time.sleep(1.0)
        tokens: list[int] = []
        deadline = time.monotonic() + 30
        while len(tokens) < 6 and time.monotonic() < deadline:
            for eco in consumer.step().values():
                tokens += [t for out in eco.outputs for t in out.new_token_ids]
        assert tokens == expected and consumer.stats().kv_transfer_failures == 1
        # The stuck read answers at last: nothing happens (no second failure, no write).
        reads[0].set_result([b"late"])
        consumer.step()
        assert consumer.stats().kv_transfer_failures == 1 and consumer.stats().kv_transfer_received_blocks == 0
    finally:
        for engine in (reference, consumer):
            engine.shutdown()


def test_engines_refuse_a_transfer_config_their_model_cannot_use(tmp_path):
    from cluster.config import ClusterConfig, EngineSpec
    from engine_core.engine_core import EngineCore
    from gpu_worker.executor import create_executor
    from tests.tiny_model import build_tiny_embedder

    config = ClusterConfig(model=str(build_tiny_embedder(tmp_path)), defaults=EngineSpec(
        num_gpu_blocks=32, max_model_len=128, kv_transfer_config={"kv_role": "kv_both"})).engine_configs()[0]
    with pytest.raises(ValueError, match="kv-transfer-config: an embedding model decodes nothing"):
        EngineCore(config, create_executor(config))


@pytest.mark.slow
def test_tensor_parallel_engines_hand_each_ranks_shard_on(ray_cluster, tiny_model_dir):
    """Two engines of two Ray worker ranks each: every rank's KV shard goes to the same rank."""
    prompt = [(5 * i + 1) % 200 + 5 for i in range(37)]
    producer = _engine(tiny_model_dir, {"kv_role": "kv_producer"}, tensor_parallel_size=2)
    consumer = _engine(tiny_model_dir, {"kv_role": "kv_consumer"}, tensor_parallel_size=2)

    fetch = consumer.kv_fetcher = reading_from(producer)
    try:
        expected = _run(consumer, [EngineCoreRequest(request_id="whole", prompt_token_ids=prompt,
                                                     sampling_params=_greedy(8))])["whole"]["tokens"]
        consumer.reset_prefix_cache()
        params = _run(producer, [EngineCoreRequest(request_id="p", prompt_token_ids=prompt,
                                                   sampling_params=_greedy(1),
                                                   kv_transfer_params={"do_remote_decode": True})])["p"]["params"]
        decoded = _run(consumer, [EngineCoreRequest(request_id="d", prompt_token_ids=prompt,
                                                    sampling_params=_greedy(8), kv_transfer_params=params)])["d"]
        assert decoded["tokens"] == expected and decoded["cached"] == 36
        assert consumer.stats().kv_transfer_received_blocks == 3
        # A consumer of one rank cannot take two ranks' shards: it computes the prompt itself.
        single = _engine(tiny_model_dir, {"kv_role": "kv_consumer"})
        single.kv_fetcher = fetch
        try:
            params = _run(producer, [EngineCoreRequest(request_id="p2", prompt_token_ids=prompt,
                                                       sampling_params=_greedy(1),
                                                       kv_transfer_params={"do_remote_decode": True})])["p2"]["params"]
            alone = _run(single, [EngineCoreRequest(request_id="d2", prompt_token_ids=prompt,
                                                    sampling_params=_greedy(8), kv_transfer_params=params)])["d2"]
            assert alone["tokens"] == expected and single.stats().kv_transfer_failures == 1
        finally:
            single.shutdown()
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_a_host_tier_holding_part_of_the_prompt_gives_way_to_the_producers_blocks():
    sched = create_scheduler(num_blocks=6, block_size=16, num_offload_blocks=8)
    connector = _connector(sched, "kv_consumer")
    (warm,) = create_requests(1, num_tokens=49, max_tokens=1)
    sched.add_request(warm)
    step(sched)
    (other,) = create_requests(1, num_tokens=81, max_tokens=1)  # (evicts warm's blocks to the host tier)
    sched.add_request(other)
    step(sched)
    step(sched)
    (decode,) = create_requests(1, num_tokens=65, max_tokens=2, prefix=warm.prompt_token_ids[:16])
    manager = sched.kv_cache_manager
    computed, num_hit = manager.get_computed_blocks(decode, record=False)
    assert num_hit == 0
    assert len(manager.get_offloaded_blocks(decode, computed)) == 1  # (the host tier holds its first block only)
    decode.kv_transfer_params = {"do_remote_prefill": True, "remote_request_id": "p", "remote_nonce": "n",
                                 "remote_block_ids": [10, 11, 12, 13, 14]}
    sched.add_request(decode)
    step(sched)
    (load,) = connector.take_pending_loads()
    assert load.remote_block_ids == [10, 11, 12, 13] and load.first_block == 0 and connector.take_declined() == []


def test_a_cache_reset_lets_held_prefills_go(tiny_model_dir):
    producer = _engine(tiny_model_dir, {"kv_role": "kv_producer"})
    try:
        _run(producer, [EngineCoreRequest(request_id="p", prompt_token_ids=list(range(5, 45)),
                                          sampling_params=_greedy(1), kv_transfer_params={"do_remote_decode": True})])
        assert producer.stats().kv_transfer_held_requests == 1
        with pytest.raises(ValueError, match="is in use"):
            producer.add_request(EngineCoreRequest(request_id="p", prompt_token_ids=[5, 6],
                                                   sampling_params=_greedy(1)))
        assert producer.reset_prefix_cache()  # (a pause, a sleep, /reset_prefix_cache: the readers recompute)
        assert producer.stats().kv_transfer_held_requests == 0 and producer.stats().num_free_blocks == 32
    finally:
        producer.shutdown()


def test_choices_sharing_one_prefill_read_it_once_and_find_it_cached():
    sched = create_scheduler(num_blocks=20, block_size=16)
    connector = _connector(sched, "kv_consumer")
    params = {"do_remote_prefill": True, "remote_engine_id": "engine-0", "remote_request_id": "p",
              "remote_nonce": "n", "remote_block_ids": [1, 2, 3], "num_readers": 2}
    first, second = create_requests(2, num_tokens=33, max_tokens=2, same_prompt=True)
    for request in (first, second):
        request.kv_transfer_params = dict(params)
        sched.add_request(request)
    out, _ = step(sched)
    (load,) = connector.take_pending_loads()  # (one read, by the first)
    assert load.request_id == first.request_id and out.total_num_scheduled_tokens == 0
    assert sched.kv_cache_manager.get_num_blocks(second.request_id) == 0  # (the second waits: no blocks)
    step(sched)
    assert connector.take_pending_loads() == [] and second.status == RequestStatus.WAITING
    sched.on_remote_kvs_ready(first.request_id)
    for _ in range(3):
        step(sched)
    # The second found the prompt in the prefix cache (all but its last token): nothing to read, and
    # its producer is told it will not read.
    assert second.num_cached_tokens == 32 and connector.take_pending_loads() == []
    assert [p["remote_request_id"] for p in connector.take_declined()] == ["p"]


def test_an_engine_without_the_config_computes_such_a_prompt_and_tells_its_producer(tiny_model_dir):
    engine = _engine(tiny_model_dir, None)
    released: list[dict[str, Any]] = []
    engine.kv_releaser = released.append
    try:
        params = {"do_remote_prefill": True, "remote_engine_id": "engine-0", "remote_request_id": "p",
                  "remote_nonce": "n", "remote_block_ids": [0, 1, 2]}
        prompt = list(range(5, 45))
        result = _run(engine, [EngineCoreRequest(request_id="d", prompt_token_ids=prompt, sampling_params=_greedy(4),
                                                 kv_transfer_params=params)])["d"]
        whole = _run(engine, [EngineCoreRequest(request_id="w", prompt_token_ids=prompt,
                                                sampling_params=_greedy(4))])["w"]
        engine.kv_housekeeping()
        assert result["tokens"] == whole["tokens"] and released == [params]
        assert engine.stats().kv_transfer_declined == 1
    finally:
        engine.shutdown()


def test_the_mtp_drafters_cache_travels_with_the_prompts(tmp_path):
    """Both engines draft with the model's MTP layer: the producer's prompt rows of that layer's
    cache are read with the model's (the consumer recomputes only the last prompt token), so the
    consumer drafts from them as one engine would; the answer is one engine's."""
    from tests.gpu_worker.utils import save_tiny_model_with_mtp
    from tests.tiny_model import build_tokenizer

    path = save_tiny_model_with_mtp(tmp_path / "glm", "glm4_moe", near_bigram=0.02)
    build_tokenizer().save_pretrained(path)
    mtp = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}
    prompt = [(7 * i + 3) % 200 + 5 for i in range(45)]
    reference = _engine(path, None, **mtp)
    producer = _engine(path, {"kv_role": "kv_producer"}, **mtp)
    consumer = _engine(path, {"kv_role": "kv_consumer"}, **mtp)
    consumer.kv_fetcher = reading_from(producer)
    try:
        expected = _run(reference, [EngineCoreRequest(request_id="r", prompt_token_ids=prompt,
                                                      sampling_params=_greedy(10))])["r"]["tokens"]
        params = _run(producer, [EngineCoreRequest(request_id="p", prompt_token_ids=prompt, sampling_params=_greedy(1),
                                                   kv_transfer_params={"do_remote_decode": True})])["p"]["params"]
        consumer.add_request(EngineCoreRequest(request_id="d", prompt_token_ids=prompt, sampling_params=_greedy(10),
                                               kv_transfer_params=params))
        tokens: list[int] = []
        ours = None
        for _ in range(60):
            for eco in consumer.step().values():
                tokens += [t for out in eco.outputs for t in out.new_token_ids]
            if ours is None and "d" in consumer.scheduler.requests and tokens:
                ours = list(consumer.scheduler.kv_cache_manager.get_block_ids("d"))
            if len(tokens) == 10:
                break
        assert tokens == expected and consumer.stats().kv_transfer_received_blocks == 3
        # The MTP layer's rows of the prompt's first 44 positions (blocks of 16), as the producer computed them.
        theirs = params["remote_block_ids"]
        (k_theirs, v_theirs), = producer.executor.worker.runner.drafter.runner.kv_caches
        (k_ours, v_ours), = consumer.executor.worker.runner.drafter.runner.kv_caches
        for mine, other in ((k_ours, k_theirs), (v_ours, v_theirs)):
            assert torch.equal(mine[ours[:2]], other[theirs[:2]]) and bool(other[theirs[0]].abs().sum() > 0)
            assert torch.equal(mine[ours[2], :12], other[theirs[2], :12])
        assert reference.stats().spec_decode_num_accepted_tokens > 0
    finally:
        for engine in (reference, producer, consumer):
            engine.shutdown()


def test_a_draft_models_cache_is_not_transferred_so_it_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="a draft model's or EAGLE head's KV cache is not transferred"):
        _engine(tiny_model_dir, {"kv_role": "kv_consumer"},
                speculative_config={"model": str(tiny_model_dir), "num_speculative_tokens": 2})


@pytest.mark.parametrize("kind", ["cohere2", "gemma2"])
def test_engines_with_kv_cache_groups_hand_on_each_groups_blocks_of_the_window(tmp_path, kind):
    """Under the hybrid KV cache manager (Cohere2: three windowed layers of 8 keys and one full, a group
    each; Gemma 2 over four layers: two groups of two layers sharing two tensors), blocks of 4: the
    consumer reads the full group's 11 blocks of the prompt's first 44 tokens and each windowed group's
    blocks of the window of the token at 44 (keys 37..44: blocks 9 and 10), and answers as one engine
    does. An engine keeping one group (--disable-hybrid-kv-cache-manager) computes such a prompt itself
    and tells the producer."""
    from tests.gpu_worker.utils import HYBRID_GROUPS, save_tiny_model
    from tests.tiny_model import build_tokenizer

    overrides, num_windowed = HYBRID_GROUPS[kind]
    path = save_tiny_model(tmp_path / kind, kind, **overrides)
    build_tokenizer().save_pretrained(path)
    spec = {"block_size": 4, "num_gpu_blocks": 96, "max_model_len": 64, "dtype": "float32"}
    prompt = [(7 * i + 3) % 200 + 5 for i in range(45)]
    reference = _engine(path, None, **spec)
    producer = _engine(path, {"kv_role": "kv_producer"}, **spec)
    consumer = _engine(path, {"kv_role": "kv_consumer"}, **spec)
    one_group = _engine(path, {"kv_role": "kv_consumer"}, disable_hybrid_kv_cache_manager=True, **spec)
    reads: list[tuple[str, list[int]]] = []
    consumer.kv_fetcher = reading_from(producer, reads)
    released: list[dict[str, Any]] = []
    one_group.kv_releaser = released.append
    try:
        groups = consumer.scheduler.kv_cache_manager.groups
        assert len(groups) == num_windowed and not one_group.scheduler.kv_cache_manager.groups
        # (What travels: a page of each of the groups' shared tensors a block.)
        assert len(consumer.executor.worker._transferred_caches()) == 4 // (num_windowed + 1)
        expected = _run(reference, [EngineCoreRequest(request_id="r", prompt_token_ids=prompt,
                                                      sampling_params=_greedy(8))])["r"]["tokens"]
        prefills = _run(producer, [EngineCoreRequest(request_id=f"p{i}", prompt_token_ids=prompt,
                                                     sampling_params=_greedy(1),
                                                     kv_transfer_params={"do_remote_decode": True})
                                   for i in range(2)])
        params = prefills["p0"]["params"]
        assert len(params["remote_block_ids"]) == 12 and len(params["remote_group_block_ids"]) == num_windowed
        assert all(ids[9] is not None and ids[10] is not None for ids in params["remote_group_block_ids"])
        decoded = _run(consumer, [EngineCoreRequest(request_id="d", prompt_token_ids=prompt,
                                                    sampling_params=_greedy(8), kv_transfer_params=params)])["d"]
        assert decoded["tokens"] == expected and decoded["cached"] == 44
        received = 11 + num_windowed * 2
        assert consumer.stats().kv_transfer_received_blocks == received == producer.stats().kv_transfer_sent_blocks
        assert reads == [("p0", params["remote_block_ids"][:11])]
        # Those blocks entered the consumer's prefix cache, each group's under its keys: the prompt again hits.
        again = _run(consumer, [EngineCoreRequest(request_id="d2", prompt_token_ids=prompt,
                                                  sampling_params=_greedy(8))])["d2"]
        assert again["tokens"] == expected and again["cached"] == 44
        # A longer prompt whose first 44 tokens the consumer holds: it reads block 11 of each group alone (the
        # token at 48 sees keys 41..48: each windowed group's block 10 is the consumer's own).
        longer = prompt + [9, 8, 7, 6]
        expected_longer = _run(reference, [EngineCoreRequest(request_id="r2", prompt_token_ids=longer,
                                                             sampling_params=_greedy(8))])["r2"]["tokens"]
        params2 = _run(producer, [EngineCoreRequest(request_id="p2", prompt_token_ids=longer,
                                                    sampling_params=_greedy(1),
                                                    kv_transfer_params={"do_remote_decode": True})])["p2"]["params"]
        decoded2 = _run(consumer, [EngineCoreRequest(request_id="d3", prompt_token_ids=longer,
                                                     sampling_params=_greedy(8), kv_transfer_params=params2)])["d3"]
        assert decoded2["tokens"] == expected_longer and decoded2["cached"] == 48
        assert consumer.stats().kv_transfer_received_blocks == received + 1 + num_windowed
        # Parameters naming no block where the window needs one (a producer that let it go): computed here.
        broken = {**params2, "remote_request_id": "gone",
                  "remote_group_block_ids": [ids[:10] + [None] + ids[11:] for ids in params2["remote_group_block_ids"]]}
        consumer.kv_releaser = released.append
        other = prompt[:40] + [1, 2, 3, 4, 5]
        local_other = _run(reference, [EngineCoreRequest(request_id="r3", prompt_token_ids=other,
                                                         sampling_params=_greedy(8))])["r3"]["tokens"]
        refused = _run(consumer, [EngineCoreRequest(request_id="d4", prompt_token_ids=other, sampling_params=_greedy(8),
                                                    kv_transfer_params=broken)])["d4"]
        consumer.kv_housekeeping()
        assert refused["tokens"] == local_other and released == [broken]
        released.clear()
        # Another layout on the consumer: no read, the prompt computed there, the producer told to let go.
        local = _run(one_group, [EngineCoreRequest(request_id="o", prompt_token_ids=prompt, sampling_params=_greedy(8),
                                                   kv_transfer_params=prefills["p1"]["params"])])["o"]
        one_group.kv_housekeeping()
        assert local["tokens"] == expected and local["cached"] == 0 and released == [prefills["p1"]["params"]]
        assert one_group.stats().kv_transfer_received_blocks == 0
    finally:
        for engine in (reference, producer, consumer, one_group):
            engine.shutdown()
