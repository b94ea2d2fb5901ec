"""EngineCoreService (the busy loop and its plumbing) in-process with a tiny real model."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import ClusterConfig, EngineSpec
from engine_core.engine_actor import EngineCoreService
from engine_core.outputs import EngineCoreRequest
from engine_core.request import FinishReason
from engine_core.sampling_params import SamplingParams
from engine_core.sched.scheduler import PauseState
from gpu_worker.executor import create_executor
from tests.tiny_model import build_tiny_llama, build_tokenizer


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny"))
    config = ClusterConfig(model=str(model), defaults=EngineSpec(num_gpu_blocks=64, max_num_seqs=4,
                                                                 max_model_len=256)).engine_configs()[0]
    service = EngineCoreService(config, create_executor)
    yield service
    service.shutdown()


def _run(service: EngineCoreService, rid: str, prompt: list[int], max_tokens: int = 8):
    """Add a request and read its outputs off the client buffer: (tokens, cached prompt tokens, finish)."""
    _start(service, rid, prompt, max_tokens)
    tokens, cached, finish = [], None, None
    deadline = time.monotonic() + 60
    while finish is None and time.monotonic() < deadline:
        time.sleep(0.01)
        for eco in service._take(service._buffer(0)):
            for out in eco.outputs:
                if out.request_id == rid:
                    tokens += out.new_token_ids
                    finish = out.finish_reason
                    cached = out.num_cached_tokens if cached is None else cached
    return tokens, cached, finish


def test_a_worker_restart_forgets_the_prefix_cache(service):
    prompt = list(range(3, 70))  # four full blocks of 16 go into the prefix cache
    before, _, _ = _run(service, "warm", prompt)
    assert _run(service, "hit", prompt)[1] == 64
    executor = service.engine.executor
    old_runner = weakref.ref(executor.worker.runner)
    freed_before_the_new_load = []
    new_worker = executor._new_worker

    def watched_new_worker():
        gc.collect()
        freed_before_the_new_load.append(old_runner() is None)
        return new_worker()

    def fail(*args):  # (raised inside the runner's pass: its frames hold the runner)
        raise RuntimeError("injected worker failure")

    executor.worker.runner._forward = fail
    executor._new_worker = watched_new_worker
    try:
        assert _run(service, "fails", list(range(100, 120)))[2] == FinishReason.ERROR
        deadline = time.monotonic() + 60
        while service._error is not None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        del executor._new_worker
    assert service.is_healthy()
    # The old worker's weights and KV cache were freed before the new worker loaded (a GPU holds one).
    assert freed_before_the_new_load == [True]
    # The new workers' caches are empty: nothing may be served from the blocks remembered before.
    after, cached, _ = _run(service, "after-restart", prompt)
    assert cached == 0 and after == before


def test_a_failed_restart_leaves_no_half_made_worker_and_calls_on_unrecoverable(service):
    """A restart whose new worker fails to load: the engine is unhealthy, holds no worker, refuses
    requests with the reason, and calls on_unrecoverable (an actor exits there, for Ray to restart
    it). A restart that works afterwards brings it back."""
    executor = service.engine.executor

    def cannot_load():
        raise RuntimeError("injected: the checkpoint could not be read")

    def fail(*args):
        raise RuntimeError("injected worker failure")

    called = []
    executor.worker.runner._forward = fail
    executor._new_worker = cannot_load
    service.on_unrecoverable = lambda: called.append(True)
    try:
        assert _run(service, "fails", list(range(100, 120)))[2] == FinishReason.ERROR
        deadline = time.monotonic() + 30
        while not called and time.monotonic() < deadline:
            time.sleep(0.05)
        assert called == [True] and executor.worker is None and not service.is_healthy()
        with pytest.raises(RuntimeError, match="restart failed: injected: the checkpoint could not be read"):
            _start(service, "refused", [5, 6, 7], 2)
    finally:
        del executor._new_worker
        service.on_unrecoverable = None
    service.call_in_loop(service._restart_executor)
    assert service.is_healthy()
    assert _run(service, "after", list(range(150, 160)))[2] == FinishReason.LENGTH


def test_a_paused_engine_with_waiting_work_waits_instead_of_spinning(service):
    service.call_in_loop(lambda: service.engine.pause(PauseState.PAUSED_NEW))
    try:
        service.add_request(EngineCoreRequest(request_id="held", prompt_token_ids=[5, 6, 7], client_index=0,
                                              sampling_params=SamplingParams(max_tokens=2, temperature=0.0)))
        time.sleep(0.1)
        steps = service.engine.num_steps
        time.sleep(0.3)
        # A pass that can do nothing waits for input (5 ms): tens of passes, not a spinning core.
        assert service.engine.num_steps - steps < 150
    finally:
        service.call_in_loop(service.engine.resume)
    deadline = time.monotonic() + 30
    finished = False
    while not finished and time.monotonic() < deadline:
        time.sleep(0.01)
        finished = any(o.request_id == "held" and o.finish_reason is not None
                       for eco in service._take(service._buffer(0)) for o in eco.outputs)
    assert finished


def _start(service: EngineCoreService, rid: str, prompt: list[int], max_tokens: int) -> None:
    service.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, client_index=0,
                                          sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                         temperature=0.0)))


def _collect(service: EngineCoreService, seconds: float) -> dict[str, tuple[list[int], FinishReason | None]]:
    """What the client buffer receives in ``seconds``: per request, its tokens and finish reason."""
    got: dict[str, tuple[list[int], FinishReason | None]] = {}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.01)
        for eco in service._take(service._buffer(0)):
            for out in eco.outputs:
                tokens, _ = got.get(out.request_id, ([], None))
                got[out.request_id] = (tokens + out.new_token_ids, out.finish_reason)
    return got


def _until_finished(service: EngineCoreService, rid: str) -> tuple[list[int], FinishReason | None]:
    tokens: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for got_id, (new, finish) in _collect(service, 0.05).items():
            if got_id == rid:
                tokens += new
                if finish is not None:
                    return tokens, finish
    raise AssertionError(f"{rid} did not finish")


def _until_running(service: EngineCoreService) -> None:
    deadline = time.monotonic() + 30
    while not service.call_in_loop(lambda: len(service.engine.scheduler.running)):
        assert time.monotonic() < deadline, "the request was not admitted"
        time.sleep(0.001)


@pytest.fixture
def resumed_after(service):
    """The engine is resumed after the test, whatever it asserted."""
    yield
    service.resume_generation()


def test_pause_abort_ends_what_runs_and_holds_what_comes(service, resumed_after):
    """mode "abort": a running request (frozen by "keep" first, so the test cannot lose the race with
    its last token) ends with finish reason abort, its client told; a request sent while paused
    waits, then runs after resume; the prefix cache is emptied."""
    prompt = list(range(3, 40))
    _run(service, "cached", prompt)
    _start(service, "running", list(range(50, 60)), 240)
    _until_running(service)
    service.pause_generation("keep")
    assert service.pause_generation("abort", clear_cache=True) is True
    assert service.call_in_loop(service.engine.is_paused)
    got = _collect(service, 0.3)
    assert got["running"][1] == FinishReason.ABORT
    _start(service, "later", prompt, 4)
    assert "later" not in _collect(service, 0.3)  # held while paused
    pool = service.engine.scheduler.kv_cache_manager.block_pool
    assert service.call_in_loop(pool.get_usage) == 0.0
    assert service.call_in_loop(lambda: len(pool.cached_block_hash_to_block)) == 0  # "cached" was forgotten
    service.resume_generation()
    tokens, finish = _until_finished(service, "later")
    assert len(tokens) == 4 and finish == FinishReason.LENGTH
    assert not service.call_in_loop(service.engine.is_paused)


def test_pause_wait_lets_running_requests_finish_and_keep_freezes_them(service, resumed_after):
    """mode "wait": what the engine holds runs to its end while a request arriving meanwhile is held,
    then queued behind the pause; a resume during a drain wins (the drain does not pause after it);
    mode "keep" freezes a running request, which goes on after resume."""
    from concurrent.futures import ThreadPoolExecutor

    _start(service, "runs-out", list(range(60, 70)), 240)
    _until_running(service)
    with ThreadPoolExecutor(1) as pool:
        pausing = pool.submit(service.pause_generation, "wait", True)
        time.sleep(0.01)
        _start(service, "during", list(range(90, 100)), 4)
        assert service.is_paused() and not pausing.done()  # (paused from the ask: new requests are held)
        assert pausing.result(timeout=60) is True  # drained, paused, cache cleared
    tokens, finish = _until_finished(service, "runs-out")
    assert len(tokens) == 240 and finish == FinishReason.LENGTH  # it ran to its end, not aborted
    assert service.call_in_loop(service.engine.is_paused)
    assert service.call_in_loop(service.engine.num_in_flight_requests) == 1  # "during", queued
    assert "during" not in _collect(service, 0.2)
    service.resume_generation()
    tokens, finish = _until_finished(service, "during")
    assert len(tokens) == 4 and finish == FinishReason.LENGTH

    _start(service, "long", list(range(100, 110)), 240)
    _until_running(service)
    with ThreadPoolExecutor(1) as pool:
        pausing = pool.submit(service.pause_generation, "wait", True)
        time.sleep(0.01)
        service.resume_generation()  # (another router replica's /resume, say)
        assert pausing.result(timeout=60) is False
    assert not service.call_in_loop(service.engine.is_paused)
    assert _until_finished(service, "long")[1] == FinishReason.LENGTH

    _start(service, "frozen", list(range(70, 80)), 240)
    _until_running(service)
    assert service.pause_generation("keep", clear_cache=True) is False  # (its blocks stay: no clearing)
    _collect(service, 0.1)  # what the pass in flight produced
    assert _collect(service, 0.3).get("frozen", ([], None))[0] == []  # no tokens while frozen
    assert service.call_in_loop(lambda: len(service.engine.scheduler.running)) == 1
    service.resume_generation()
    assert _collect(service, 0.3)["frozen"][0]  # going on where it stopped
    service.abort_requests(["frozen"])
    _collect(service, 0.1)

    # "wait" after "keep" (freeze, then wait for the frozen ones, as before a sleep): they run to
    # their end, then the pause holds and the cache empties (they went on after it, holding blocks).
    _start(service, "kept", list(range(110, 120)), 60)
    _until_running(service)
    service.pause_generation("keep")
    assert service.pause_generation("wait", clear_cache=True) is True
    tokens, finish = _until_finished(service, "kept")
    assert len(tokens) == 60 and finish == FinishReason.LENGTH
    assert service.call_in_loop(service.engine.is_paused)
    assert service.call_in_loop(service.engine.scheduler.kv_cache_manager.block_pool.get_usage) == 0.0
    service.resume_generation()
    with pytest.raises(ValueError, match="pause mode must be one of"):
        service.pause_generation("later")


def test_max_model_len_defaults_to_the_models_and_must_fit_the_kv_cache(tmp_path_factory):
    from engine_core.engine_core import EngineCore

    model = build_tiny_llama(tmp_path_factory.mktemp("tiny"), max_positions=512)
    [config] = ClusterConfig(model=str(model), defaults=EngineSpec(num_gpu_blocks=64)).engine_configs()
    assert config.scheduler.max_model_len is None
    engine = EngineCore(config, create_executor(config))
    assert engine.scheduler_config.max_model_len == 512  # the model's context length, as in vLLM
    engine.shutdown()
    [small] = ClusterConfig(model=str(model), defaults=EngineSpec(num_gpu_blocks=8)).engine_configs()
    with pytest.raises(ValueError, match=r"max_model_len \(512\) needs 512 tokens of KV cache, more than it can hold"):
        EngineCore(small, create_executor(small))


def test_a_max_model_len_past_the_models_context_is_refused_unless_vllms_switch_allows_it(tmp_path_factory,
                                                                                       monkeypatch):
    """vLLM refuses it (it was capped to the model's without a word: long prompts then met 400s);
    with VLLM_ALLOW_LONG_MAX_MODEL_LEN the engine starts at the model's length."""
    from engine_core.engine_core import EngineCore

    model = build_tiny_llama(tmp_path_factory.mktemp("tiny"), max_positions=512)
    [config] = ClusterConfig(model=str(model), defaults=EngineSpec(num_gpu_blocks=64, max_model_len=600)
                             ).engine_configs()
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    with pytest.raises(ValueError, match=r"engine 0: max_model_len \(600\) is greater than the model's context "
                                         r"length \(512, from its config\)\. Set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"):
        create_executor(config)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    engine = EngineCore(config, create_executor(config))
    assert engine.scheduler_config.max_model_len == 512
    engine.shutdown()


def _greedy_holding(engine, prompt: list[int], max_tokens: int, blocks_held) -> tuple[list[int], int]:
    """Run one greedy request to its end in ``engine``: its tokens, and the most ``blocks_held(request id)``
    was after a step."""
    engine.add_request(EngineCoreRequest(request_id="long", prompt_token_ids=prompt, client_index=0,
                                         sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                        temperature=0.0)))
    tokens: list[int] = []
    held = 0
    while engine.scheduler.has_unfinished_requests():
        for eco in engine.step().values():
            for out in eco.outputs:
                tokens += out.new_token_ids
        held = max(held, blocks_held("long"))
    return tokens, held


def test_a_model_windowed_in_every_layer_serves_past_what_its_cache_holds(tmp_path):
    """Mistral-style sliding window (8 keys): the KV cache releases the blocks behind each request's
    window, so 8 blocks of 16 serve a 512-token context, and a 300-token prompt runs to its end with
    the output transformers computes."""
    import torch

    from engine_core.engine_core import EngineCore
    from tests.gpu_worker.utils import hf_greedy, load_hf, save_tiny_model

    model = save_tiny_model(tmp_path, "mistral", sliding_window=8, max_position_embeddings=512)
    build_tokenizer().save_pretrained(model)
    spec = EngineSpec(num_gpu_blocks=8, max_num_batched_tokens=32, max_num_seqs=2)
    [config] = ClusterConfig(model=str(model), defaults=spec).engine_configs()
    engine = EngineCore(config, create_executor(config))
    try:
        assert engine.model_info.sliding_window == 8 and engine.scheduler_config.max_model_len == 512
        prompt = [(11 * i + 5) % 256 for i in range(300)]
        tokens, held = _greedy_holding(engine, prompt, 6, engine.scheduler.kv_cache_manager.get_num_held_blocks)
        with torch.no_grad():
            assert tokens == hf_greedy(load_hf(model), prompt, 6)
        assert held <= 4  # (7 keys behind + 32 new) / 16, plus a block at each end
    finally:
        engine.shutdown()
    # The window is no exemption for a budget whose one pass the cache cannot hold ...
    wide = EngineSpec(num_gpu_blocks=8, max_num_batched_tokens=256, max_model_len=512)
    [config] = ClusterConfig(model=str(model), defaults=wide).engine_configs()
    with pytest.raises(ValueError, match=r"max_model_len \(512\) needs 288 tokens of KV cache"):
        EngineCore(config, create_executor(config))
    # ... but without --max-model-len the engine starts, serving what the cache holds (as Mistral
    # v0.1 on the CPU's default 1 GiB cache: 4096 tokens, fewer than 4095 + a 2048-token pass).
    [config] = ClusterConfig(model=str(model), defaults=wide.model_copy(update={"max_model_len": None})
                             ).engine_configs()
    engine = EngineCore(config, create_executor(config))
    assert engine.scheduler_config.max_model_len == 128
    engine.shutdown()


def test_kv_cache_events_go_to_every_subscriber_from_a_snapshot_on(service):
    from engine_core.core.block_pool import ALL_BLOCKS_CLEARED, BLOCKS_REMOVED, BLOCKS_STORED

    def events_of(client: int) -> list:
        return [e for eco in service._take(service._buffer(client)) for e in (eco.kv_events or [])]

    def apply(state: set, events: list) -> set:
        for kind, hashes in events:
            if kind == BLOCKS_STORED:
                state |= set(hashes)
            elif kind == BLOCKS_REMOVED:
                state -= set(hashes)
            else:
                state.clear()
        return state

    def cached() -> set:
        return service.call_in_loop(lambda: set(service.engine.scheduler.kv_cache_manager.block_pool
                                                .cached_block_hash_to_block))

    # Full blocks cached before anyone listens.
    assert _run(service, "before", list(range(200, 240)))[2] == FinishReason.LENGTH
    service.subscribe_kv_events(7)
    service.call_in_loop(lambda: None)  # (the subscription is done on the busy loop)
    snapshot = events_of(7)
    assert snapshot[0] == (ALL_BLOCKS_CLEARED, []) and apply(set(), snapshot) == cached() != set()
    # Client 0's requests fill the cache; subscriber 7 hears of it (and client 0, not subscribed, not).
    assert _run(service, "during", list(range(250, 310)))[2] == FinishReason.LENGTH
    mirror = apply(apply(set(), snapshot), events_of(7))
    assert mirror == cached()
    assert not any(eco.kv_events for eco in service._take(service._buffer(0)))
    assert service.call_in_loop(service.engine.reset_prefix_cache)
    service.call_in_loop(lambda: None)
    assert apply(mirror, events_of(7)) == set()
    service.unsubscribe_kv_events(7)
    assert _run(service, "after", list(range(320, 360)))[2] == FinishReason.LENGTH
    assert events_of(7) == []
    # Nobody listens: nothing is recorded any more.
    assert service.call_in_loop(lambda: service.engine.scheduler.kv_cache_manager.block_pool.kv_events) is None

    # A subscriber that stops reading: past the limit, its unread changes become one snapshot.
    service._max_buffered_event_hashes = 3
    try:
        service.subscribe_kv_events(8)
        for i in range(3):
            assert _run(service, f"unread-{i}", list(range(10 + 40 * i, 50 + 40 * i)))[2] == FinishReason.LENGTH
        unread = events_of(8)
        assert [kind for kind, _ in unread] == [ALL_BLOCKS_CLEARED, BLOCKS_STORED]  # one snapshot, no deltas
        assert apply(set(), unread) == cached()
    finally:
        service._max_buffered_event_hashes = 65536
        service.unsubscribe_kv_events(8)


def test_a_longrope_engine_keys_long_prompts_apart_in_its_prefix_cache(tmp_path):
    """Phi-3 128k (LongRoPE, pretrained length 16): the engine tells its KV cache the length, so a
    prompt past it finds nothing a shorter one computed with the short factors, and each request's
    tokens are transformers' (see test_model_runner for the factor switch while decoding)."""
    from engine_core.engine_core import EngineCore
    from tests.gpu_worker.utils import LONGROPE, hf_greedy, load_hf, save_tiny_model

    model = save_tiny_model(tmp_path, "phi3", original_max_position_embeddings=16, rope_scaling=LONGROPE)
    build_tokenizer().save_pretrained(model)
    [config] = ClusterConfig(model=str(model), defaults=EngineSpec(num_gpu_blocks=64, block_size=4)).engine_configs()
    engine = EngineCore(config, create_executor(config))
    prefix = [(7 * i + 3) % 256 for i in range(12)]
    # (The short ones stay within 16 tokens: past it transformers' generate recomputes everything.)
    prompts = {"short": prefix + [1], "long": prefix + [9] * 8, "short2": prefix + [3]}
    try:
        assert engine.model_info.long_rope_after == 16
        assert engine.scheduler.kv_cache_manager.long_rope_after == 16
        hits, tokens = {}, {}
        for rid, prompt in prompts.items():  # one after the other: each could hit the ones before
            engine.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, client_index=0,
                                                 sampling_params=SamplingParams(max_tokens=3, ignore_eos=True,
                                                                                temperature=0.0)))
            while engine.scheduler.has_unfinished_requests():
                for eco in engine.step().values():
                    for out in eco.outputs:
                        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                        hits.setdefault(out.request_id, out.num_cached_tokens)  # (on its first output)
    finally:
        engine.shutdown()
    assert hits == {"short": 0, "long": 0, "short2": 12}
    hf = load_hf(model)
    assert tokens == {rid: hf_greedy(hf, p, 3) for rid, p in prompts.items()}


def test_a_request_the_engine_refuses_in_its_loop_ends_with_an_error_output(service):
    """A request refused by the engine after admission (here: generation, once the model is
    embedding-only) is answered with an ERROR output: its client is not left waiting."""
    import dataclasses

    engine = service.engine
    saved = engine.model_info
    engine.model_info = dataclasses.replace(saved, pooling=dataclasses.replace(saved.pooling, generates=False))
    try:
        service._add_request(EngineCoreRequest(request_id="refused", prompt_token_ids=[5, 6, 7],
                                               sampling_params=SamplingParams(max_tokens=2)))
    finally:
        engine.model_info = saved
    [eco] = service._take(service._buffer(0))
    [out] = eco.outputs
    assert (out.request_id, out.finish_reason) == ("refused", FinishReason.ERROR)
    assert "embedding model" in out.stop_reason


def test_a_request_the_engine_fails_to_add_unexpectedly_ends_with_an_error_output(service, monkeypatch):
    """Any failure to add (here the scheduler's refusal of a request id it already runs) answers
    the request: its client was told it was admitted and would otherwise wait for ever."""
    def duplicate(request):
        raise ValueError(f"request {request.request_id} is already running")

    monkeypatch.setattr(service.engine, "add_request", duplicate)
    service._add_request(EngineCoreRequest(request_id="twice", prompt_token_ids=[5, 6, 7],
                                           sampling_params=SamplingParams(max_tokens=2)))
    [eco] = service._take(service._buffer(0))
    [out] = eco.outputs
    assert (out.request_id, out.finish_reason) == ("twice", FinishReason.ERROR)
    assert "already running" in out.stop_reason


def test_a_sleep_or_wake_up_under_way_is_not_a_failed_health_check(service, monkeypatch):
    """Workers busy sleeping or waking (a checkpoint read again) answer no ping until done; the
    engine stays healthy meanwhile, as vLLM's /health does."""
    def busy():
        raise TimeoutError("the workers are reading the checkpoint")

    monkeypatch.setattr(service.engine.executor, "check_health", busy)
    with pytest.raises(TimeoutError):
        service.check_health()
    with service._sleep_call():
        service.check_health()
    assert not service._sleep_calls


def test_a_failed_pass_leaves_the_load_gauges_empty(service):
    """The requests a failed pass ends are gone: running, waiting and KV usage read 0 at once, not
    the load before the failure until some later request makes a pass."""
    def gauges() -> dict[str, float]:
        wanted = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
        return {f.name: f.samples[0].value for f in text_string_to_metric_families(service.metrics.render().decode())
                if f.name in wanted}

    runner = service.engine.executor.worker.runner
    forward, passes, before = runner._forward, [], {}

    def fail_at_the_fourth_pass(*args, **kwargs):  # (the passes before it published their load)
        passes.append(1)
        if len(passes) < 4:
            return forward(*args, **kwargs)
        before.update(gauges())
        raise RuntimeError("injected worker failure")

    runner._forward = fail_at_the_fourth_pass
    for rid in ("a", "b"):
        _start(service, rid, list(range(20, 40)), 200)
    assert _until_finished(service, "a")[1] == FinishReason.ERROR
    deadline = time.monotonic() + 60
    while service._error is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert service.is_healthy()
    assert before["vllm:num_requests_running"] > 0 and before["vllm:kv_cache_usage_perc"] > 0
    assert gauges() == {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0,
                        "vllm:kv_cache_usage_perc": 0.0}


def test_an_abort_for_another_client_tells_the_requests_own_client(service):
    """abort_requests with tell_clients (a background response cancelled through another router
    replica): the running request ends with finish reason abort in its own client's outputs; a
    client's own abort (the default) sends nothing, as its client knows."""
    _start(service, "told", list(range(50, 60)), 240)
    _until_running(service)
    service.abort_requests(["told"], tell_clients=True)
    assert _collect(service, 0.3)["told"][1] == FinishReason.ABORT
    _start(service, "silent", list(range(70, 80)), 240)
    _until_running(service)
    service.abort_requests(["silent"])
    got = _collect(service, 0.3)
    assert "silent" not in got or got["silent"][1] is None
    assert service.call_in_loop(service.engine.num_in_flight_requests) == 0


def test_an_abort_for_another_client_tells_a_request_held_during_a_pause(service, resumed_after):
    """A request held back while a "wait" pause drains (it never reached the scheduler) is told too."""
    from concurrent.futures import ThreadPoolExecutor

    _start(service, "draining", list(range(60, 70)), 120)
    _until_running(service)
    with ThreadPoolExecutor(1) as pool:
        pausing = pool.submit(service.pause_generation, "wait", False)
        deadline = time.monotonic() + 30
        while not service.call_in_loop(lambda: service._held_requests is not None):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        _start(service, "held", list(range(90, 100)), 4)
        while "held" not in service.call_in_loop(lambda: [r.request_id for r in service._held_requests or ()]):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        service.abort_requests(["held"], tell_clients=True)
        assert _collect(service, 0.3)["held"][1] == FinishReason.ABORT
        pausing.result(timeout=60)
    assert service.call_in_loop(service.engine.num_in_flight_requests) == 0


def _sleepable_actor(tmp_path_factory):
    """An engine actor (in this process, Ray started) on a tiny model, with sleep mode."""
    from engine_core.engine_actor import EngineCoreActor

    model = build_tiny_llama(tmp_path_factory.mktemp("sleepable"))
    config = ClusterConfig(model=str(model), defaults=EngineSpec(num_gpu_blocks=64, max_num_seqs=4, max_model_len=256,
                                                                 enable_sleep_mode=True)).engine_configs()[0]
    return EngineCoreActor(config, create_executor)


def test_a_sleep_that_waits_for_requests_is_cut_short_by_an_abort_pause(ray_cluster, tmp_path_factory):
    """The actor's /sleep?mode=wait drains outside its pause lock, as /pause?mode=wait does: a
    /pause?mode=abort meanwhile aborts what still runs, and the sleep goes ahead. (It held the lock
    for the whole drain: the abort, a /resume or a /wake_up waited for the longest request.)"""
    async def run():
        actor = _sleepable_actor(tmp_path_factory)
        service = actor.service
        try:
            _start(service, "long", list(range(50, 60)), 240)
            _until_running(service)
            sleeping = asyncio.create_task(actor.sleep(1, "wait"))
            await asyncio.sleep(0.05)
            assert not sleeping.done()  # (draining)
            await asyncio.wait_for(actor.pause_generation("abort"), 60)
            await asyncio.wait_for(sleeping, 60)
            assert await actor.is_sleeping()
            assert _collect(service, 0.3)["long"][1] == FinishReason.ABORT
        finally:
            service.shutdown()

    asyncio.run(run())


def test_a_resume_after_a_sleeps_drain_refuses_the_sleep(ray_cluster, tmp_path_factory, monkeypatch):
    """A /resume that comes between the end of a sleep's drain (outside the lock) and the sleep
    itself wins, as one during the drain does: the sleep is refused and the engine serves."""
    async def run():
        actor = _sleepable_actor(tmp_path_factory)
        service = actor.service
        drain = service.pause_generation

        def drain_then_resumed(mode: str, clear_cache: bool = True) -> bool:
            emptied = drain(mode, clear_cache)
            service.resume_generation()  # (another router replica's /resume, just after the drain)
            return emptied

        try:
            monkeypatch.setattr(service, "pause_generation", drain_then_resumed)
            with pytest.raises(RuntimeError, match="a resume came first"):
                await actor.sleep(1, "wait")
            monkeypatch.undo()
            assert not await actor.is_sleeping() and not await actor.is_paused()
            assert _run(service, "serves", list(range(3, 20)), 4)[2] == FinishReason.LENGTH
        finally:
            service.shutdown()

    asyncio.run(run())


def test_sleep_ends_what_runs_holds_what_comes_and_wake_up_resumes(tmp_path_factory):
    """vLLM's sleep on the busy loop: a running request is aborted (its client told), the workers
    release their KV cache; a request sent while asleep waits, a resume cannot start it, and once
    wake_up has restored everything it runs to the same answer as before."""
    import dataclasses

    model = build_tiny_llama(tmp_path_factory.mktemp("sleepy"))
    config = ClusterConfig(model=str(model), defaults=EngineSpec(num_gpu_blocks=64, max_num_seqs=4,
                                                                 max_model_len=256)).engine_configs()[0]
    plain = EngineCoreService(config, create_executor)
    try:
        with pytest.raises(ValueError, match="enable-sleep-mode"):
            plain.sleep(1)
        assert not plain.call_in_loop(plain.engine.is_paused)  # (a refused sleep does not pause)
    finally:
        plain.shutdown()
    service = EngineCoreService(dataclasses.replace(config, enable_sleep_mode=True), create_executor)
    try:
        prompt = list(range(3, 40))
        before, _, _ = _run(service, "before", prompt)
        _start(service, "running", list(range(50, 60)), 240)
        _until_running(service)
        service.sleep(level=1)
        assert service.metrics.sleep_level == 1  # (vllm:engine_sleep_state)
        assert _collect(service, 0.3)["running"][1] == FinishReason.ABORT
        assert service.call_in_loop(service.engine.is_sleeping)
        assert service.engine.executor.worker.runner.kv_caches == []
        _start(service, "during", prompt, 8)
        assert service.resume_generation() is False  # (asleep: it stays paused)
        assert "during" not in _collect(service, 0.3)
        assert service.wake_up(["weights"]) is True and "during" not in _collect(service, 0.2)
        assert service.wake_up(["kv_cache"]) is False and service.metrics.sleep_level == 0
        tokens, finish = _until_finished(service, "during")
        assert tokens == before and finish == FinishReason.LENGTH
        assert not service.call_in_loop(service.engine.is_paused)

        # Asleep with a request waiting: a "wait" pause and a second sleep return at once (nothing
        # can drain), a deeper level discards the weights, and a worker restart releases what the
        # new worker holds.
        from concurrent.futures import ThreadPoolExecutor

        service.sleep(level=1)
        _start(service, "waiting", prompt, 8)
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(service.pause_generation, "wait", True).result(timeout=30) is True
            pool.submit(service.sleep, 2, "wait").result(timeout=30)
        runner = service.engine.executor.worker.runner
        assert all(p.numel() == 0 for p in runner.model.parameters())
        service.call_in_loop(service._restart_executor, timeout=None)
        runner = service.engine.executor.worker.runner
        assert runner.kv_caches == [] and all(p.numel() == 0 for p in runner.model.parameters())
        assert service.wake_up() is False
        tokens, finish = _until_finished(service, "waiting")
        assert tokens == before and finish == FinishReason.LENGTH

        # A wake-up with nothing asleep leaves an operator's pause alone.
        service.pause_generation("abort")
        assert service.wake_up() is False and service.call_in_loop(service.engine.is_paused)
        assert service.resume_generation() is True
    finally:
        service.shutdown()


def test_a_model_mixing_full_and_windowed_layers_keeps_a_windows_worth_of_their_blocks(tmp_path):
    """Gemma 3's pattern (five windowed layers of 8 keys to one full layer): under the hybrid KV cache
    manager a block is a page of one shared layer-sized tensor, so the same memory holds six times the
    blocks; a 300-token prompt holds its full layer's blocks and at most four of each windowed
    group's, and gives transformers' tokens. --disable-hybrid-kv-cache-manager keeps one group."""
    import torch

    from engine_core.core.kv_cache_utils import AttentionWindow
    from engine_core.engine_core import EngineCore
    from tests.gpu_worker.utils import hf_greedy, load_hf, save_tiny_model

    model = save_tiny_model(tmp_path, "gemma3", num_hidden_layers=6, sliding_window_pattern=6,
                            max_position_embeddings=512)
    build_tokenizer().save_pretrained(model)
    spec = EngineSpec(kv_cache_memory_bytes=1 << 21, max_num_batched_tokens=32, max_num_seqs=2, max_model_len=512)
    [config] = ClusterConfig(model=str(model), defaults=spec).engine_configs()
    engine = EngineCore(config, create_executor(config))
    try:
        assert engine.model_info.kv_cache_groups == (None, *[AttentionWindow(8)] * 5)
        hybrid_blocks = engine.num_blocks
        prompt = [(11 * i + 5) % 256 for i in range(300)]
        manager = engine.scheduler.kv_cache_manager
        # (The blocks the windowed groups hold: the full group holds one a position.)
        tokens, held = _greedy_holding(engine, prompt, 6,
                                       lambda rid: manager.get_num_held_blocks(rid) - manager.get_num_blocks(rid))
        with torch.no_grad():
            assert tokens == hf_greedy(load_hf(model), prompt, 6)
        assert 0 < held <= 5 * 4  # each windowed group: (7 keys behind + 32 new) / 16, plus a block at each end
        # The prefix-aware router's snapshot of the cache holds group 0's hashes alone (the windowed groups'
        # (group, hash) keys would not decode as its events).
        snapshot = engine.kv_snapshot()
        msgspec.msgpack.decode(msgspec.msgpack.encode(snapshot), type=list[tuple[int, list[bytes]]])
        assert len(snapshot[1][1]) == (len(prompt) + 5) // 16  # (the full blocks of its 300 + 5 tokens computed)
    finally:
        engine.shutdown()
    plain = spec.model_copy(update={"disable_hybrid_kv_cache_manager": True})
    [config] = ClusterConfig(model=str(model), defaults=plain).engine_configs()
    engine = EngineCore(config, create_executor(config))
    try:
        assert engine.model_info.kv_cache_groups == () and engine.num_blocks == hybrid_blocks // 6
    finally:
        engine.shutdown()
