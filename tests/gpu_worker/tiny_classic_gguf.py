"""Tiny GGUFs of the classic families whose checkpoints name their tensors otherwise than Llama's (Phi's
phi2, GPT-NeoX's gptneox, GPT-2's gpt2, GPTBigCode's starcoder, Falcon's falcon, BLOOM's bloom, MPT's
mpt), written with the keys and tensors llama.cpp's converter writes, for loader tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from transformers import AutoModelForCausalLM, PreTrainedModel

from .tiny_gguf import _add_tokenizer, tiny_vocab, write_tensors_and_close
from .tiny_hybrid_gguf import _perturbed
from .utils import make_config

# Our test kind -> (GGUF architecture, the checkpoint's layers prefix, its names -> llama.cpp's).
_GPT2_PARTS = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
               "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
CLASSIC_KINDS = {
    "phi": ("phi2", "model.layers", {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
                                     "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                                     "self_attn.dense": "attn_output", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down"}),
    "gpt_neox": ("gptneox", "gpt_neox.layers", {"input_layernorm": "attn_norm",
                                                "attention.query_key_value": "attn_qkv",
                                                "attention.dense": "attn_output",
                                                "post_attention_layernorm": "ffn_norm",
                                                "mlp.dense_h_to_4h": "ffn_up", "mlp.dense_4h_to_h": "ffn_down"}),
    "gpt2": ("gpt2", "transformer.h", _GPT2_PARTS),
    "gpt_bigcode": ("starcoder", "transformer.h", _GPT2_PARTS),
    "falcon": ("falcon", "transformer.h", {"input_layernorm": "attn_norm", "ln_attn": "attn_norm",
                                           "ln_mlp": "attn_norm_2", "self_attention.query_key_value": "attn_qkv",
                                           "self_attention.dense": "attn_output", "mlp.dense_h_to_4h": "ffn_up",
                                           "mlp.dense_4h_to_h": "ffn_down"}),
    "bloom": ("bloom", "transformer.h", {"input_layernorm": "attn_norm", "self_attention.query_key_value": "attn_qkv",
                                         "self_attention.dense": "attn_output", "post_attention_layernorm": "ffn_norm",
                                         "mlp.dense_h_to_4h": "ffn_up", "mlp.dense_4h_to_h": "ffn_down"}),
    "mpt": ("mpt", "transformer.blocks", {"norm_1": "attn_norm", "attn.Wqkv": "attn_qkv",
                                          "attn.out_proj": "attn_output", "norm_2": "ffn_norm", "ffn.up_proj": "ffn_up",
                                          "ffn.down_proj": "ffn_down"}),
}
_TOP_LEVEL = {"model.embed_tokens": "token_embd", "model.final_layernorm": "output_norm", "lm_head": "output",
              "gpt_neox.embed_in": "token_embd", "gpt_neox.final_layer_norm": "output_norm", "embed_out": "output",
              "transformer.wte": "token_embd", "transformer.wpe": "position_embd", "transformer.ln_f": "output_norm",
              "transformer.word_embeddings": "token_embd", "transformer.word_embeddings_layernorm": "token_embd_norm",
              "transformer.norm_f": "output_norm"}


def tiny_classic(kind: str, seed: int = 0, **overrides) -> PreTrainedModel:
    """A tiny random model of ``kind`` (CLASSIC_KINDS) over the tiny GGUF vocabulary, norms and biases
    away from 1 and 0; Phi's MLP 4 x hidden wide and a KV head per query head (what its converter
    states whatever the config says: phi-2's)."""
    if kind == "phi":
        overrides = {"intermediate_size": 256, "num_key_value_heads": 4, **overrides}
    if kind == "falcon":  # (its converter states 4 x hidden too)
        overrides = {"ffn_hidden_size": 256, **overrides}
    if kind == "mpt":  # (its converter writes no softmax_scale: every released MPT has none)
        overrides = {"attn_config": {"softmax_scale": None}, **overrides}
    config = make_config(kind, vocab_size=len(tiny_vocab()), max_position_embeddings=128, **overrides)
    return _perturbed(AutoModelForCausalLM.from_config(config, dtype=torch.float32), seed)


def _gguf_tensors(model: PreTrainedModel, kind: str, fused_qkv: bool) -> dict[str, np.ndarray]:
    config, (_, layers, parts) = model.config, CLASSIC_KINDS[kind]
    out: dict[str, np.ndarray] = {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy().copy()
        module, kind_of = hf_name.rsplit(".", 1)
        if module in _TOP_LEVEL:
            out[f"{_TOP_LEVEL[module]}.{kind_of}"] = data
            continue
        layer, part = module.removeprefix(f"{layers}.").split(".", 1)
        if part in ("attention.query_key_value", "self_attention.query_key_value") and kind in ("gpt_neox", "bloom"):
            # (per head -> q's, k's, v's)
            per_head = data.reshape(config.num_attention_heads, 3, -1, *data.shape[1:])
            data = np.concatenate([per_head[:, i].reshape(-1, *data.shape[1:]) for i in range(3)])
        if kind == "falcon" and part == "self_attention.query_key_value":  # (grouped by KV head -> q's, k's, v's)
            kv = config.num_key_value_heads
            grouped = data.reshape(kv, -1, config.head_dim, *data.shape[1:])
            data = np.concatenate([grouped[:, :-2].reshape(-1, *data.shape[1:]),
                                   grouped[:, -2].reshape(-1, *data.shape[1:]),
                                   grouped[:, -1].reshape(-1, *data.shape[1:])])
        if kind == "gpt2" and kind_of == "weight" and data.ndim == 2:  # (Conv1D's [in, out], transposed)
            data = data.T.copy()
        out[f"blk.{layer}.{parts[part]}.{kind_of}"] = data
    if kind == "bloom" and "output.weight" not in out:  # (its converter copies the tied embedding as the head)
        out["output.weight"] = out["token_embd.weight"].copy()
    if fused_qkv:  # (phi-2's first layout, Wqkv: q's, k's and v's rows in one attn_qkv)
        for name in [name for name in out if ".attn_q." in name]:
            parts_of = [out.pop(name.replace(".attn_q.", f".attn_{p}.")) for p in "qkv"]
            out[name.replace(".attn_q.", ".attn_qkv.")] = np.concatenate(parts_of)
    return out


def write_tiny_classic_gguf(path: Path, model: PreTrainedModel, kind: str,
                            quant: GGMLQuantizationType = GGMLQuantizationType.F32, fused_qkv: bool = False) -> Path:
    """``model`` as llama.cpp's converter writes a file of its family: only the keys it writes (Phi's,
    GPT-2's and GPTBigCode's MLP width as 4 x hidden, no head_count_kv for GPT-NeoX and GPT-2, one KV
    head for GPTBigCode), GPT-NeoX's query_key_value as all q rows then k's then v's, GPT-2's Conv1D
    weights transposed; ``fused_qkv``: Phi's q, k and v as one attn_qkv (files of phi-2's first layout)."""
    config, (arch, _, _) = model.config, CLASSIC_KINDS[kind]
    hidden, heads = config.hidden_size, config.num_attention_heads
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{kind}")
    writer.add_block_count(config.num_hidden_layers)
    # (Falcon's converter states 2048, whatever the model's; BLOOM's its seq_length, else n_embed.)
    context = {"falcon": 2048, "bloom": getattr(config, "seq_length", hidden), "mpt": getattr(config, "max_seq_len", 0)}
    writer.add_context_length(context.get(kind) or config.max_position_embeddings)
    writer.add_embedding_length(hidden)
    writer.add_head_count(heads)
    if kind == "phi":
        writer.add_feed_forward_length(4 * hidden)
        writer.add_head_count_kv(heads)
        writer.add_layer_norm_eps(config.layer_norm_eps)
        writer.add_rope_dimension_count(int(config.rope_parameters["partial_rotary_factor"] * hidden) // heads)
    elif kind == "gpt_neox":
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_rope_dimension_count(int(config.rope_parameters["partial_rotary_factor"] * (hidden // heads)))
        writer.add_parallel_residual(config.use_parallel_residual)
        writer.add_layer_norm_eps(config.layer_norm_eps)
    elif kind == "falcon":
        writer.add_feed_forward_length(4 * hidden)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_layer_norm_eps(config.layer_norm_epsilon)
    elif kind == "bloom":
        writer.add_feed_forward_length(4 * hidden)
        writer.add_head_count_kv(heads)
        writer.add_layer_norm_eps(config.layer_norm_epsilon)
    elif kind == "mpt":
        writer.add_feed_forward_length(4 * hidden)
        writer.add_layer_norm_eps(1e-5)
        attn = config.attn_config
        if attn.clip_qkv is not None:
            writer.add_clamp_kqv(attn.clip_qkv)
        writer.add_max_alibi_bias(attn.alibi_bias_max if attn.alibi else 0.0)
    else:
        writer.add_feed_forward_length(4 * hidden)
        writer.add_layer_norm_eps(config.layer_norm_epsilon)
        if kind == "gpt_bigcode":
            writer.add_head_count_kv(1)
    _add_tokenizer(writer)
    return write_tensors_and_close(writer, path, _gguf_tensors(model, kind, fused_qkv), quant,
                                   lambda name, data: data.ndim >= 2 and "norm" not in name and "position" not in name)
