"""Pipeline parallelism on the same work: one worker vs two stages, passes one at a time vs overlapped.

One engine over a random Llama (``--layers`` x ``--hidden``, CPU) on a local Ray, its workers Ray
actors. The same requests (``--requests`` prompts of ``--prompt`` tokens, ``--max-tokens`` each, all
at once) run on, one configuration after another, rounds alternating:
  pp1         one worker holding every layer, with ``--threads`` torch threads;
  pp2-serial  two stages of one worker each (``--threads`` / 2 threads each), one pass in flight:
              a stage idles while the other runs (what pipeline parallelism costs without overlap);
  pp2         the same two stages with two passes in flight (vLLM's batch queue): each stage runs
              one pass while the other stage runs the next.
Prints wall time, output tokens/s and TTFT p50 per configuration, each as a ratio to pp1. On a GPU
cluster the reason for stages is a model larger than one GPU (or node); this shows what the
overlap buys back.
Usage: python benchmarks/bench_pipeline_parallel.py [--rounds 2] [--requests 16] [--prompt 256]
       [--max-tokens 32] [--layers 8] [--hidden 512] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make_engine(model_dir: Path, pp: int, threads: int, overlap: bool, args: argparse.Namespace):
    from engine_core.config import EngineConfig, SchedulerConfig
    from engine_core.engine_core import EngineCore
    from gpu_worker.executor import RayWorkerGroupExecutor

    config = EngineConfig(model=str(model_dir), pipeline_parallel_size=pp, executor_backend="ray",
                          num_cpus_per_worker=max(1, threads // pp), num_gpu_blocks=args.requests * 40,
                          scheduler=SchedulerConfig(max_model_len=args.prompt + args.max_tokens + 16,
                                                    max_num_batched_tokens=args.batch_tokens))
    executor = RayWorkerGroupExecutor(config)
    if not overlap:  # (the pipeline without its batch queue: one pass at a time)
        executor.__class__ = type("SerialPipeline", (RayWorkerGroupExecutor,), {"max_concurrent_batches": 1})
    return EngineCore(config, executor)


def run(engine, args: argparse.Namespace, seed: int) -> dict[str, float]:
    import random

    from engine_core.outputs import EngineCoreRequest
    from engine_core.sampling_params import SamplingParams

    rng = random.Random(seed)
    started = time.perf_counter()
    first: dict[str, float] = {}
    tokens = 0
    ids = [f"r{seed}-{i}" for i in range(args.requests)]
    for rid in ids:
        engine.add_request(EngineCoreRequest(
            request_id=rid, prompt_token_ids=[rng.randrange(5, 200) for _ in range(args.prompt)],
            sampling_params=SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)))
    finished = 0
    while finished < len(ids):
        for eco in engine.step().values():
            for out in eco.outputs:
                tokens += len(out.new_token_ids)
                first.setdefault(out.request_id, time.perf_counter() - started)
                finished += out.finish_reason is not None
    while engine.has_work():
        engine.step()
    wall = time.perf_counter() - started
    return {"wall": wall, "tok_s": tokens / wall, "ttft_p50": statistics.median(first.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch-tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import ray

    from tests.tiny_model import build_tiny_llama

    model_dir = build_tiny_llama(Path(tempfile.mkdtemp(prefix="bench-pp-")), num_layers=args.layers,
                                 hidden=args.hidden, heads=8, kv_heads=4, max_positions=4096)
    # (Logical CPUs for all three engines at once; they run one after another.)
    ray.init(num_cpus=3 * args.threads, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    configs = {"pp1": (1, True), "pp2-serial": (2, False), "pp2": (2, True)}
    engines = {name: make_engine(model_dir, pp, args.threads, overlap, args) for name, (pp, overlap) in configs.items()}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    try:
        for engine in engines.values():  # (warm-up: first passes allocate)
            run(engine, argparse.Namespace(**{**vars(args), "requests": 2, "max_tokens": 2}), seed=999)
        for round_index in range(args.rounds):
            for name, engine in engines.items():
                results[name].append(run(engine, args, seed=round_index))
    finally:
        for engine in engines.values():
            engine.shutdown()
        ray.shutdown()

    print(f"\n{args.requests} requests x {args.prompt}-token prompts x {args.max_tokens} tokens, random Llama "
          f"{args.layers}x{args.hidden}, CPU, {args.threads} threads in all, {args.rounds} rounds (medians)\n")
    print(f"{'config':<12}{'wall s':>10}{'out tok/s':>12}{'TTFT p50 s':>12}   ratio to pp1 (wall, tok/s, TTFT)")
    base = {k: statistics.median(r[k] for r in results["pp1"]) for k in ("wall", "tok_s", "ttft_p50")}
    for name in configs:
        med = {k: statistics.median(r[k] for r in results[name]) for k in ("wall", "tok_s", "ttft_p50")}
        print(f"{name:<12}{med['wall']:>10.2f}{med['tok_s']:>12.1f}{med['ttft_p50']:>12.3f}   "
              f"{med['wall'] / base['wall']:.2f}x, {med['tok_s'] / base['tok_s']:.2f}x, "
              f"{med['ttft_p50'] / base['ttft_p50']:.2f}x")


if __name__ == "__main__":
    main()
