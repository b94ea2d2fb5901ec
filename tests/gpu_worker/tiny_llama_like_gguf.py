"""Tiny GGUFs of the Llama-like families with their own names and keys (Cohere's, GLM-4's, Seed-OSS's,
EXAONE 4.0's, ERNIE 4.5's, Arcee's, Nemotron's, OLMo's, dots.llm1's), written as llama.cpp's converter
writes them, for loader tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from transformers import AutoModelForCausalLM, PreTrainedModel

from .tiny_gguf import (
    _HF_TO_GGUF_BLOCK,
    _add_tokenizer,
    llama_cpp_permute,
    start_gguf,
    state_arrays,
    tiny_vocab,
    write_tensors_and_close,
)
from .tiny_hybrid_gguf import _perturbed
from .utils import make_config

# Our test kind -> (GGUF architecture, HF block names that llama.cpp names otherwise than Llama's).
LLAMA_LIKE_KINDS = {
    "cohere": ("command-r", {}),
    "cohere2": ("cohere2", {}),
    "glm4": ("glm4", {"post_self_attn_layernorm": "post_attention_norm", "post_attention_layernorm": "ffn_norm",
                      "post_mlp_layernorm": "post_ffw_norm", "mlp.gate_up_proj": "ffn_up"}),
    "seed_oss": ("seed_oss", {"post_attention_layernorm": "post_attention_norm"}),
    "exaone4": ("exaone4", {"post_attention_layernorm": "post_attention_norm",
                            "post_feedforward_layernorm": "post_ffw_norm"}),
    "ernie4_5": ("ernie4_5", {}),
    "ernie4_5_moe": ("ernie4_5-moe", {"mlp.shared_experts.gate_proj": "ffn_gate_shexp",
                                      "mlp.shared_experts.up_proj": "ffn_up_shexp",
                                      "mlp.shared_experts.down_proj": "ffn_down_shexp"}),
    "arcee": ("arcee", {}),
    "nemotron": ("nemotron", {}),
    "olmo": ("olmo", {}),
    "dots1": ("dots1", {"mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
                        "mlp.shared_experts.down_proj": "ffn_down_shexp"}),
}
# Those whose converter is a LlamaModel's (q/k rows permuted into pairs).
_PERMUTED = ("arcee", "olmo")


def tiny_llama_like(kind: str, seed: int = 0, **overrides) -> PreTrainedModel:
    """A tiny random model of ``kind`` (LLAMA_LIKE_KINDS; the shapes of tests.gpu_worker.utils'),
    over the tiny GGUF vocabulary, norms and biases away from 1 and 0."""
    config = make_config(kind, vocab_size=len(tiny_vocab()), max_position_embeddings=128, **overrides)
    return _perturbed(AutoModelForCausalLM.from_config(config, dtype=torch.float32), seed)


def _gguf_tensors(model: PreTrainedModel, kind: str) -> dict[str, np.ndarray]:
    config, (_, renamed) = model.config, LLAMA_LIKE_KINDS[kind]
    block_names = {**_HF_TO_GGUF_BLOCK, **renamed}
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "model.norm.bias": "output_norm.bias", "lm_head.weight": "output.weight"}
    out: dict[str, np.ndarray] = {}
    for hf_name, data in state_arrays(model, out):
        if hf_name in top:
            out[top[hf_name]] = data + (1.0 if kind == "nemotron" and hf_name == "model.norm.weight" else 0.0)
            continue
        _, _, layer, *rest = hf_name.split(".")
        module, part = ".".join(rest[:-1]), rest[-1]
        if module == "mlp.gate.moe_statics" or part == "e_score_correction_bias":  # (ERNIE's [1, experts])
            out[f"blk.{layer}.exp_probs_b.bias"] = data.reshape(-1)
            continue
        if kind == "nemotron" and part == "weight" and module.endswith("layernorm"):  # (its converter's 1 + w)
            data = data + 1.0
        if kind in _PERMUTED and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config.num_attention_heads if module.endswith("q_proj") else config.num_key_value_heads
            data = llama_cpp_permute(data, config.num_attention_heads, heads)
        out[f"blk.{layer}.{block_names[module]}.{part}"] = data
    return out


def write_tiny_llama_like_gguf(path: Path, model: PreTrainedModel, kind: str,
                               quant: GGMLQuantizationType = GGMLQuantizationType.F32) -> Path:
    """``model`` as llama.cpp's converter writes a file of its family (its keys, its names; Arcee's q/k
    rows permuted; Cohere2's window but not its pattern; EXAONE's pattern as a per-layer list)."""
    config, (arch, _) = model.config, LLAMA_LIKE_KINDS[kind]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    eps = getattr(config, "rms_norm_eps", None) or getattr(config, "layer_norm_eps", None) or 1e-5
    writer = start_gguf(path, arch, f"tiny-{kind}", config.num_hidden_layers, config.max_position_embeddings,
                        config.hidden_size, config.intermediate_size, config.num_attention_heads,
                        config.num_key_value_heads, eps)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)
    if kind.startswith("cohere"):
        writer.add_layer_norm_eps(config.layer_norm_eps)
        writer.add_logit_scale(config.logit_scale)
    if kind == "cohere2" or (kind == "exaone4" and config.sliding_window):
        writer.add_sliding_window(config.sliding_window)
    if kind == "exaone4" and config.sliding_window:
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])
    if kind == "nemotron":
        writer.add_layer_norm_eps(config.norm_eps)
    if kind == "olmo":
        writer.add_layer_norm_eps(1e-5)
        if config.clip_qkv is not None:
            writer.add_clamp_kqv(config.clip_qkv)
    if kind == "dots1":
        writer.add_expert_count(config.n_routed_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_count(config.n_shared_experts)
        writer.add_leading_dense_block_count(config.first_k_dense_replace)
        writer.add_expert_group_count(config.n_group)
        writer.add_expert_group_used_count(config.topk_group)
        writer.add_expert_weights_scale(config.routed_scaling_factor)
        writer.add_expert_weights_norm(config.norm_topk_prob)
    if kind == "ernie4_5_moe":
        writer.add_expert_count(config.moe_num_experts)
        writer.add_expert_used_count(config.moe_k)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_count(config.moe_num_shared_experts)
        writer.add_leading_dense_block_count(config.moe_layer_start_index)
        writer.add_interleave_moe_layer_step(config.moe_layer_interval)
    _add_tokenizer(writer)
    return write_tensors_and_close(writer, path, _gguf_tensors(model, kind), quant,
                                   lambda name, data: data.ndim >= 2 and "norm" not in name)
