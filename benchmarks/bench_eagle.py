"""Speculative decoding with EAGLE and EAGLE-3 heads (``{"method": "eagle" | "eagle3", "model": HEAD}``)
vs plain decoding, in one run.

No trained EAGLE head fits a model this machine serves (the smallest released ones are for 7-8B
targets), so the target is a random Llama of SmolLM2-135M's shapes (30 layers, 9 heads of 64,
width 576, 49152 tokens) and the heads are random ones of its width, in the EAGLE authors' layout
(EAGLE-3's over a 32000-token draft vocabulary mapped by d2t). Two variants bracket what a head
costs and returns here:
  untrained  random heads: nearly every draft rejected, so the ratio is the drafting's cost
  agreeing   every target layer's output projections zeroed, so its next token follows from its
             last alone (the same work per layer), and heads built to guess as it will: EAGLE's
             fc passes the next token's embedding on to the target's head (every draft right);
             EAGLE-3's passes the token's own feature on to a head whose rows are the mean normed
             embeddings of the tokens whose successor's successor each is (its first draft mostly
             right, further ones mostly not: its output is not fed a new embedding)
For each: output tokens/s, the ratio to plain on the same target, engine passes, the acceptance
rate; the greedy answers must be identical to plain decoding's (checked).
Usage: python benchmarks/bench_eagle.py [--num-prompts 8] [--max-tokens 64] [--max-num-seqs 8] [--layers 30]
(--layers 8 at least: EAGLE-3 reads the inputs of the target's layers 2, L/2 and L-3, three distinct ones)
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_spec_decode import drafter_bench, report_modes
from tests.gpu_worker.utils import save_near_bigram_target, save_tiny_eagle_head, save_tiny_model

SMOLLM2_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
                "vocab_size": 49152, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
                "tie_word_embeddings": False, "initializer_range": 0.02}


def target_and_heads(out_dir: Path, layers: int, agreeing: bool) -> tuple[Path, Path, Path]:
    """The target (with SmolLM2's tokenizer), its EAGLE head and its EAGLE-3 head."""
    from gpu_worker.model_resolver import resolve_model

    shapes = {**SMOLLM2_135M, "num_hidden_layers": layers}
    target = out_dir / "target"
    if agreeing:
        save_near_bigram_target(target, near_bigram=0.0, **shapes)
    else:
        save_tiny_model(target, "llama", **shapes)
    smollm2 = Path(resolve_model("SmolLM2-135M-Instruct").model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2 / name, target / name)
    near = 0.0 if agreeing else None
    eagle = save_tiny_eagle_head(out_dir / "eagle", target, "eagle", near_bigram=near)
    eagle3 = save_tiny_eagle_head(out_dir / "eagle3", target, "eagle3", near_bigram=near, draft_vocab_size=32000)
    return target, eagle, eagle3


def main() -> None:
    args, prompts = drafter_bench(__doc__, SMOLLM2_135M["vocab_size"])
    with tempfile.TemporaryDirectory() as scratch:
        for variant in ("untrained", "agreeing"):
            variant_dir = Path(scratch) / variant
            variant_dir.mkdir()
            target, eagle, eagle3 = target_and_heads(variant_dir, args.layers, agreeing=variant == "agreeing")
            modes = [("plain", None)] + [
                (f"{method} k={k}", {"method": method, "model": str(head), "num_speculative_tokens": k})
                for method, head in (("eagle", eagle), ("eagle3", eagle3)) for k in (1, 3)]
            report_modes(variant, target, modes, prompts, args)


if __name__ == "__main__":
    main()
