"""vLLM's periodic engine stats line (LoggingStatLogger), and our packages' log lines in Ray's
processes (whose root logger drops INFO)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

from engine_core.config import EngineConfig, SpeculativeConfig
from engine_core.metrics import EngineMetrics
from engine_core.stats_logger import EngineStatsLogger, stats_interval


def _metrics(**config) -> EngineMetrics:
    engine = EngineConfig(**config)
    return EngineMetrics(engine, engine.scheduler, "tiny", num_blocks=100)


def test_the_line_gives_the_intervals_throughput_and_the_engines_state():
    metrics = _metrics(engine_index=3)
    stats = EngineStatsLogger(metrics, 3, now=100.0)
    metrics.counters.update(prompt_tokens=8000, generation_tokens=1000, prefix_queries=400, prefix_hits=100)
    metrics.gauges.update(running=6, waiting=2, kv_usage=0.031)
    level, [line] = stats.lines(110.0)
    assert level == logging.INFO
    assert line == ("Engine 003: Avg prompt throughput: 800.0 tokens/s, Avg generation throughput: 100.0 tokens/s, "
                    "Running: 6 reqs, Waiting: 2 reqs, GPU KV cache usage: 3.1%, Prefix cache hit rate: 25.0%")
    # The next interval counts from the last line; one more INFO line once idle, then DEBUG.
    metrics.gauges.update(running=0, waiting=0)
    metrics.counters.update(generation_tokens=1500)
    level, [line] = stats.lines(120.0)
    assert level == logging.INFO and "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 50.0" in line
    assert stats.lines(130.0)[0] == logging.INFO and stats.lines(140.0)[0] == logging.DEBUG
    # Requests held without progress (a paused engine) stay at DEBUG, as vLLM judges by throughput.
    metrics.gauges.update(running=5, waiting=3)
    assert stats.lines(150.0)[0] == logging.DEBUG


def test_kv_offloading_adds_the_external_hit_rate():
    engine = EngineConfig(kv_offloading_size=1.0)
    metrics = EngineMetrics(engine, engine.scheduler, "tiny", num_blocks=100, num_offload_blocks=50)
    stats = EngineStatsLogger(metrics, 0, now=0.0)
    # 600 tokens looked up in the host tier, 150 found there.
    metrics.counters.update(prompt_tokens=1000)
    metrics.offload.update(external_queries=600, external_hits=150)
    _, [line] = stats.lines(10.0)
    assert line.endswith(", External prefix cache hit rate: 25.0%")
    metrics.offload.update(external_queries=1000, external_hits=150)
    assert stats.lines(20.0)[1][0].endswith(", External prefix cache hit rate: 0.0%")  # (the interval's)
    assert "External" not in _line_without_offloading()


def _line_without_offloading() -> str:
    metrics = _metrics()
    stats = EngineStatsLogger(metrics, 0, now=0.0)
    metrics.counters.update(prompt_tokens=10)
    return stats.lines(10.0)[1][0]


def test_speculative_decoding_adds_the_acceptance_line():
    metrics = _metrics(speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                                                            prompt_lookup_max=4, prompt_lookup_min=2))
    stats = EngineStatsLogger(metrics, 0, now=0.0)
    assert len(stats.lines(10.0)[1]) == 1  # (no drafts in the interval)
    metrics.spec.update(drafts=10, draft_tokens=30, accepted_tokens=15)
    metrics.spec_accepted_per_pos[:] = [8, 5, 2]
    metrics.counters.update(generation_tokens=25)
    _, [_, spec] = stats.lines(20.0)
    assert spec == ("Engine 000: SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 1.50 "
                    "tokens/s, Drafted throughput: 3.00 tokens/s, Accepted: 15 tokens, Drafted: 30 tokens, "
                    "Per-position acceptance rate: 0.800, 0.500, 0.200, Avg Draft acceptance rate: 50.0%")
    # A read that caught the busy loop between two counters: no division by zero, no rate above 100%.
    metrics.spec.update(draft_tokens=33)
    metrics.counters.update(prefix_hits=5)
    _, lines = stats.lines(30.0)
    assert len(lines) == 1 and "Prefix cache hit rate: 0.0%" in lines[0]


def test_a_failing_line_does_not_end_the_lines(caplog):
    metrics = _metrics()
    stats = EngineStatsLogger(metrics, 0, now=0.0)
    calls = []

    def clock() -> float:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        if len(calls) >= 3:
            stopped.set()
        return float(len(calls))

    stopped = threading.Event()
    with caplog.at_level(logging.DEBUG, logger="engine_core.stats_logger"):  # (idle lines go to DEBUG)
        stats.run(stopped, 0.001, clock)
    assert "the stats line failed" in caplog.text and len(calls) == 3 and "Engine 000:" in caplog.text


def test_the_interval_is_vllms_variable(monkeypatch):
    assert stats_interval() == 10.0
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "2.5")
    assert stats_interval() == 2.5
    for bad in ("0", "x"):
        monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", bad)
        assert stats_interval() == 10.0


def test_a_serving_engine_logs_the_line_and_one_without_stats_does_not(tmp_path, monkeypatch, caplog):
    import dataclasses

    from cluster.config import ClusterConfig, EngineSpec
    from engine_core.engine_actor import EngineCoreService
    from engine_core.outputs import EngineCoreRequest
    from engine_core.sampling_params import SamplingParams
    from gpu_worker.executor import create_executor
    from tests.tiny_model import build_tiny_llama

    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "0.05")
    config = ClusterConfig(model=str(build_tiny_llama(tmp_path)),
                           defaults=EngineSpec(num_gpu_blocks=32, max_model_len=128)).engine_configs()[0]
    for log_stats, line in ((True, True), (False, True), (True, False)):
        caplog.clear()
        service = EngineCoreService(dataclasses.replace(config, log_stats=log_stats, log_stats_line=line),
                                    create_executor)
        log_stats = log_stats and line
        try:
            with caplog.at_level(logging.INFO, logger="engine_core.stats_logger"):
                service.add_request(EngineCoreRequest(request_id="r", prompt_token_ids=[3, 4, 5], client_index=0,
                                                      sampling_params=SamplingParams(max_tokens=4, ignore_eos=True)))
                # (Twenty intervals without stats: a line would have come; with them, wait for it.)
                deadline = time.monotonic() + (20 if log_stats else 1)
                while "Avg generation throughput" not in caplog.text and time.monotonic() < deadline:
                    time.sleep(0.05)
        finally:
            service.shutdown()
        assert ("Engine 000: Avg prompt throughput" in caplog.text) is log_stats
        deadline = time.monotonic() + 5  # (shut down: its stats thread ends within an interval)
        while any(t.name == "engine-0-stats-log" for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(t.name == "engine-0-stats-log" for t in threading.enumerate())


def test_our_info_lines_reach_stderr_in_a_process_whose_root_logger_drops_them():
    script = ("import logging\n"
              "from engine_core.log_setup import configure_actor_logging\n"
              "logging.getLogger('engine_core.x').info('before')\n"
              "configure_actor_logging(); configure_actor_logging()\n"
              "logging.getLogger('engine_core.x').info('after')\n"
              "logging.getLogger('router.y').debug('hidden')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("INFO ") and lines[0].endswith("[engine_core.x] after")
    debug = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True,
                           env={**os.environ, "VLLM_LOGGING_LEVEL": "debug"})
    assert "hidden" in debug.stderr


def test_the_logging_variables_travel_to_the_actors(monkeypatch):
    from cluster.app import router_deployment
    from cluster.config import ClusterConfig
    from engine_core.log_setup import logging_runtime_env

    for name in ("VLLM_LOGGING_LEVEL", "VLLM_LOG_STATS_INTERVAL"):
        monkeypatch.delenv(name, raising=False)
    assert logging_runtime_env() == {}
    assert "runtime_env" not in router_deployment(ClusterConfig(model="m"))._bound_deployment.ray_actor_options
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "30")
    assert logging_runtime_env() == {"env_vars": {"VLLM_LOG_STATS_INTERVAL": "30"}}
    options = router_deployment(ClusterConfig(model="m"))._bound_deployment.ray_actor_options
    assert options["runtime_env"] == logging_runtime_env()
