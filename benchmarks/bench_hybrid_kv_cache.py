"""The hybrid KV cache manager under a fixed KV memory budget, in one run: what releasing the windowed
layers' blocks buys a model that mixes them with full-attention layers.

A random Gemma 3 of SmolLM2's width and vocabulary (12 layers, five windowed of 128 keys to one full,
as Gemma 3's pattern), with SmolLM2's tokenizer; long prompts (a shared document and a question)
and the same greedy requests each way (in-process engines, LLM.generate), with the same
--kv-cache-memory-bytes, sized so that the cache without the hybrid manager holds few of them at once:
  hybrid     the default: KV cache groups, a windowed group's blocks behind the window released
  one-group  --disable-hybrid-kv-cache-manager: every layer keeps every block of a request
For each: the blocks the budget buys, the median output tokens/s over the rounds (which alternate
between the engines) and its ratio to one-group's, the preemptions of one round, the most requests
running at once, the share of looked-up prompt tokens the prefix cache held (one round), and how many
answers equal one-group's (a random model's near ties may flip with the batch's shapes).
--draft-layers N: both engines decode speculatively (--num-speculative-tokens a pass) with a draft
model of the model's first N layers (its embedding, norm and head too); the draft's KV cache, in
tensors of its own on the full group's block ids, takes its share of the same budget, and the share of
drafts accepted is printed. (N = 12, the model as its own draft, is a drafter whose pages outweigh the
groups at this length: both engines then keep one group.)
--kv-offloading-mib M: both engines keep a KV offloading host tier of M MiB behind the prefix cache
(the groups keep each group's blocks there: a block of theirs is a page of each of the two layers a
group holds, one-group's a page of all twelve). Every round repeats the same prompts, so from the
second on a prompt finds its blocks on the device or in the tier; the tier's blocks and the share of
the looked-up prompt tokens found in it (one round) are printed.
Usage: python benchmarks/bench_hybrid_kv_cache.py [--num-prompts 16] [--prompt-len 768] [--max-tokens 32]
       [--max-num-batched-tokens 256] [--kv-cache-memory-mib 16] [--rounds 3] [--draft-layers 0]
       [--num-speculative-tokens 3] [--kv-offloading-mib 0]
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.llm_modes import LLMMode, run_alternating
from cluster import LLM, SamplingParams

GEMMA3_SHAPES = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
                 "head_dim": 64, "query_pre_attn_scalar": 64, "num_hidden_layers": 12, "vocab_size": 49152,
                 "sliding_window": 128, "sliding_window_pattern": 6, "max_position_embeddings": 2048}


def gemma3_model(out: Path, smollm2: Path) -> Path:
    """A random Gemma 3 (GEMMA3_SHAPES) with SmolLM2's tokenizer."""
    from tests.gpu_worker.utils import save_tiny_model

    save_tiny_model(out, "gemma3", **GEMMA3_SHAPES)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2 / name, out / name)
    return out


def first_layers(model: Path, out: Path, num_layers: int) -> Path:
    """A draft model of ``model``'s first ``num_layers`` layers, with its embedding, norm and head."""
    import json

    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    if config.get("layer_types"):
        config["layer_types"] = config["layer_types"][:num_layers]
    (out / "config.json").write_text(json.dumps(config))
    tensors = {name: t for name, t in load_file(model / "model.safetensors").items()
               if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


class GroupsMode(LLMMode):
    """One way of keeping the KV cache; also counts one round's preemptions and its most running requests."""

    def __init__(self, name: str, model: str, budget: int, args: argparse.Namespace, disable: bool,
                 draft: str | None) -> None:
        super().__init__(name, LLM(model=model, kv_cache_memory_bytes=budget, max_num_seqs=args.max_num_seqs,
                                   max_num_batched_tokens=args.max_num_batched_tokens,
                                   max_model_len=args.prompt_len + args.max_tokens,
                                   disable_hybrid_kv_cache_manager=disable,
                                   kv_offloading_size=args.kv_offloading_mib / 1024 if args.kv_offloading_mib else None,
                                   speculative_config={"method": "draft_model", "model": draft,
                                                       "num_speculative_tokens": args.num_speculative_tokens}
                                   if draft else None))
        engine = self.llm._engine
        self.num_blocks = engine.scheduler.cache_config.num_blocks
        self.num_groups = max(1, len(engine.scheduler.cache_config.kv_cache_groups))
        self.num_tier_blocks = engine.scheduler.cache_config.num_offload_blocks
        self.preemptions = self.most_running = 0
        self.hit_rate = self.tier_hit_rate = self.accepted = 0.0
        step = engine.step

        def counted_step():  # (the most requests one pass runs)
            out = step()
            self.most_running = max(self.most_running, len(engine.scheduler.running))
            return out

        engine.step = counted_step

    def run(self, prompts: list[list[int]], params: SamplingParams) -> None:
        before = self.llm.get_stats()[0]
        self.most_running = 0
        super().run(prompts, params)
        after = self.llm.get_stats()[0]
        self.preemptions = after.num_preemptions - before.num_preemptions
        # (The prompt tokens found in the prefix cache, of those looked up.)
        queries = after.prefix_cache_queries - before.prefix_cache_queries
        self.hit_rate = (after.prefix_cache_hits - before.prefix_cache_hits) / max(queries, 1)
        # (The tier's: the prompt tokens found there, of those looked up there after the device's hit.)
        tier_queries = after.external_prefix_cache_queries - before.external_prefix_cache_queries
        tier_hits = after.external_prefix_cache_hits - before.external_prefix_cache_hits
        self.tier_hit_rate = tier_hits / max(tier_queries, 1)
        drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
        accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
        self.accepted = accepted / max(drafted, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=768)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--kv-cache-memory-mib", type=float, default=16.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--draft-layers", type=int, default=0, metavar="N")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--kv-offloading-mib", type=float, default=0.0, metavar="M")
    args = parser.parse_args()
    from gpu_worker.model_resolver import resolve_model

    smollm2 = Path(resolve_model("SmolLM2-135M-Instruct").model_dir)
    rng = random.Random(0)
    shared = [rng.randrange(1000, 40000) for _ in range(args.prompt_len // 2)]
    prompts = [shared + [rng.randrange(1000, 40000) for _ in range(args.prompt_len - len(shared))]
               for _ in range(args.num_prompts)]
    budget = int(args.kv_cache_memory_mib * 2**20)
    with tempfile.TemporaryDirectory() as tmp:
        model = gemma3_model(Path(tmp) / "gemma3", smollm2)
        draft = str(first_layers(model, Path(tmp) / "draft", args.draft_layers)) if args.draft_layers else None
        modes = [GroupsMode("one-group", str(model), budget, args, disable=True, draft=draft),
                 GroupsMode("hybrid", str(model), budget, args, disable=False, draft=draft)]
        run_alternating(modes, prompts[:2], prompts,
                        SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True), args.rounds)
    one = modes[0]
    print(f"{args.num_prompts} prompts of {args.prompt_len} tokens (the first half shared) x {args.max_tokens} greedy "
          f"tokens, max_num_seqs={args.max_num_seqs}, max_num_batched_tokens={args.max_num_batched_tokens}, random "
          f"Gemma 3 (12 layers: 10 windowed of 128 keys, 2 full), KV budget {args.kv_cache_memory_mib:g} MiB each; "
          f"median of {args.rounds} rounds"
          + (f"; a draft model of its first {args.draft_layers} layers, {args.num_speculative_tokens} tokens a pass"
             if args.draft_layers else "")
          + (f"; a KV offloading host tier of {args.kv_offloading_mib:g} MiB each" if args.kv_offloading_mib else ""))
    tier = bool(args.kv_offloading_mib)
    print(f"{'KV cache':10} {'groups':>6} {'blocks':>7} {'tok/s':>8} {'vs one-group':>13} {'preemptions':>12} "
          f"{'most running':>13} {'prefix hits':>12}" + (f" {'accepted':>9}" if args.draft_layers else "")
          + (f" {'tier blocks':>12} {'tier hits':>10}" if tier else "")
          + "  answers equal to one-group's")
    for mode in modes:
        same = sum(a == b for a, b in zip(mode.answers, one.answers, strict=True))
        print(f"{mode.name:10} {mode.num_groups:6d} {mode.num_blocks:7d} {mode.rate:8.1f} "
              f"{mode.rate / one.rate:12.2f}x {mode.preemptions:12d} {mode.most_running:13d} {mode.hit_rate:11.0%}"
              + (f" {mode.accepted:8.0%}" if args.draft_layers else "")
              + (f" {mode.num_tier_blocks:12d} {mode.tier_hit_rate:9.0%}" if tier else "")
              + f"  {same}/{len(mode.answers)}")


if __name__ == "__main__":
    main()
