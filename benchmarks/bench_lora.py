"""Multi-LoRA serving vs the base model and vs an adapter merged into the weights, in one run.

SmolLM2-135M-Instruct, the same greedy requests each way (in-process engine, LLM.generate):
  base         no LoRA at all
  lora-on      LoRA enabled, every request on the base model (the cost of having it on)
  1 adapter    every request under one rank-R adapter on all seven projections
  N adapters   requests spread over N different adapters in the same batches (--max-loras N)
  merged       that one adapter merged into the weights (W + s B A), served as a plain model:
               what serving one adapter costs at least
For each: output tokens/s and the ratio to base. The 1-adapter and merged answers are compared
(fp32; they can differ only where rounding flips a near tie).
Usage: python benchmarks/bench_lora.py [--num-prompts 16] [--max-tokens 64] [--rank 16] [--adapters 4]
"""

from __future__ import annotations

import argparse
import shutil
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


def measure(model: str, prompts: list[list[int]], max_tokens: int, max_num_seqs: int,
            loras: list[LoRARequest | None] | None, max_loras: int = 1) -> dict:
    llm = LLM(model=model, max_num_seqs=max_num_seqs, enable_lora=loras is not None, max_loras=max_loras,
              max_lora_rank=64)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        # Warm-up (and the adapters' first load, which is not what is timed).
        llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False, lora_request=loras)
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        elapsed = time.perf_counter() - t0
    finally:
        llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"answers": [o.outputs[0].token_ids for o in outputs], "tok_s": tokens / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4, help="Different adapters in the mixed run.")
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
        runs = [
            ("base", str(base_dir), None, 1),
            ("lora-on", str(base_dir), [None] * n, 1),
            ("1 adapter", str(base_dir), [adapters[0]] * n, 1),
            (f"{args.adapters} adapters", str(base_dir), [adapters[i % args.adapters] for i in range(n)],
             args.adapters),
            ("merged", str(merged), None, 1),
        ]
        print(f"{n} prompts x {args.max_tokens} tokens, greedy, max_num_seqs={args.max_num_seqs}, "
              f"rank {args.rank} on q/k/v/o/gate/up/down")
        print(f"{'mode':12} {'tok/s':>8} {'vs base':>8}")
        results = {}
        for name, model, loras, max_loras in runs:
            r = results[name] = measure(model, prompts, args.max_tokens, args.max_num_seqs, loras, max_loras)
            print(f"{name:12} {r['tok_s']:8.1f} {r['tok_s'] / results['base']['tok_s']:7.2f}x")
        one, merged_r = results["1 adapter"]["answers"], results["merged"]["answers"]
        same = sum(a == b for a, b in zip(one, merged_r, strict=True))
        ratio = results['1 adapter']['tok_s'] / results['merged']['tok_s']
        print(f"1 adapter vs merged: {ratio:.2f}x, "
              f"{same}/{n} answers identical")


if __name__ == "__main__":
    main()
