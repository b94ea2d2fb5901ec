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
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.llm_modes import LLMMode, run_alternating
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


def lora_mode(name: str, model: str, loras: list[LoRARequest | None] | None, max_loras: int,
              max_num_seqs: int) -> LLMMode:
    """One way of serving: ``loras`` None is an engine without LoRA, else each prompt's adapter."""
    llm = LLM(model=model, max_num_seqs=max_num_seqs, enable_lora=loras is not None, max_loras=max_loras,
              max_lora_rank=64, max_model_len=512)
    return LLMMode(name, llm, lora_request=loras)


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
            lora_mode("base", str(base_dir), None, 1, args.max_num_seqs),
            lora_mode("lora-on", str(base_dir), [None] * n, 1, args.max_num_seqs),
            lora_mode("1 adapter", str(base_dir), [adapters[0]] * n, 1, args.max_num_seqs),
            lora_mode(f"{args.adapters} adapters", str(base_dir), [adapters[i % args.adapters] for i in range(n)],
                 args.adapters, args.max_num_seqs),
            lora_mode("merged", str(merged), None, 1, args.max_num_seqs),
        ]
        # (The warm-up also loads the adapters, which is not timed.)
        run_alternating(modes, prompts, prompts,
                        SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True), args.rounds)
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
