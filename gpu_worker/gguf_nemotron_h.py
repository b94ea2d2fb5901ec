"""NVIDIA Nemotron-H's GGUF files (``nemotron_h``: Nemotron-H 8B / 47B, Nemotron Nano 9B / 12B v2) back
to Hugging Face checkpoints. Used by gpu_worker.gguf_loader.

Each layer of Nemotron-H is one block behind its own norm: a Mamba-2 mixer, attention without
positions, or an ungated relu^2 MLP. llama.cpp's converter keeps the kinds as per-layer counts — KV
heads (attention) and feed_forward_length (MLP), both 0 in a Mamba-2 layer — and names the blocks'
parts as Llama's (attn_norm for the block's norm, attn_q ... with q/k rows permuted, ffn_up /
ffn_down) and Mamba-2's (gpu_worker.gguf_mamba2). The routed-experts variant (``nemotron_h_moe``:
Nemotron 3 Nano) is not converted.
"""

from __future__ import annotations

from typing import Any

from gpu_worker.gguf_mamba2 import HybridNames, mamba2_geometry, per_layer

NEMOTRON_H_ARCHITECTURES = {"nemotron_h": ("NemotronHForCausalLM", "nemotron_h")}
# llama.cpp's names -> the released checkpoint's (backbone.*).
NEMOTRON_H_NAMES = HybridNames(
    top_level={"token_embd": "backbone.embeddings", "output_norm": "backbone.norm_f", "output": "lm_head"},
    layers="backbone.layers", mixer="mixer",
    block={"attn_norm": "norm", "attn_q": "mixer.q_proj", "attn_k": "mixer.k_proj", "attn_v": "mixer.v_proj",
           "attn_output": "mixer.o_proj", "ffn_up": "mixer.up_proj", "ffn_down": "mixer.down_proj"},
    family="Nemotron-H")


def nemotron_h_config(meta: dict[str, Any], arch: str, config: dict[str, Any], kv_heads: Any,
                      tensor_names: set[str]) -> dict[str, Any]:
    """The Nemotron-H keys of a converted config.json: the block pattern (M Mamba-2, * attention, - MLP)
    from the per-layer counts, the MLP's width, the Mamba-2 geometry."""
    layers = int(config["num_hidden_layers"])
    kv = per_layer(kv_heads, layers, f"{arch}.attention.head_count_kv")
    ffn = per_layer(meta[f"{arch}.feed_forward_length"], layers, f"{arch}.feed_forward_length")
    if any(k and f for k, f in zip(kv, ffn, strict=True)):
        raise ValueError(f"GGUF {arch} file: a layer has both KV heads and an MLP; each Nemotron-H layer is one block")
    mamba = mamba2_geometry(meta, arch, tensor_names)
    return {
        "hybrid_override_pattern": "".join("*" if k else "-" if f else "M" for k, f in zip(kv, ffn, strict=True)),
        "mlp_hidden_act": "relu2", "layer_norm_epsilon": config["rms_norm_eps"],
        "mamba_num_heads": mamba["num_heads"], "mamba_head_dim": mamba["head_dim"], "n_groups": mamba["num_groups"],
        "ssm_state_size": mamba["state_size"], "conv_kernel": mamba["conv_kernel"],
        "use_conv_bias": mamba["conv_bias"], "use_bias": mamba["proj_bias"],
        "mlp_bias": any(name.endswith(".ffn_up.bias") for name in tensor_names),
    }
