"""Cost of metrics: engine step time with metrics on (scheduler stats + Prometheus recording) vs off.

Tiny random model, in-process engine, 64 requests x 32 output tokens; alternating runs of both
settings so machine noise hits both alike. Prints mean step time for each and the ratio.
Usage: python benchmarks/bench_metrics.py [--rounds 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.config import ClusterConfig, EngineSpec
from engine_core.engine_core import EngineCore
from engine_core.metrics import EngineMetrics
from engine_core.outputs import EngineCoreRequest
from engine_core.sampling_params import SamplingParams
from gpu_worker.executor import create_executor
from tests.tiny_model import build_tiny_llama


def run(engine: EngineCore, metrics: EngineMetrics | None, n: int, max_tokens: int, tag: str) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(n):
        added = engine.add_request(EngineCoreRequest(request_id=f"{tag}-{i}", prompt_token_ids=list(range(3, 40)),
                                                     sampling_params=params, arrival_time=time.time()))
        if metrics is not None and added is not None:
            metrics.on_request_added(added)
    steps = 0
    t0 = time.perf_counter()
    while engine.has_work():
        outputs = engine.step()
        if metrics is not None:
            stats = next((eco.scheduler_stats for eco in outputs.values() if eco.scheduler_stats), None)
            metrics.on_step(outputs, stats)
        steps += 1
    return (time.perf_counter() - t0) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    model_dir = build_tiny_llama(Path(tempfile.mkdtemp(prefix="bench-metrics-")))
    base = ClusterConfig(model=str(model_dir), defaults=EngineSpec(num_gpu_blocks=1024)).engine_configs()[0]
    engines = {}
    for on in (True, False):
        config = replace(base, log_stats=on)
        engine = EngineCore(config, create_executor(config))
        metrics = EngineMetrics(config, engine.scheduler_config, "tiny", engine.num_blocks) if on else None
        engines[on] = (engine, metrics)
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds + 1):
        # Alternate which setting goes first, so an order effect (warm caches) cancels out.
        for on in ((True, False) if r % 2 else (False, True)):
            t = run(*engines[on], args.requests, args.max_tokens, f"r{r}-{on}")
            if r:  # round 0 warms up
                times[on].append(t)
    on, off = statistics.fmean(times[True]), statistics.fmean(times[False])
    print(f"tiny model, {args.requests} requests x {args.max_tokens} tokens, {args.rounds} rounds each")
    print(f"mean step time, metrics on : {on * 1e3:.3f} ms")
    print(f"mean step time, metrics off: {off * 1e3:.3f} ms")
    print(f"overhead: {(on / off - 1) * 100:+.2f}%  (target < 2%)")


if __name__ == "__main__":
    main()
