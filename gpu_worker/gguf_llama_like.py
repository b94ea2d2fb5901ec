"""llama.cpp's GGUF files of the Llama-like families with their own names and keys: Cohere's Command
models (command-r, cohere2), GLM-4 (glm4), Seed-OSS (seed_oss), EXAONE 4.0 (exaone4), ERNIE 4.5
(ernie4_5, ernie4_5-moe), Arcee's AFM (arcee), NVIDIA's Nemotron (nemotron), OLMo (olmo) and
dots.llm1 (dots1), read back into their Hugging Face configs and tensor names (gpu_worker.gguf_loader
does the reading).

What llama.cpp's converter does to them, and is undone or read here:
  * only Arcee's and OLMo's converters permute the q/k rows into pairs; the others keep HF's order
    (Cohere's, GLM-4's and ERNIE's already turn pairs; the others' halves);
  * Nemotron's LayerNorm1P weights are stored as 1 + w (undone by the loader), its rotary width in
    rope.dimension_count; OLMo's norms have no tensors, its clip_qkv is attention.clamp_kqv;
  * Cohere's norms are LayerNorms (attention.layer_norm_epsilon), its logits scaled (logit_scale);
    Cohere2's files state its window but not its layer pattern (llama.cpp: three windowed of four,
    the same as transformers'), and its converter dropped its all-zero biases;
  * GLM-4's attention-output and MLP-output norms are post_attention_norm and post_ffw_norm (its
    norm before the MLP is ffn_norm), its gate and up projections one tensor (ffn_up, gate rows
    first), its rotary width rope.dimension_count; Seed-OSS's norm before the MLP is named
    post_attention_norm; EXAONE 4.0's two norms after each sublayer post_attention_norm and
    post_ffw_norm, its windowed layers a per-layer list (attention.sliding_window_pattern);
  * ERNIE 4.5 MoE's experts stacked (ffn_*_exps), its shared experts ffn_*_shexp, its correction bias
    exp_probs_b.bias, its dense leading layers and MoE interval in their own keys; its MTP layers are
    dropped by the converter; dots.llm1's likewise (DeepSeek-V3's routing: the groups, the weights'
    scale and renormalisation in expert_group_*, expert_weights_scale and expert_weights_norm).
"""

from __future__ import annotations

from typing import Any

# GGUF general.architecture -> HF (architecture, model_type).
LLAMA_LIKE_ARCHITECTURES = {
    "command-r": ("CohereForCausalLM", "cohere"),
    "cohere2": ("Cohere2ForCausalLM", "cohere2"),
    "glm4": ("Glm4ForCausalLM", "glm4"),
    "seed_oss": ("SeedOssForCausalLM", "seed_oss"),
    "exaone4": ("Exaone4ForCausalLM", "exaone4"),
    "ernie4_5": ("Ernie4_5ForCausalLM", "ernie4_5"),
    "ernie4_5-moe": ("Ernie4_5_MoeForCausalLM", "ernie4_5_moe"),
    "arcee": ("ArceeForCausalLM", "arcee"),
    "nemotron": ("NemotronForCausalLM", "nemotron"),
    "olmo": ("OlmoForCausalLM", "olmo"),
    "dots1": ("Dots1ForCausalLM", "dots1"),
}
# Model types whose files hold Llama's permuted q/k rows.
LLAMA_LIKE_PERMUTED_QK = ("arcee", "olmo")
# (OLMo's converter permutes the q/k weights, not their biases, as a LlamaModel's does.)
WEIGHTS_ONLY_PERMUTED = ("olmo",)
# Block tensor names that differ from Llama's, per model type (merged over the loader's Llama names).
LLAMA_LIKE_BLOCK_NAMES: dict[str, dict[str, str]] = {
    "glm4": {"post_attention_norm": "post_self_attn_layernorm", "ffn_norm": "post_attention_layernorm",
             "post_ffw_norm": "post_mlp_layernorm", "ffn_up": "mlp.gate_up_proj"},
    "seed_oss": {"post_attention_norm": "post_attention_layernorm"},
    "exaone4": {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    "ernie4_5_moe": {"ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
                     "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj",
                     "exp_probs_b": "mlp.moe_statics.e_score_correction_bias"},
    "dots1": {"ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
              "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj",
              "exp_probs_b": "mlp.gate.e_score_correction_bias"},
}


def _has(tensor_names: set[str], suffix: str) -> bool:
    return any(name.endswith(suffix) for name in tensor_names)


def _window_layers(pattern: Any, layers: int, default_period: int) -> list[str]:
    """Layer kinds from a window pattern: a per-layer list of booleans (windowed), or a period (each
    period-th layer full), ``default_period`` where the file states none."""
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(f"GGUF attention.sliding_window_pattern lists {len(pattern)} layers, "
                             f"the file has {layers}")
        return ["sliding_attention" if windowed else "full_attention" for windowed in pattern]
    period = int(pattern or default_period)
    return ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(layers)]


def llama_like_config(meta: dict[str, Any], arch: str, config: dict[str, Any], tensor_names: set[str],
                      read_float: Any) -> dict[str, Any]:
    """The family's own config keys, as its converter wrote them (``read_float``: the loader's reading
    of a float32 value)."""
    layers, head_dim = int(config["num_hidden_layers"]), int(config["head_dim"])
    rotary = meta.get(f"{arch}.rope.dimension_count")
    window = meta.get(f"{arch}.attention.sliding_window")
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if arch in ("command-r", "cohere2"):
        if rotary is not None and int(rotary) != head_dim:
            raise ValueError(f"GGUF {arch} file rotates {rotary} of each head's {head_dim} values; Cohere's "
                             "models served here rotate whole heads")
        extra: dict[str, Any] = {"layer_norm_eps": read_float(meta.get(f"{arch}.attention.layer_norm_epsilon", 1e-5)),
                                 "logit_scale": read_float(meta.get(f"{arch}.logit_scale", 0.0625)),
                                 "use_qk_norm": _has(tensor_names, ".attn_q_norm.weight")}
        if arch == "cohere2":
            extra.update(sliding_window=int(window or 4096), layer_types=_window_layers(pattern, layers, 4))
        return extra
    if arch == "glm4":
        return {"partial_rotary_factor": int(rotary) / head_dim if rotary else 0.5}
    if arch == "seed_oss":
        return {"attention_out_bias": _has(tensor_names, ".attn_output.bias")}
    if arch == "exaone4":
        if not window:
            return {"sliding_window": None, "layer_types": ["full_attention"] * layers}
        return {"sliding_window": int(window), "layer_types": _window_layers(pattern, layers, 4)}
    if arch == "arcee":
        return {"hidden_act": "relu2"}
    if arch == "nemotron":  # (its rotary width counted in hidden / heads, as its converter computes it)
        heads = int(config["num_attention_heads"])
        return {"norm_eps": read_float(meta.get(f"{arch}.attention.layer_norm_epsilon", 1e-5)), "hidden_act": "relu2",
                "partial_rotary_factor": int(rotary) / (int(config["hidden_size"]) // heads) if rotary else 0.5,
                "mlp_bias": _has(tensor_names, ".ffn_up.bias")}
    if arch == "olmo":
        clamp = meta.get(f"{arch}.attention.clamp_kqv")
        return {"clip_qkv": None if clamp is None else read_float(clamp)}
    if arch == "dots1":
        return {"n_routed_experts": int(meta[f"{arch}.expert_count"]),
                "num_experts_per_tok": int(meta[f"{arch}.expert_used_count"]),
                "moe_intermediate_size": int(meta[f"{arch}.expert_feed_forward_length"]),
                "n_shared_experts": int(meta.get(f"{arch}.expert_shared_count", 0)),
                "first_k_dense_replace": int(meta.get(f"{arch}.leading_dense_block_count", 0)),
                "routed_scaling_factor": read_float(meta.get(f"{arch}.expert_weights_scale", 1.0)),
                "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", False)),
                "n_group": int(meta.get(f"{arch}.expert_group_count", 1) or 1),
                "topk_group": int(meta.get(f"{arch}.expert_group_used_count", 1) or 1), "sliding_window": None}
    # ERNIE 4.5: biases on every projection or none (use_bias).
    biased = _has(tensor_names, ".attn_q.bias")
    extra = {"use_bias": biased, "mlp_bias": biased}
    if arch == "ernie4_5-moe":
        extra.update(moe_num_experts=int(meta[f"{arch}.expert_count"]), moe_k=int(meta[f"{arch}.expert_used_count"]),
                     moe_intermediate_size=int(meta[f"{arch}.expert_feed_forward_length"]),
                     moe_num_shared_experts=int(meta.get(f"{arch}.expert_shared_count", 0)),
                     moe_layer_start_index=int(meta.get(f"{arch}.leading_dense_block_count", 0)),
                     moe_layer_interval=int(meta.get(f"{arch}.interleave_moe_layer_step", 1) or 1),
                     moe_layer_end_index=-1)
    return extra
