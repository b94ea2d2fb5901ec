"""--kv-cache-dtype under a fixed KV memory budget, in one run: what an fp8 (or bf16) cache buys.

SmolLM2-135M-Instruct, the same greedy chat requests each way (in-process engine, LLM.generate), with
the same --kv-cache-memory-bytes for every mode, sized so that the full-precision cache cannot hold
every request at once:
  auto       the model's dtype (fp32 on the CPU)
  bfloat16   two bytes per element
  fp8        e4m3, one byte per element (vLLM's "fp8")
  fp8_e5m2   e5m2, one byte per element
For each: the blocks the budget buys, the median output tokens/s over the rounds (which alternate
between the modes' engines) and its ratio to auto, the preemptions of one round, and how far each
answer follows auto's greedy answer (the first differing token; "all" when identical).
Usage: python benchmarks/bench_kv_cache_dtype.py [--num-prompts 32] [--max-tokens 96]
       [--kv-cache-memory-mib 48] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.llm_modes import LLMMode, run_alternating
from cluster import LLM, SamplingParams

QUESTIONS = ["Explain how rainbows form.", "Write a short story about a lighthouse keeper.",
             "What are the rules of chess?", "Why is the sky blue?", "Describe how bread rises.",
             "Tell me about the life of bees.", "How do vaccines work?", "What causes the seasons?"]
MODES = ("auto", "bfloat16", "fp8", "fp8_e5m2")


class CacheDTypeMode(LLMMode):
    """One cache dtype under the shared KV budget; also counts the preemptions of its last run."""

    def __init__(self, name: str, budget: int, max_num_seqs: int) -> None:
        super().__init__(name, LLM(kv_cache_dtype=name, kv_cache_memory_bytes=budget, max_num_seqs=max_num_seqs,
                                   max_model_len=512))
        self.num_blocks = self.llm._engine.scheduler.cache_config.num_blocks
        self.preemptions = 0

    def run(self, prompts: list[list[int]], params: SamplingParams) -> None:
        before = self.llm.get_stats()[0].num_preemptions
        super().run(prompts, params)
        self.preemptions = self.llm.get_stats()[0].num_preemptions - before


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--kv-cache-memory-mib", type=float, default=48.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    budget = int(args.kv_cache_memory_mib * 2**20)
    modes = [CacheDTypeMode(name, budget, args.max_num_seqs) for name in MODES]
    tokenizer = modes[0].llm.tokenizer
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False) for i in range(args.num_prompts)]
    # ignore_eos: every mode computes the same number of tokens; the answers are compared up to
    # their first difference anyway.
    run_alternating(modes, prompts[:2], prompts,
                    SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True), args.rounds)
    auto = modes[0]
    print(f"{args.num_prompts} chat prompts x {args.max_tokens} greedy tokens, max_num_seqs={args.max_num_seqs}, "
          f"KV budget {args.kv_cache_memory_mib:g} MiB for every mode; median of {args.rounds} rounds")
    print(f"{'cache dtype':12} {'blocks':>7} {'tok/s':>8} {'vs auto':>8} {'preemptions':>12}  "
          f"first token differing from auto (per answer)")
    for mode in modes:
        diffs = [first_difference(a, b) for a, b in zip(mode.answers, auto.answers, strict=True)]
        same = sum(d is None for d in diffs)
        where = sorted(d for d in diffs if d is not None)
        detail = f"{same}/{len(diffs)} identical" + (f"; others at {where}" if where else "")
        print(f"{mode.name:12} {mode.num_blocks:7d} {mode.rate:8.1f} {mode.rate / auto.rate:7.2f}x "
              f"{mode.preemptions:12d}  {detail}")


if __name__ == "__main__":
    main()
