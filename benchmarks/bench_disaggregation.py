"""Prefill/decode disaggregation vs the same engines serving requests whole, on the same work.

Two engines (a random Llama large enough that a long prompt takes a while to compute, CPU) behind
the router, over HTTP. The work mixes two kinds of streamed completions:
  chat   short prompts (``--chat-prompt`` tokens) decoding ``--chat-tokens`` tokens each, from
         ``--chat-clients`` clients one request after another: their inter-token latency is what
         users feel, and what a long prefill in the same engine pass holds up;
  long   long prompts (``--long-prompt`` tokens, each its own) asking for ``--long-tokens`` tokens,
         arriving every ``--long-interval`` seconds: their time to first token.
Configurations, started one after another, rounds alternating:
  whole  both engines serve requests whole, least_loaded routing (the usual deployment);
  p/d    engine 0 computes every prompt (kv_producer), engine 1 decodes (kv_consumer), reading each
         prompt's KV from engine 0 (--num-prefill-engines 1);
  p/d>N  the same, selective: only prompts of more than N tokens (--pd-threshold, llm-d's selective
         P/D) are computed on engine 0, the chats' short ones where they are decoded.
Prints per configuration: chat inter-token latency p50/p99 and time per output token, long TTFT
p50/p99, output tokens/s, and each figure's ratio to whole.
Usage: python benchmarks/bench_disaggregation.py [--rounds 2] [--long-requests 12] [--long-interval 0.5]
       [--long-prompt 1024] [--chat-clients 4] [--pd-threshold 256]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
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
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def stream_completion(http, base: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float], int]:
    """(time to first token, gaps between the later tokens, tokens) of one streamed completion."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "logprobs": 0}  # (logprobs: every token is a chunk, whatever its text)
    t0 = time.perf_counter()
    times: list[float] = []
    async with http.stream("POST", f"{base}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choice = (chunk.get("choices") or [{}])[0]
            n = len((choice.get("logprobs") or {}).get("tokens") or [])
            now = time.perf_counter()
            times += [now] * n
    if not times:
        raise RuntimeError("a completion streamed no token")
    return times[0] - t0, [b - a for a, b in itertools.pairwise(times)], len(times)


async def run_round(base: str, args: argparse.Namespace, seed: int) -> dict[str, list[float]]:
    import httpx

    rng = random.Random(seed)
    out: dict[str, list[float]] = {"itl": [], "tpot": [], "long_ttft": [], "tokens": [], "wall": []}
    done = asyncio.Event()
    limits = httpx.Limits(max_connections=args.chat_clients + args.long_requests + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        async def chat_client(k: int) -> None:
            while not done.is_set():
                prompt = [3 + rng.randrange(300) for _ in range(args.chat_prompt)]
                _, gaps, n = await stream_completion(http, base, prompt, args.chat_tokens)
                out["itl"] += gaps
                out["tpot"].append(statistics.fmean(gaps) if gaps else 0.0)
                out["tokens"].append(n)

        async def long_request(k: int) -> None:
            await asyncio.sleep(k * args.long_interval)
            prompt = [3 + rng.randrange(300) for _ in range(args.long_prompt)]
            ttft, _, n = await stream_completion(http, base, prompt, args.long_tokens)
            out["long_ttft"].append(ttft)
            out["tokens"].append(n)

        t0 = time.perf_counter()
        chats = [asyncio.ensure_future(chat_client(k)) for k in range(args.chat_clients)]
        await asyncio.gather(*(long_request(k) for k in range(args.long_requests)))
        done.set()
        await asyncio.gather(*chats)
        out["wall"].append(time.perf_counter() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--long-requests", type=int, default=12)
    parser.add_argument("--long-interval", type=float, default=0.5)
    parser.add_argument("--long-prompt", type=int, default=1024)
    parser.add_argument("--long-tokens", type=int, default=8)
    parser.add_argument("--chat-clients", type=int, default=4)
    parser.add_argument("--chat-prompt", type=int, default=32)
    parser.add_argument("--chat-tokens", type=int, default=48)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--pd-threshold", type=int, default=256)
    args = parser.parse_args()

    import ray

    from cluster.config import ClusterConfig, EngineSpec, prefill_decode_overrides
    from tests.serve_cluster import serve_cluster
    from tests.tiny_model import build_tiny_llama

    os.environ.setdefault("LLM_CLUSTER_ENGINE_HOST", "127.0.0.1")
    model_dir = build_tiny_llama(Path(tempfile.mkdtemp(prefix="bench-pd-")), num_layers=args.layers,
                                 hidden=args.hidden, heads=8, kv_heads=4, max_positions=4096)
    ray.init(include_dashboard=False, namespace="llm-cluster", log_to_driver=False)
    spec = EngineSpec(num_gpu_blocks=1024, max_model_len=2048, max_num_batched_tokens=2048)
    configs = {
        "whole": ClusterConfig(model=str(model_dir), served_model_name="bench", num_engines=2,
                               routing_policy="least_loaded", defaults=spec, enable_access_log=False),
        "p/d": ClusterConfig(model=str(model_dir), served_model_name="bench", num_engines=2,
                             routing_policy="least_loaded", defaults=spec, enable_access_log=False,
                             engines=prefill_decode_overrides(1, 2, None, [])),
    }
    configs[f"p/d>{args.pd_threshold}"] = configs["p/d"].model_copy(update={"pd_prefill_threshold": args.pd_threshold})
    results: dict[str, dict[str, list[float]]] = {name: {} for name in configs}
    for r in range(args.rounds):
        for name, config in configs.items():
            with serve_cluster(config) as served:
                asyncio.run(run_round(served.base, argparse.Namespace(**{**vars(args), "long_requests": 2,
                                                                         "chat_clients": 1}), seed=-1))  # warm-up
                got = asyncio.run(run_round(served.base, args, seed=r))
                for key, values in got.items():
                    results[name].setdefault(key, []).extend(values)
                if name != "whole":
                    stats = served.stats()
                    print(f"round {r}: {name} engine 0 sent {stats[0].kv_transfer_sent_blocks} KV blocks, engine 1 "
                          f"read {stats[1].kv_transfer_received_blocks} ({stats[1].kv_transfer_failures} failed)")
    ray.shutdown()

    rows = []
    for name, res in results.items():
        rows.append((name, pct(res["itl"], 0.5) * 1e3, pct(res["itl"], 0.99) * 1e3,
                     statistics.fmean(res["tpot"]) * 1e3, pct(res["long_ttft"], 0.5) * 1e3,
                     pct(res["long_ttft"], 0.99) * 1e3, sum(res["tokens"]) / sum(res["wall"])))
    print(f"\n2 engines ({args.layers} layers x {args.hidden}, CPU); per round {args.long_requests} prompts of "
          f"{args.long_prompt} tokens every {args.long_interval:g} s (x {args.long_tokens} tokens) beside "
          f"{args.chat_clients} chat clients ({args.chat_prompt}-token prompts x {args.chat_tokens} tokens); "
          f"{args.rounds} rounds\n")
    header = ("config", "chat ITL p50 ms", "chat ITL p99 ms", "chat TPOT ms", "long TTFT p50 ms",
              "long TTFT p99 ms", "out tok/s")
    print("".join(f"{h:>18}" for h in header))
    for row in rows:
        print(f"{row[0]:>18}" + "".join(f"{v:>18.2f}" for v in row[1:]))
    for row in rows[1:]:
        print(f"{row[0] + ' / whole':>18}" + "".join(f"{b / a:>18.2f}"
                                                    for a, b in zip(rows[0][1:], row[1:], strict=True)))


if __name__ == "__main__":
    main()
