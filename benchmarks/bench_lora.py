"""Multi-LoRA serving vs the base model and vs an adapter merged into the weights, in one run.

SmolLM2-135M-Instruct, the same greedy requests each way (in-process engine, LLM.generate):
  base         no LoRA at all
  lora-on      LoRA enabled, every request on the base model (the cost of having it on)
  1 adapter    every request under one rank-R adapter on all seven projections
  N adapters   requests spread over N different adapters in the same batches (--max-loras N)
  merged       that one adapter merged into the weights (W + s B A), served as a plain model:
               what serving one adapter costs at least
Every mode keeps its own engine and the timed rounds alternate between them; for each: the median
output tokens/s and the ratios to base and to merged. The 1-adapter and merged answers are compared
(fp32; they can differ only where rounding flips a near tie).
Usage: python benchmarks/bench_lora.py [--num-prompts 16] [--max-tokens 64] [--rank 16] [--adapters 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster import LLM, LoRARequest, SamplingParams
from tests.lora_adapters import peft_model

TOPICS = ["the history of Paris", "how rainbows form", "the rules of chess", "why the sky is blue",
          "how bread rises", "the life of bees", "how lighthouses work", "the moons of Jupiter"]


def make_adapters(base_dir: Path, out: Path, count: int, rank: int) -> tuple[list[Path], Path]:
    """``count`` random adapters, plus the first one merged into the base model's weights."""
    paths = []
    for i in range(count):
        model = peft_model(base_dir, seed=100 + i, r=rank, alpha=2.0 * rank, scale=0.02)
        model.save_pretrained(out / f"adapter{i}")
        paths.append(out / f"adapter{i}")
        if i == 0:
            merged = out / "merged"
            model.merge_and_unload().save_pretrained(merged, safe_serialization=True)
            for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
                if (base_dir / name).exists():
                    shutil.copy(base_dir / name, merged / name)
    return paths, out / "merged"


class Mode:
    """One way of serving: its own in-process engine, kept for the whole run."""

    def __init__(self, name: str, model: str, loras: list[LoRARequest | None] | None, max_loras: int,
                 max_num_seqs: int) -> None:
        self.name, self.loras = name, loras
        self.llm = LLM(model=model, max_num_seqs=max_num_seqs, enable_lora=loras is not None,
                       max_loras=max_loras, max_lora_rank=64, max_model_len=512)
        self.rates: list[float] = []
        self.answers: list[list[int]] = []

    def run(self, prompts: list[list[int]], params: SamplingParams) -> None:
        t0 = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.loras)
        elapsed = time.perf_counter() - t0
        self.rates.append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
        self.answers = [o.outputs[0].token_ids for o in outputs]

    @property
    def rate(self) -> float:
        return statistics.median(self.rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4, help="Different adapters in the mixed run.")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from gpu_worker.model_resolver import load_tokenizer, resolve_model

    base_dir = Path(resolve_model("SmolLM2-135M-Instruct").model_dir)
    tokenizer = load_tokenizer(base_dir)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Write about {TOPICS[i % len(TOPICS)]}."}], add_generation_prompt=True,
        tokenize=False), add_special_tokens=False) for i in range(args.num_prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        paths, merged = make_adapters(base_dir, Path(tmp), args.adapters, args.rank)
        adapters = [LoRARequest(f"adapter{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        n = args.num_prompts
        modes = [
            Mode("base", str(base_dir), None, 1, args.max_num_seqs),
            Mode("lora-on", str(base_dir), [None] * n, 1, args.max_num_seqs),
            Mode("1 adapter", str(base_dir), [adapters[0]] * n, 1, args.max_num_seqs),
            Mode(f"{args.adapters} adapters", str(base_dir), [adapters[i % args.adapters] for i in range(n)],
                 args.adapters, args.max_num_seqs),
            Mode("merged", str(merged), None, 1, args.max_num_seqs),
        ]
        try:
            for mode in modes:  # warm-up (and the adapters' first load, which is not timed)
                mode.run(prompts, SamplingParams(max_tokens=2, temperature=0.0))
                mode.rates.clear()
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
            # Rounds alternate the modes, each round starting one mode later, so a noisy spell on this
            # shared machine (or a mode's place in the round) hits all of them alike.
            for r in range(args.rounds):
                for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
                    mode.run(prompts, params)
        finally:
            for mode in modes:
                mode.llm.shutdown()
    print(f"{n} prompts x {args.max_tokens} tokens, greedy, max_num_seqs={args.max_num_seqs}, "
          f"rank {args.rank} on q/k/v/o/gate/up/down; median of {args.rounds} rounds")
    print(f"{'mode':12} {'tok/s':>8} {'vs base':>8} {'vs merged':>10}")
    base, merged_mode = modes[0], modes[-1]
    for mode in modes:
        print(f"{mode.name:12} {mode.rate:8.1f} {mode.rate / base.rate:7.2f}x {mode.rate / merged_mode.rate:9.2f}x")
    same = sum(a == b for a, b in zip(modes[2].answers, merged_mode.answers, strict=True))
    print(f"1 adapter vs merged: {same}/{n} answers identical")


if __name__ == "__main__":
    main()
