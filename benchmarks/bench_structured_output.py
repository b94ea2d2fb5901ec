"""What structured output costs: the same batch with and without a JSON-schema constraint, in one run.

SmolLM2-135M-Instruct (a real 49,152-token vocabulary, so the per-pass bitmask is full size), one
in-process engine, 32 chat prompts asking for a JSON answer, greedy, up to 64 tokens. Rounds
alternate between the two settings so machine noise hits both alike. Prints generated tokens per
second and the engine's mean time per pass for each, their ratio, and the time to the first
grammar (xgrammar's import and tokenizer set-up included) and to a cached one.
Usage: python benchmarks/bench_structured_output.py [--num-prompts 32] [--max-tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from cluster import LLM, SamplingParams

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                           "population": {"type": "integer"}},
          "required": ["city", "country", "population"]}
CITIES = ["Paris", "Tokyo", "Lima", "Cairo", "Oslo", "Delhi", "Quito", "Rome"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    llm = LLM(model="SmolLM2-135M-Instruct", max_model_len=1024, max_num_seqs=args.num_prompts)
    conversations = [[{"role": "user", "content": f"Describe {CITIES[i % len(CITIES)]} as JSON with its city, "
                                                   "country and population."}] for i in range(args.num_prompts)]
    settings = {
        "free": SamplingParams(max_tokens=args.max_tokens, temperature=0),
        "json schema": SamplingParams(max_tokens=args.max_tokens, temperature=0, structured_output={"json": SCHEMA}),
    }
    engine = llm._engine
    step = engine.step
    step_times: list[float] = []

    def timed_step():
        t0 = time.perf_counter()
        out = step()
        step_times.append(time.perf_counter() - t0)
        return out

    engine.step = timed_step
    # The first grammar pays for xgrammar's import and the tokenizer's set-up; later ones hit the cache.
    first = {}
    for label in ("first grammar", "cached grammar"):
        t0 = time.perf_counter()
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, structured_output={"json": SCHEMA}), use_tqdm=False)
        first[label] = time.perf_counter() - t0
    llm.chat(conversations[:2], settings["free"], use_tqdm=False)  # warm-up

    results: dict[str, dict[str, list[float]]] = {name: {"tok/s": [], "pass ms": [], "tokens": []} for name in settings}
    valid = 0
    for _ in range(args.rounds):
        for name, params in settings.items():
            step_times.clear()
            t0 = time.perf_counter()
            outs = llm.chat(conversations, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            results[name]["tok/s"].append(tokens / wall)
            results[name]["pass ms"].append(statistics.fmean(step_times) * 1000)
            results[name]["tokens"].append(tokens)
            if name == "json schema":
                for o in outs:
                    try:
                        json.loads(o.outputs[0].text)
                        valid += 1
                    except ValueError:
                        pass
    llm.shutdown()

    print(f"\n{args.num_prompts} chat prompts, greedy, up to {args.max_tokens} tokens, SmolLM2-135M, 1 engine, "
          f"{args.rounds} alternating rounds\n")
    print(f"{'setting':<14}{'tokens':>8}{'tok/s':>10}{'ms/pass':>10}")
    for name, r in results.items():
        print(f"{name:<14}{statistics.fmean(r['tokens']):>8.0f}{statistics.fmean(r['tok/s']):>10.1f}"
              f"{statistics.fmean(r['pass ms']):>10.2f}")
    free, constrained = results["free"], results["json schema"]
    speed = statistics.fmean(constrained["tok/s"]) / statistics.fmean(free["tok/s"])
    pass_time = statistics.fmean(constrained["pass ms"]) / statistics.fmean(free["pass ms"])
    print(f"\njson schema / free: tok/s x{speed:.2f}, ms/pass x{pass_time:.2f}")
    print(f"constrained outputs that parse as JSON: {valid} of {args.num_prompts * args.rounds} "
          "(the others ran out of tokens)")
    print(f"time to a 1-token answer: first grammar {first['first grammar'] * 1000:.0f} ms, "
          f"cached grammar {first['cached grammar'] * 1000:.0f} ms")


if __name__ == "__main__":
    main()
