"""Engine actors on a real local Ray cluster: heterogeneous flags, aborts, worker faults."""

from __future__ import annotations

import time

import pytest

from cluster import LLM, SamplingParams
from cluster.config import ClusterConfig, EngineSpec
from cluster.launcher import start_engines, stop_engines
from engine_core.outputs import EngineCoreRequest
from tests.serve_cluster import wait_until_healthy

pytestmark = pytest.mark.slow

LONG = "The quick brown fox jumps over the lazy dog. " * 6


def test_two_engines_with_different_flags_both_serve_with_their_own_flags(ray_cluster, tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), num_engines=2, num_gpu_blocks=128,
              engine_overrides=[{"max_num_batched_tokens": 16, "long_prefill_token_threshold": 8, "max_num_seqs": 4},
                                {"max_num_batched_tokens": 512}])
    try:
        outs = llm.generate([LONG] * 6, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
        stats = sorted(llm.get_stats(), key=lambda s: s.engine_index)
    finally:
        llm.shutdown()
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    # Greedy is deterministic: both engines produced the same tokens for the same prompt.
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    latency, throughput = stats
    assert latency.num_requests_finished == 3 and throughput.num_requests_finished == 3
    assert latency.scheduler_config["max_num_seqs"] == 4
    assert latency.scheduler_config["long_prefill_token_threshold"] == 8
    assert throughput.scheduler_config["max_num_seqs"] == 256
    # In effect, not just reported: the latency engine never ran a pass above its 16-token budget.
    assert latency.max_step_num_scheduled_tokens <= 16 < throughput.max_step_num_scheduled_tokens


def _collect(actor, request_ids, timeout_s=60.0):
    import ray

    finals = {}
    deadline = time.monotonic() + timeout_s
    while len(finals) < len(request_ids) and time.monotonic() < deadline:
        eco = ray.get(actor.get_output.remote(0, 0.5))
        for out in eco.outputs:
            if out.finish_reason is not None:
                finals[out.request_id] = out
    return finals


def _request(rid, max_tokens=200):
    return EngineCoreRequest(request_id=rid, prompt_token_ids=list(range(3, 40)),
                             sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))


def test_abort_frees_kv_blocks(ray_cluster, tiny_model_dir):
    import ray

    config = ClusterConfig(model=str(tiny_model_dir), defaults=EngineSpec(num_gpu_blocks=64))
    [engine] = start_engines(config.engine_configs(), config.namespace)
    try:
        ray.get([engine.actor.add_request.remote(_request(f"r{i}", 500)) for i in range(4)])
        deadline = time.monotonic() + 30
        while ray.get(engine.actor.get_stats.remote()).num_free_blocks == 64 and time.monotonic() < deadline:
            time.sleep(0.05)
        busy = ray.get(engine.actor.get_stats.remote())
        assert busy.num_free_blocks < 64 and busy.num_unfinished_requests == 4
        ray.get(engine.actor.abort_requests.remote([f"r{i}" for i in range(4)]))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            stats = ray.get(engine.actor.get_stats.remote())
            if stats.num_unfinished_requests == 0:
                break
            time.sleep(0.05)
        assert stats.num_unfinished_requests == 0 and stats.num_free_blocks == 64
    finally:
        stop_engines([engine])


def test_killing_a_worker_errors_in_flight_requests_then_the_engine_recovers(ray_cluster, tiny_model_dir):
    import ray

    config = ClusterConfig(model=str(tiny_model_dir),
                           defaults=EngineSpec(num_gpu_blocks=64, executor_backend="ray"))
    [engine] = start_engines(config.engine_configs(), config.namespace)
    try:
        actor = engine.actor
        ray.get([actor.add_request.remote(_request(f"k{i}", 5000)) for i in range(2)])
        time.sleep(1.0)
        worker = ray.get(actor.__ray_call__.remote(lambda self: self.service.engine.executor.workers[0]))
        t0 = time.monotonic()
        ray.kill(worker, no_restart=True)
        finals = _collect(actor, ["k0", "k1"], timeout_s=30)
        assert time.monotonic() - t0 < 30, "in-flight requests hung"
        assert {f.finish_reason.name for f in finals.values()} == {"ERROR"} and len(finals) == 2
        # The engine brings its workers back and serves again.
        wait_until_healthy(actor)
        ray.get(actor.add_request.remote(_request("after", 5)))
        finals = _collect(actor, ["after"])
        assert finals["after"].finish_reason.name == "LENGTH"
        assert ray.get(actor.get_stats.remote()).num_free_blocks == 64
    finally:
        stop_engines([engine])


def test_an_engine_of_two_pipeline_stages_serves_http_and_comes_back_after_a_stage_dies(ray_cluster,
                                                                                         tiny_model_dir):
    """-pp 2 behind the router: the openai client gets transformers' greedy answer; a dead worker of
    the last stage (the first blocks waiting to hand it a pass) fails what was in flight, and the
    engine starts both stages again."""
    import openai
    import ray

    from tests.cluster.test_llm import hf_greedy
    from tests.serve_cluster import serve_cluster

    prompts = ["The quick brown fox jumps over the lazy dog. " * 3, "Berlin is the capital of Germany. Paris is"]
    expected = hf_greedy(tiny_model_dir, prompts, 12)
    config = ClusterConfig(model=str(tiny_model_dir), served_model_name="tiny", num_engines=1, defaults=EngineSpec(
        num_gpu_blocks=64, max_model_len=256, pipeline_parallel_size=2, num_cpus_per_worker=0.5))
    with serve_cluster(config) as served:
        client = openai.OpenAI(base_url=f"{served.base}/v1", api_key="unused", max_retries=0, timeout=60)

        def answers() -> list[list[int]]:
            out = client.completions.create(model="tiny", prompt=prompts, max_tokens=12, temperature=0, logprobs=0,
                                            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
            return [[int(t.removeprefix("token_id:")) for t in c.logprobs.tokens]
                    for c in sorted(out.choices, key=lambda c: c.index)]

        assert answers() == expected
        actor = served.engines[0].actor
        workers = ray.get(actor.__ray_call__.remote(lambda self: self.service.engine.executor.workers))
        assert len(workers) == 2
        ray.get(actor.add_request.remote(_request("k", 5000)))
        time.sleep(1.0)
        ray.kill(workers[1], no_restart=True)
        assert {f.finish_reason.name for f in _collect(actor, ["k"], timeout_s=30).values()} == {"ERROR"}
        wait_until_healthy(actor)
        assert answers() == expected
        assert served.stats()[0].num_free_blocks == 64


def _pid(actor) -> int:
    import os

    import ray

    return ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=10)


def _wait_for_a_new_process(actor, before: int) -> None:
    """Until Ray has restarted ``actor`` (another process than ``before`` answers) and it is ready
    (a kill or an exit is asynchronous: the old process may still answer for a moment)."""
    import ray

    deadline = time.monotonic() + 120
    while True:
        try:
            if _pid(actor) != before:
                ray.get(actor.ready.remote(), timeout=30)
                return
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            pass
        assert time.monotonic() < deadline, "the engine actor did not come back"
        time.sleep(0.5)


def test_an_engine_whose_workers_cannot_restart_is_restarted_by_ray(ray_cluster, tiny_model_dir):
    """A failed step whose in-process restart fails too (as on a GPU whose CUDA context an illegal
    access poisoned): the actor's process exits, Ray starts a new one, and it serves again."""
    import os

    import ray

    config = ClusterConfig(model=str(tiny_model_dir), defaults=EngineSpec(num_gpu_blocks=64))
    [engine] = start_engines(config.engine_configs(), config.namespace)
    actor = engine.actor

    def poison(actor_self) -> int:
        executor = actor_self.service.engine.executor

        def fail(*args):
            raise RuntimeError("injected: an illegal memory access")

        def cannot_restart():
            raise RuntimeError("injected: the CUDA context is unusable")

        executor.worker.runner._forward = fail
        executor.restart = cannot_restart
        return os.getpid()

    try:
        before = ray.get(actor.__ray_call__.remote(poison))
        ray.get(actor.add_request.remote(_request("doomed", 5)))
        _wait_for_a_new_process(actor, before)
        wait_until_healthy(actor)
        ray.get(actor.add_request.remote(_request("after", 5)))
        assert _collect(actor, ["after"])["after"].finish_reason.name == "LENGTH"
    finally:
        stop_engines([engine])


def test_engine_compute_threads_run_at_lower_priority_than_its_io(ray_cluster, tiny_model_dir):
    import ray

    config = ClusterConfig(model=str(tiny_model_dir), defaults=EngineSpec(num_gpu_blocks=16, engine_niceness=3,
                                                                         max_model_len=256))
    [engine] = start_engines(config.engine_configs(), config.namespace)
    try:
        address = ray.get(engine.actor.channel_address.remote())  # the channel runs on the actor's event loop
        assert address.port > 0
        niceness = ray.get(engine.actor.thread_niceness.remote())
        # The busy loop steps the model; the event loop serving the request channel and actor calls
        # keeps the process's priority (it once inherited the busy loop's, through the constructor).
        assert niceness["busy_loop"] == niceness["event_loop"] + 3
    finally:
        stop_engines([engine])


def test_an_embedding_engine_refuses_generation_without_hanging_its_client(ray_cluster, tiny_model_dir):
    """Generation asked of a runner-pooling engine actor is refused when it is admitted, to the
    caller (it used to be dropped inside the engine loop, leaving the caller waiting forever)."""
    import ray

    config = ClusterConfig(model=str(tiny_model_dir), defaults=EngineSpec(num_gpu_blocks=64, runner="pooling"))
    [engine] = start_engines(config.engine_configs(), config.namespace)
    try:
        with pytest.raises(ValueError, match="is an embedding model"):
            ray.get(engine.actor.add_request.remote(_request("a", 4)))
        assert ray.get(engine.actor.get_stats.remote()).num_unfinished_requests == 0
    finally:
        stop_engines([engine])


def test_an_engine_restarted_while_paused_comes_back_paused(ray_cluster, tiny_model_dir):
    """/pause is recorded outside the engine actor: an actor that dies and is restarted by Ray while
    paused comes back paused (and serves again after resume); one restarted after resume, or a new
    engine of the same name, starts unpaused."""
    import ray

    config = ClusterConfig(model=str(tiny_model_dir), defaults=EngineSpec(num_gpu_blocks=64))

    def restart(actor) -> None:
        """Kill the actor for Ray to restart it; return once the new process answers."""
        before = _pid(actor)
        ray.kill(actor, no_restart=False)
        _wait_for_a_new_process(actor, before)

    [engine] = start_engines(config.engine_configs(), config.namespace)
    try:
        ray.get(engine.actor.pause_generation.remote("abort"))
        restart(engine.actor)
        assert ray.get(engine.actor.is_paused.remote())
        ray.get(engine.actor.resume.remote())
        ray.get(engine.actor.add_request.remote(_request("after", 5)))
        assert _collect(engine.actor, ["after"])["after"].finish_reason.name == "LENGTH"
        restart(engine.actor)
        assert not ray.get(engine.actor.is_paused.remote())
        ray.get(engine.actor.pause_generation.remote("keep"))
    finally:
        stop_engines([engine])
    [engine] = start_engines(config.engine_configs(), config.namespace)
    try:
        assert not ray.get(engine.actor.is_paused.remote())
    finally:
        stop_engines([engine])


def test_an_llm_dropped_without_shutdown_stops_its_engines(ray_cluster, tiny_model_dir):
    """`del llm` (a script looping over models) frees the engines' names and resources: the next
    LLM starts under the same names."""
    import gc

    from engine_core.engine_actor import named_actor

    llm = LLM(model=str(tiny_model_dir), num_engines=2, num_gpu_blocks=64)
    names = [h.name for h in llm._handles]
    del llm
    gc.collect()
    assert all(named_actor(name, "llm-cluster") is None for name in names)
    again = LLM(model=str(tiny_model_dir), num_engines=2, num_gpu_blocks=64)
    try:
        assert again.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    finally:
        again.shutdown()
