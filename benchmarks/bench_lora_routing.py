"""LoRA affinity in the router vs routing that ignores adapters, on the same engines, in one run.

Two engines (tiny random Llama, CPU), each allowed ``--max-loras`` adapters per batch, serve
requests spread at random over ``--adapters`` LoRA adapters at a fixed concurrency. The requests go
through the router's own serving core in this process (``build_serving``: the policy chooses, the
engine client sends; no HTTP), once per policy, the rounds alternating so machine noise hits all
alike:
  affinity      least_loaded as served: an adapter's requests go where it runs (within the load
                margin), a new adapter where a slot is free
  least_loaded  power of two choices on load alone (the same policy without max_loras)
  round_robin   in turn
An engine holds a request of one adapter more than ``max_loras`` back until one drains: routing
that spreads every adapter over every engine makes each engine take turns between them.
Prints output tokens/s, TTFT and end-to-end p50/p99 per policy, and each one's ratio to affinity.
Usage: python benchmarks/bench_lora_routing.py [--requests 96] [--concurrency 8] [--adapters 2]
       [--max-loras 1] [--max-tokens 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def run_round(serving, client, loras, n: int, concurrency: int, max_tokens: int, ids) -> dict[str, list[float]]:
    from engine_core.outputs import EngineCoreRequest
    from engine_core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ttft: list[float] = []
    e2e: list[float] = []
    remaining = iter(range(n))

    async def one() -> None:
        number = next(ids)
        lora = loras[random.Random(number).randrange(len(loras))]  # (not in step with round robin's turns)
        tokens = [3 + (number * 7 + j) % 300 for j in range(12)]  # (no shared prefix: routing is by load and adapter)
        t0 = time.perf_counter()
        engine = serving.choose_engine(tokens, None, lora=lora)
        request = EngineCoreRequest(request_id=f"bench-{number}", prompt_token_ids=tokens, sampling_params=params,
                                    client_index=client.client_index, arrival_time=time.time(), lora_request=lora)
        first = None
        async for out in client.stream(engine, request):
            if first is None and out.new_token_ids:
                first = time.perf_counter() - t0
        ttft.append(first if first is not None else time.perf_counter() - t0)
        e2e.append(time.perf_counter() - t0)

    async def worker() -> None:
        for _ in remaining:
            await one()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"ttft": ttft, "e2e": e2e}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=96, help="Per policy, over all rounds.")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--adapters", type=int, default=2)
    parser.add_argument("--max-loras", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import ray

    from cluster.app import router_deployment, start_cluster, stop_cluster
    from cluster.config import ClusterConfig, EngineSpec
    from engine_core.outputs import LoRARequest
    from router.deployment import build_serving
    from router.routing import LeastLoadedPolicy, RoundRobinPolicy
    from tests.lora_adapters import save_adapter
    from tests.tiny_model import build_tiny_llama

    os.environ.setdefault("LLM_CLUSTER_ENGINE_HOST", "127.0.0.1")
    scratch = Path(tempfile.mkdtemp(prefix="bench-lora-routing-"))
    model_dir = build_tiny_llama(scratch / "model")
    paths = [save_adapter(model_dir, scratch / f"adapter{i}", seed=100 + i) for i in range(args.adapters)]
    ray.init(include_dashboard=False, namespace="bench-lora-routing", log_to_driver=False)
    config = ClusterConfig(model=str(model_dir), served_model_name="tiny", num_engines=2,
                           namespace="bench-lora-routing", routing_policy="least_loaded", enable_lora=True,
                           max_loras=args.max_loras,
                           lora_modules=[f"adapter{i}={p}" for i, p in enumerate(paths)],
                           defaults=EngineSpec(num_gpu_blocks=512, max_model_len=256))
    # (ids as the engines register --lora-modules: 1, 2, ... in order)
    loras = [LoRARequest(f"adapter{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    engines = start_cluster(config)
    try:
        router_config = router_deployment(config)._bound_deployment.init_args[0]

        async def run() -> dict[str, dict[str, list[float]]]:
            serving, client = await build_serving(router_config)
            await client.wait_connected()
            policies = {"affinity": serving.policy, "least_loaded": LeastLoadedPolicy(),
                        "round_robin": RoundRobinPolicy()}
            results = {name: {"ttft": [], "e2e": [], "wall": [0.0]} for name in policies}
            ids = itertools.count()
            serving.policy = policies["affinity"]
            await run_round(serving, client, loras, 8, 4, 4, ids)  # warm-up
            per_round = max(1, args.requests // args.rounds)
            for _ in range(args.rounds):
                for name, policy in policies.items():
                    serving.policy = policy
                    t0 = time.perf_counter()
                    out = await run_round(serving, client, loras, per_round, args.concurrency, args.max_tokens, ids)
                    results[name]["wall"][0] += time.perf_counter() - t0
                    results[name]["ttft"] += out["ttft"]
                    results[name]["e2e"] += out["e2e"]
            await client.close()
            return results

        results = asyncio.run(run())
    finally:
        stop_cluster(config, engines)
        ray.shutdown()
    print(f"\n{args.requests // args.rounds * args.rounds} requests per policy x {args.max_tokens} tokens, concurrency "
          f"{args.concurrency}, {args.adapters} adapters at random, 2 engines with max_loras={args.max_loras}\n")
    print(f"{'policy':14} {'tok/s':>8} {'vs affinity':>12} {'TTFT p50':>9} {'TTFT p99':>9} {'E2E p50':>8} "
          f"{'E2E p99':>8}   (ms)")
    base = None
    for name, r in results.items():
        tok_s = len(r["e2e"]) * args.max_tokens / r["wall"][0]
        base = base or tok_s
        print(f"{name:14} {tok_s:8.1f} {tok_s / base:11.2f}x {1e3 * statistics.median(r['ttft']):9.1f} "
              f"{1e3 * pct(r['ttft'], 0.99):9.1f} {1e3 * statistics.median(r['e2e']):8.1f} "
              f"{1e3 * pct(r['e2e'], 0.99):8.1f}")


if __name__ == "__main__":
    main()
