"""Speculative decoding with the model's own MTP layer (``{"method": "mtp"}``) vs plain decoding, in one run.

No checkpoint with an MTP layer fits this machine (the smallest, GLM-4.5-Air, is 106B), so the model
is a random GLM-4.5 of SmolLM2-135M's shapes (30 layers, 9 heads of 64 rotating half, 8 experts of
width 768 in 2 groups, 2 per token, a shared expert, the first layer dense) holding one MTP layer,
with SmolLM2's tokenizer. A random MTP layer's drafts are almost never what the model answers, and a
trained one's are most of the time (DeepSeek-V3's report: 85-90% of its second tokens accepted), so
two variants bracket what it costs and returns here:
  untrained  the random MTP layer: nearly every draft rejected, so the ratio is the drafter's cost
  agreeing   every layer's output projections (the model's and the MTP layer's) zeroed and the MTP
             layer passing the next token's embedding on: the model's next token follows from its
             last alone, and the MTP layer guesses the one after as the model will: nearly every
             draft accepted (the same work per layer as the untrained model), the ratio its return
For each: output tokens/s, the ratio to plain on the same model, engine passes, the draft acceptance
rate; the greedy answers must be identical to plain decoding's (checked).
Usage: python benchmarks/bench_mtp.py [--num-prompts 8] [--max-tokens 64] [--max-num-seqs 8] [--layers 30]
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_spec_decode import drafter_bench, report_modes

SMOLLM2_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
                "vocab_size": 49152, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
                "tie_word_embeddings": False}


def glm_with_mtp(out_dir: Path, layers: int, agreeing: bool) -> Path:
    """A random GLM-4.5 checkpoint of SmolLM2's shapes with one MTP layer after its ``layers``."""
    from safetensors.torch import load_file, save_file
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    from gpu_worker.model_resolver import resolve_model

    torch.manual_seed(0)
    shapes = {**SMOLLM2_135M, "head_dim": 64, "n_routed_experts": 8, "num_experts_per_tok": 2,
              "moe_intermediate_size": 768, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
              "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "attention_bias": True,
              "use_qk_norm": True, "partial_rotary_factor": 0.5, "pad_token_id": 2, "eos_token_id": 2}
    # (One more decoder layer than the model's: the MTP layer's own, saved under its number.)
    Glm4MoeForCausalLM(Glm4MoeConfig(**shapes, num_hidden_layers=layers + 1)).save_pretrained(out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    (out_dir / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers,
                                                     "num_nextn_predict_layers": 1}))
    tensors = load_file(out_dir / "model.safetensors")
    width, prefix = shapes["hidden_size"], f"model.layers.{layers}."
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{prefix}{norm}.weight"] = torch.ones(width)
    tensors[f"{prefix}eh_proj.weight"] = torch.randn(width, 2 * width) * (2 * width) ** -0.5
    if agreeing:
        for name in tensors:
            if name.startswith("model.layers.") and ("o_proj" in name or "down_proj" in name):
                tensors[name] = torch.zeros_like(tensors[name])
        tensors[f"{prefix}eh_proj.weight"] = torch.cat((torch.eye(width), torch.zeros(width, width)), dim=1)
        tensors[f"{prefix}shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    tensors[f"{prefix}embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[f"{prefix}shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    smollm2 = Path(resolve_model("SmolLM2-135M-Instruct").model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2 / name, out_dir / name)
    return out_dir


def main() -> None:
    args, prompts = drafter_bench(__doc__, SMOLLM2_135M["vocab_size"])
    modes = [("plain", None)] + [(f"mtp k={k}", {"method": "mtp", "num_speculative_tokens": k}) for k in (1, 2, 3)]
    with tempfile.TemporaryDirectory() as scratch:
        for variant in ("untrained", "agreeing"):
            model = glm_with_mtp(Path(scratch) / variant, args.layers, agreeing=variant == "agreeing")
            report_modes(variant, model, modes, prompts, args)


if __name__ == "__main__":
    main()
