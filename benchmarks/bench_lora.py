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
--moe: the same on a random-weight Qwen2-MoE of SmolLM2's width and vocabulary (8 layers, 16 routed
experts of width 256, 4 a token, a shared expert), the adapters on attention, the shared expert and
every routed expert (PEFT's stacked experts parameters).
Usage: python benchmarks/bench_lora.py [--moe] [--num-prompts 16] [--max-tokens 64] [--rank 16] [--adapters 4]
       [--rounds 5]
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


# The --moe model: SmolLM2-135M's attention, width and vocabulary, routed experts in place of its MLPs.
MOE_SHAPES = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
              "num_hidden_layers": 8, "vocab_size": 49152, "num_experts": 16, "num_experts_per_tok": 4,
              "moe_intermediate_size": 256, "shared_expert_intermediate_size": 512, "max_position_embeddings": 2048,
              "tie_word_embeddings": True}
MOE_ADAPTER = {"targets": ("q_proj", "k_proj", "v_proj", "o_proj", "shared_expert.gate_proj",
                           "shared_expert.up_proj", "shared_expert.down_proj"),
               "parameters": ("experts.gate_up_proj", "experts.down_proj")}


def moe_model(out: Path, smollm2: Path) -> Path:
    """A random Qwen2-MoE (MOE_SHAPES) with SmolLM2's tokenizer."""
    from tests.gpu_worker.utils import save_tiny_model

    save_tiny_model(out, "qwen2_moe", **MOE_SHAPES)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2 / name).exists():
            shutil.copy(smollm2 / name, out / name)
    return out


def make_adapters(base_dir: Path, out: Path, count: int, rank: int, **adapter) -> tuple[list[Path], Path]:
    """``count`` random adapters (``adapter``: peft_model's targets), plus the first one merged into the
    base model's weights."""
    paths = []
    for i in range(count):
        model = peft_model(base_dir, seed=100 + i, r=rank, alpha=2.0 * rank, scale=0.02, **adapter)
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
    parser.add_argument("--moe", action="store_true", help="A random Qwen2-MoE, adapters on its routed experts too.")
    args = parser.parse_args()
    from gpu_worker.model_resolver import load_tokenizer, resolve_model

    smollm2 = Path(resolve_model("SmolLM2-135M-Instruct").model_dir)
    tokenizer = load_tokenizer(smollm2)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Write about {TOPICS[i % len(TOPICS)]}."}], add_generation_prompt=True,
        tokenize=False), add_special_tokens=False) for i in range(args.num_prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = moe_model(Path(tmp) / "moe", smollm2) if args.moe else smollm2
        paths, merged = make_adapters(base_dir, Path(tmp), args.adapters, args.rank,
                                      **(MOE_ADAPTER if args.moe else {}))
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
    where = ("q/k/v/o, the shared expert and the 16 routed experts (random Qwen2-MoE)" if args.moe
             else "q/k/v/o/gate/up/down (SmolLM2-135M)")
    print(f"{n} prompts x {args.max_tokens} tokens, greedy, max_num_seqs={args.max_num_seqs}, "
          f"rank {args.rank} on {where}; median of {args.rounds} rounds")
    print(f"{'mode':12} {'tok/s':>8} {'vs base':>8} {'vs merged':>10}")
    base, merged_mode = modes[0], modes[-1]
    for mode in modes:
        print(f"{mode.name:12} {mode.rate:8.1f} {mode.rate / base.rate:7.2f}x {mode.rate / merged_mode.rate:9.2f}x")
    same = sum(a == b for a, b in zip(modes[2].answers, merged_mode.answers, strict=True))
    print(f"1 adapter vs merged: {same}/{n} answers identical")


if __name__ == "__main__":
    main()
