"""Scheduler cost per step on a large synthetic trace, with a fake model (no forward pass).

2,000 requests arrive at t=0; prompts are uniform in [200, 1000] tokens and start with one of 10
shared 128-token prefixes; each generates 128 tokens (ignore_eos). max_num_seqs 1024,
max_num_batched_tokens 8192, block 16, 100,000 blocks; prefix caching on and off.

The fake model samples one token for each request whose prefill completes in the pass.
Usage: python benchmarks/bench_scheduler.py [--requests N]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

from engine_core.config import CacheConfig, SchedulerConfig
from engine_core.outputs import ModelRunnerOutput
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from engine_core.sched.output import SchedulerOutput
from engine_core.sched.scheduler import Scheduler

# vLLM's own scheduler on this trace, as measured on these machines and quoted in our issue #2
# (not re-measured here: vLLM cannot be installed beside our CPU torch).
VLLM_SCHEDULE_MS = 30.0
VLLM_UPDATE_MS = 13.0


def make_trace(num_requests: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(32000) for _ in range(128)] for _ in range(10)]
    trace = []
    for _ in range(num_requests):
        length = rng.randint(200, 1000)
        prompt = rng.choice(prefixes) + [rng.randrange(32000) for _ in range(length - 128)]
        trace.append((prompt, 128))
    return trace


def fake_output(scheduler: Scheduler, so: SchedulerOutput) -> ModelRunnerOutput:
    req_ids = list(so.num_scheduled_tokens)
    requests = scheduler.requests
    sampled = []
    for req_id in req_ids:
        req = requests[req_id]
        sampled.append([11] if req.num_computed_tokens >= req.num_tokens else [])
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


def run(trace: list[tuple[list[int], int]], enable_prefix_caching: bool) -> dict[str, float]:
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=8192, max_model_len=4096),
        CacheConfig(block_size=16, num_blocks=100_000, enable_prefix_caching=enable_prefix_caching),
        log_stats=True)
    for i, (prompt, max_tokens) in enumerate(trace):
        scheduler.add_request(Request(f"req-{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                      eos_token_id=2, arrival_time=0.0))
    schedule_us: list[float] = []
    update_us: list[float] = []
    num_reqs: list[int] = []
    gc.disable()
    try:
        while scheduler.has_unfinished_requests():
            t0 = time.perf_counter()
            so = scheduler.schedule()
            t1 = time.perf_counter()
            mro = fake_output(scheduler, so)
            t2 = time.perf_counter()
            scheduler.update_from_output(so, mro)
            t3 = time.perf_counter()
            schedule_us.append((t1 - t0) * 1e6)
            update_us.append((t3 - t2) * 1e6)
            num_reqs.append(len(so.num_scheduled_tokens))
    finally:
        gc.enable()
    busy = [i for i, n in enumerate(num_reqs) if n >= 700]

    def pct(xs: list[float], q: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]

    return {
        "steps": len(schedule_us),
        "sched_mean": statistics.fmean(schedule_us), "sched_p50": pct(schedule_us, 0.5),
        "sched_p99": pct(schedule_us, 0.99),
        "upd_mean": statistics.fmean(update_us), "upd_p50": pct(update_us, 0.5), "upd_p99": pct(update_us, 0.99),
        "us_per_req": sum(schedule_us) / max(1, sum(num_reqs)),
        "upd_us_per_req": sum(update_us) / max(1, sum(num_reqs)),
        "busy_steps": len(busy),
        "busy_reqs": statistics.fmean(num_reqs[i] for i in busy) if busy else 0.0,
        "busy_sched_ms": statistics.fmean(schedule_us[i] for i in busy) / 1000 if busy else 0.0,
        "busy_upd_ms": statistics.fmean(update_us[i] for i in busy) / 1000 if busy else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    trace = make_trace(args.requests)
    print(f"{args.requests} requests, prompts 200-1000 tokens (10 shared 128-token prefixes), 128 outputs\n")
    header = (f"{'prefix caching':<15}{'steps':>7}{'schedule mean/p50/p99 us':>28}"
              f"{'update mean/p50/p99 us':>26}{'us/sched req':>14}")
    print(header)
    results = {}
    for caching in (True, False):
        r = run(trace, caching)
        results[caching] = r
        print(f"{'on' if caching else 'off':<15}{r['steps']:>7}"
              f"{r['sched_mean']:>12.0f}/{r['sched_p50']:.0f}/{r['sched_p99']:.0f}".ljust(50)
              + f"{r['upd_mean']:>10.0f}/{r['upd_p50']:.0f}/{r['upd_p99']:.0f}".ljust(26)
              + f"{r['us_per_req']:>10.2f}")
    print("\nSteps with >= 700 scheduled requests (the regime the vLLM figures describe):")
    print(f"{'prefix caching':<15}{'steps':>7}{'reqs/step':>11}{'schedule ms':>13}{'vs vLLM 30 ms':>15}"
          f"{'update ms':>11}{'vs vLLM 13 ms':>15}")
    for caching, r in results.items():
        if not r["busy_steps"]:
            continue
        print(f"{'on' if caching else 'off':<15}{r['busy_steps']:>7}{r['busy_reqs']:>11.0f}"
              f"{r['busy_sched_ms']:>13.2f}{VLLM_SCHEDULE_MS / r['busy_sched_ms']:>14.1f}x"
              f"{r['busy_upd_ms']:>11.2f}{VLLM_UPDATE_MS / r['busy_upd_ms']:>14.1f}x")


if __name__ == "__main__":
    main()
