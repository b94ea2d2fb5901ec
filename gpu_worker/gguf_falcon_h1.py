"""TII's Falcon-H1 GGUF files (``falcon-h1``: Falcon-H1-0.5B ... 34B, as TII ships them) back to Hugging
Face checkpoints. Used by gpu_worker.gguf_loader.

Every Falcon-H1 layer runs attention and a Mamba-2 mixer side by side (gpu_worker.models.falcon_h1).
llama.cpp's converter folds the muP multipliers into the weights (the embedding, the LM head, each
projection, in_proj's z / x / B / C / dt rows), so the converted checkpoint states them all as 1;
its attention rows are not permuted (llama.cpp rotates Falcon-H1's heads by halves, as transformers
does); the Mamba-2 tensors are reshaped as gpu_worker.gguf_mamba2 undoes. The file does not say
whether the mixer's norm comes before its gate: llama.cpp gates first, and so does the converted
config.
"""

from __future__ import annotations

from typing import Any

from gpu_worker.gguf_mamba2 import HybridNames, mamba2_geometry

FALCON_H1_ARCHITECTURES = {"falcon-h1": ("FalconH1ForCausalLM", "falcon_h1")}
# llama.cpp's names -> transformers' (Bamba's layout).
FALCON_H1_NAMES = HybridNames(
    top_level={"token_embd": "model.embed_tokens", "output_norm": "model.final_layernorm", "output": "lm_head"},
    layers="model.layers", mixer="mamba",
    block={"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
           "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "pre_ff_layernorm",
           "ffn_gate": "feed_forward.gate_proj", "ffn_up": "feed_forward.up_proj",
           "ffn_down": "feed_forward.down_proj"},
    family="Falcon-H1")


def falcon_h1_config(meta: dict[str, Any], arch: str, config: dict[str, Any], tensor_names: set[str]
                     ) -> dict[str, Any]:
    """The Falcon-H1 keys of a converted config.json: the Mamba-2 geometry, the optional gated norm
    (where the file has its weights), and every multiplier 1 (folded into the weights)."""
    mamba = mamba2_geometry(meta, arch, tensor_names)
    return {
        "mamba_d_ssm": mamba["inner_size"], "mamba_n_heads": mamba["num_heads"], "mamba_d_head": mamba["head_dim"],
        "mamba_n_groups": mamba["num_groups"], "mamba_d_state": mamba["state_size"],
        "mamba_d_conv": mamba["conv_kernel"], "mamba_conv_bias": mamba["conv_bias"],
        "mamba_proj_bias": mamba["proj_bias"],
        "mamba_rms_norm": any(name.endswith(".ssm_norm.weight") for name in tensor_names),
        "mamba_norm_before_gate": False,
        "projectors_bias": any(name.endswith(".ssm_out.bias") for name in tensor_names),
        "embedding_multiplier": 1.0, "lm_head_multiplier": 1.0, "attention_in_multiplier": 1.0,
        "attention_out_multiplier": 1.0, "key_multiplier": 1.0, "ssm_in_multiplier": 1.0,
        "ssm_out_multiplier": 1.0, "mlp_multipliers": [1.0, 1.0], "ssm_multipliers": [1.0] * 5,
    }
