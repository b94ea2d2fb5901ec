"""Turn a llama.cpp GGUF checkpoint (Llama, Mixtral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE, Gemma, Gemma 2,
Gemma 3, LFM2, LFM2-MoE; IBM Granite's, NVIDIA Nemotron-H's, TII Falcon-H1's and Mamba's in their own
modules: gpu_worker.gguf_granite, gguf_nemotron_h, gguf_falcon_h1, gguf_mamba_lm) into a Hugging Face model
directory.

The engine only knows how to load HF-style directories (config.json + safetensors + tokenizer files),
so a GGUF file is converted once, dequantised, and cached on disk. Later starts reuse the cached
directory, which loads in seconds instead of re-reading and dequantising the GGUF.

What differs between GGUF and HF Llama checkpoints, and is undone here:
  * tensor names (``blk.N.attn_q`` vs ``model.layers.N.self_attn.q_proj``);
  * for Llama (and Mixtral) only, llama.cpp's converter permutes the rows of q_proj/k_proj so its rotary kernel can
    rotate adjacent pairs, whereas HF rotates the two halves of each head (``rotate_half``); Qwen's
    files keep HF's order (llama.cpp rotates them NeoX-style, halves as HF does);
  * quantised blocks, expanded back to floats with ``gguf.quants.dequantize``;
  * Gemma's norm weights, which llama.cpp's converter stores as 1 + w (its kernel scales by the
    weight, Gemma's by 1 + the weight): 1 is taken off again. Gemma 2 and 3's four norms a layer
    are named post_attention_norm / ffn_norm / post_ffw_norm there; their attention scale, local
    RoPE base and window pattern are what llama.cpp derives when the file does not state them;
  * Llama 3.x's llama3 RoPE scaling, which llama.cpp writes as a ``rope_freqs`` tensor of
    per-frequency divisors: read back into the llama3 parameters that give them;
  * mixture-of-experts layers, whose experts llama.cpp stacks into one tensor per projection
    (``ffn_gate_exps`` ...: [experts, rows, columns]): split back into each expert's.
A split file (``<prefix>-00001-of-00003.gguf`` and its siblings) is converted from all its shards.
GGUF lists tensor dims innermost first (``[in, out]``); ``GGUFReader`` already exposes the data in
numpy (row-major) order, so the dequantised array has torch's ``[out, in]`` shape with no transpose.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType, ReaderField, ReaderTensor
from gguf.quants import dequantize
from safetensors.torch import save_file

from gpu_worker.gguf_classic import CLASSIC_ARCHITECTURES, CLASSIC_UNSET_KEYS, classic_config, classic_tensors
from gpu_worker.gguf_falcon_h1 import FALCON_H1_ARCHITECTURES, FALCON_H1_NAMES, falcon_h1_config
from gpu_worker.gguf_granite import GRANITE_ARCHITECTURES, GRANITE_MODEL_TYPES, GraniteTensors, granite_config
from gpu_worker.gguf_llama_like import (
    LLAMA_LIKE_ARCHITECTURES,
    LLAMA_LIKE_BLOCK_NAMES,
    LLAMA_LIKE_PERMUTED_QK,
    WEIGHTS_ONLY_PERMUTED,
    llama_like_config,
)
from gpu_worker.gguf_mamba2 import rename_hybrid_tensor
from gpu_worker.gguf_mamba_lm import (
    MAMBA1_ARCHITECTURES,
    MAMBA1_NAMES,
    MAMBA2_ARCHITECTURES,
    MAMBA2_LM_NAMES,
    mamba1_config,
    mamba2_lm_config,
)
from gpu_worker.gguf_nemotron_h import NEMOTRON_H_ARCHITECTURES, NEMOTRON_H_NAMES, nemotron_h_config
from gpu_worker.layers.rotary import compute_inv_freq

logger = logging.getLogger(__name__)

# Bumped whenever the converted directory changes (a cached conversion of an older version is redone).
# 2: linear RoPE from scale_linear / a factor without a type; end-of-turn/message ids stop generation.
# 3: Gemma, Gemma 2 and Gemma 3 files.
# 4: LFM2 files.
# 5: Qwen3-MoE and LFM2-MoE files (their stacked experts split into each expert's projections).
# 6: Mixtral (llama files with experts, stacked or one tensor per expert) and Qwen2-MoE files.
# 7: IBM Granite files (granite, granitemoe, granitehybrid), NVIDIA Nemotron-H's (nemotron_h), TII
#    Falcon-H1's (falcon-h1), Mamba / Falcon-Mamba's (mamba) and Mamba-2's (mamba2).
# 8: Cohere's (command-r, cohere2), GLM-4's (glm4), Seed-OSS's, EXAONE 4.0's, ERNIE 4.5's (ernie4_5,
#    ernie4_5-moe) and Arcee's files.
# 9: Phi's (phi2), GPT-NeoX's (gptneox), GPT-2's (gpt2), GPTBigCode's (starcoder), Nemotron's
#    (nemotron), OLMo's (olmo) and dots.llm1's (dots1) files.
CONVERTER_VERSION = 9
CACHE_ENV_VAR = "LLM_CLUSTER_CACHE_DIR"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
}
# Gemma 2 and 3 norm the attention's and the MLP's outputs too: their ffn_norm is the norm before the MLP.
_SANDWICH_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# LFM2's (its convert_hf_to_gguf.py names): the short convolutions, the attention's output and q/k
# norms, the SwiGLU's w1 / w3 / w2, and its two norms a layer.
_LFM2_BLOCK_NAMES = {
    "attn_norm": "operator_norm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.out_proj",
    "attn_q_norm": "self_attn.q_layernorm",
    "attn_k_norm": "self_attn.k_layernorm",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2",
    "shortconv.in_proj": "conv.in_proj",
    "shortconv.conv": "conv.conv",
    "shortconv.out_proj": "conv.out_proj",
}
# (LFM2's final norm, after the last layer, is transformers' embedding_norm: llama.cpp's token_embd_norm.)
_LFM2_TOP_LEVEL_NAMES = {**_TOP_LEVEL_NAMES, "token_embd_norm": "model.embedding_norm"}
# GGUF general.architecture -> HF (architecture, model_type). Only files of Llama's converter lineage have
# permuted q/k rows (_PERMUTED_QK_MODEL_TYPES: Llama, Mixtral — a "llama" file with experts, _MIXTRAL —
# IBM Granite's and Nemotron-H's).
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma": ("GemmaForCausalLM", "gemma"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "lfm2": ("Lfm2ForCausalLM", "lfm2"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "lfm2moe": ("Lfm2MoeForCausalLM", "lfm2_moe"),
    **GRANITE_ARCHITECTURES,
    **NEMOTRON_H_ARCHITECTURES,
    **FALCON_H1_ARCHITECTURES,
    **MAMBA1_ARCHITECTURES,
    **MAMBA2_ARCHITECTURES,
    **LLAMA_LIKE_ARCHITECTURES,
    **CLASSIC_ARCHITECTURES,
}
_MIXTRAL = ("MixtralForCausalLM", "mixtral")
# (The HF architectures of the classic families' files: their tensors renamed by gguf_classic.)
CLASSIC_HF = {hf for hf, _ in CLASSIC_ARCHITECTURES.values()}
_PERMUTED_QK_MODEL_TYPES = ("llama", "mixtral", "nemotron_h", *GRANITE_MODEL_TYPES, *LLAMA_LIKE_PERMUTED_QK)
# Mixture-of-experts files convert for these; their stacked experts (ffn_{gate,up,down}_exps:
# [experts, rows, columns]; older Mixtral files: one tensor per expert, ffn_{gate,up,down}.E) become each
# expert's projections, named as the model's checkpoints name them.
_QWEN_EXPERTS = ("mlp.experts", {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"})
_EXPERT_NAMES = {"mixtral": ("block_sparse_moe.experts", {"ffn_gate_exps": "w1", "ffn_up_exps": "w3",
                                                          "ffn_down_exps": "w2"}),
                 "qwen2_moe": _QWEN_EXPERTS, "qwen3_moe": _QWEN_EXPERTS, "ernie4_5_moe": _QWEN_EXPERTS,
                 "dots1": _QWEN_EXPERTS,
                 "lfm2_moe": ("feed_forward.experts", {"ffn_gate_exps": "w1", "ffn_up_exps": "w3",
                                                       "ffn_down_exps": "w2"})}
# Their routers (ffn_gate_inp), Qwen2-MoE's shared expert and its sigmoid gate, LFM2-MoE's expert bias.
_MOE_BLOCK_NAMES = {"mixtral": {**_BLOCK_NAMES, "ffn_gate_inp": "block_sparse_moe.gate"},
                    "qwen2_moe": {**_BLOCK_NAMES, "ffn_gate_inp": "mlp.gate",
                                  "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                                  "ffn_up_shexp": "mlp.shared_expert.up_proj",
                                  "ffn_down_shexp": "mlp.shared_expert.down_proj",
                                  "ffn_gate_inp_shexp": "mlp.shared_expert_gate"},
                    "qwen3_moe": {**_BLOCK_NAMES, "ffn_gate_inp": "mlp.gate"},
                    "lfm2_moe": {**_LFM2_BLOCK_NAMES, "ffn_gate_inp": "feed_forward.gate",
                                 "exp_probs_b": "feed_forward.expert_bias"}}
# Each family's block names where they are not Llama's: the MoE models' above, the Llama-like families'.
_FAMILY_BLOCK_NAMES = {**_MOE_BLOCK_NAMES, **{model_type: {**_BLOCK_NAMES, **names}
                                              for model_type, names in LLAMA_LIKE_BLOCK_NAMES.items()}}
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
# llama.cpp tells the 27B Gemma 2 / Gemma 3 apart by their layer counts, and scales their attention
# by 1 / sqrt(hidden / heads) instead of 1 / sqrt(head_dim) (transformers' query_pre_attn_scalar).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([\w.]+)\.(weight|bias)$")
_TOP_RE = re.compile(r"^(\w+)\.(weight|bias)$")
_EXPERT_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(ffn_(?:gate|up|down)_exps)\.weight$")
_SPLIT_EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


# --------------------------------------------------------------------------------------------- metadata


def field_value(field: ReaderField) -> Any:
    """Decode one GGUF metadata field into a Python scalar, string or list."""
    main_type = field.types[0]
    if main_type == GGUFValueType.ARRAY:
        item_type = field.types[-1]
        if item_type == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if main_type == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All metadata fields except the vocabulary-sized arrays, which only the tokenizer builder needs."""
    return {key: field_value(field) for key, field in reader.fields.items() if key not in _VOCAB_ARRAY_KEYS}


_VOCAB_ARRAY_KEYS = {
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
}


def _float32(value: Any) -> float:
    # GGUF stores these as float32; the shortest float32 repr gives back 1e-05 rather than 9.99999974e-06.
    return float(str(np.float32(value)))


def _require_key(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise ValueError(f"GGUF metadata lacks required key {key!r}")
    return meta[key]


def _rope_parameters(meta: dict[str, Any], arch: str, rope_theta: float) -> dict[str, Any]:
    # As llama.cpp reads them: a factor (rope.scaling.factor, or the older rope.scale_linear) with no
    # type means linear scaling; "none" means no scaling whatever the factor.
    factor = meta.get(f"{arch}.rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear"))
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    if scaling_type is None:
        scaling_type = "linear" if factor is not None and _float32(factor) not in (0.0, 1.0) else "none"
    if scaling_type == "none":
        return {"rope_type": "default", "rope_theta": rope_theta}
    if scaling_type == "linear":
        if factor is None:
            raise ValueError(f"GGUF metadata lacks required key '{arch}.rope.scaling.factor'")
        return {"rope_type": "linear", "rope_theta": rope_theta, "factor": _float32(factor)}
    raise ValueError(f"GGUF rope scaling type {scaling_type!r} is not supported by this converter")


# llama.cpp's converter writes Llama 3.x's llama3 RoPE scaling as this tensor of per-frequency divisors.
_ROPE_FREQS = "rope_freqs.weight"
# Meta's llama3 parameters (Llama 3.1-3.3; 3.2 differs in its factor only), tried first; then other
# (low_freq_factor, high_freq_factor, original length) choices, which only count through
# original / low and original / high (so low_freq_factor 1 covers every ratio).
_LLAMA3_STANDARD = (1.0, 4.0, 8192)
_LLAMA3_GRID = tuple((1.0, high, 2**k) for k in range(4, 18) for high in (2.0, 4.0, 8.0, 16.0, 32.0))


def _rope_from_freqs(tensor: ReaderTensor, rope_parameters: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """The llama3 rope parameters llama.cpp's rope_freqs tensor was computed from
    (LlamaModel.generate_extra_tensors: a divisor per frequency, ``factor`` for long wavelengths, 1
    for short ones, smoothly between): those reproducing it to float32 precision, with the
    project's own llama3 frequencies; refused when none does."""
    factors = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(-1))
    if rope_parameters["rope_type"] != "default":
        raise ValueError(f"GGUF has a {_ROPE_FREQS} tensor and {rope_parameters['rope_type']} rope scaling; only "
                         "one of them can be converted")
    if factors.numel() != head_dim // 2:
        raise ValueError(f"GGUF {_ROPE_FREQS} has {factors.numel()} values; heads of {head_dim} rotate "
                         f"{head_dim // 2} frequencies")
    factor = float(factors.max())
    if torch.allclose(factors, torch.ones_like(factors)):
        return rope_parameters  # (divisors of 1: plain RoPE)
    theta = rope_parameters["rope_theta"]
    base = compute_inv_freq(head_dim, theta, None)
    for low, high, original in (_LLAMA3_STANDARD, *_LLAMA3_GRID, _fit_llama3(factors, base, factor)):
        params = {"rope_type": "llama3", "rope_theta": theta, "factor": _float32(factor), "low_freq_factor": low,
                  "high_freq_factor": high, "original_max_position_embeddings": original}
        valid = 0 < low < high and original > 0
        if valid and torch.allclose(base / compute_inv_freq(head_dim, theta, params), factors, rtol=1e-5, atol=1e-5):
            return params
    raise ValueError(f"GGUF {_ROPE_FREQS} (factors {[round(f, 4) for f in factors.tolist()]}) matches no llama3 "
                     "rope scaling; serve the model's Hugging Face checkpoint directory instead")


def _fit_llama3(factors: torch.Tensor, inv_freq: torch.Tensor, factor: float) -> tuple[float, float, int]:
    """llama3's (low_freq_factor, high_freq_factor, original length) from the smoothly scaled
    frequencies, low_freq_factor set to 1: there ``1 / f = (1 - s) / factor + s`` with ``s``
    linear in ``1 / wavelength`` (``s = (original / wavelength - low) / (high - low)``); (0, 0, 0)
    when fewer than two frequencies are in that band."""
    smooth = (1 / factors.double() - 1 / factor) / (1 - 1 / factor)
    medium = (factors > 1 + 1e-4) & (factors < factor * (1 - 1e-4))
    if int(medium.sum()) < 2:
        return 0.0, 0.0, 0
    x = inv_freq.double()[medium] / (2 * math.pi)  # (1 / wavelength)
    slope, intercept = np.polyfit(x.numpy(), smooth[medium].numpy(), 1)
    if intercept >= 0:
        return 0.0, 0.0, 0
    # s = slope * x + intercept: slope = original / (high - low), intercept = -low / (high - low).
    high = 1.0 - 1.0 / float(intercept)
    original = round(float(slope) * (high - 1.0))
    return 1.0, round(high, 4), original


def build_hf_config(reader: GGUFReader, dtype: torch.dtype = torch.float32,
                    tensors: list[ReaderTensor] | None = None) -> dict[str, Any]:
    """A ``LlamaConfig``-compatible dict derived from the GGUF metadata and tensor list (``tensors``:
    every shard's of a split file, whose first shard ``reader`` reads; None: the reader's own)."""
    meta = read_metadata(reader)
    tensors = reader.tensors if tensors is None else tensors
    arch = _require_key(meta, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; one of {', '.join(_ARCHITECTURES)} "
                         "can be converted")
    architecture, model_type = _ARCHITECTURES[arch]
    experts = int(meta.get(f"{arch}.expert_count", 0) or 0)
    if experts and arch == "llama":  # (llama.cpp's Mixtral files)
        architecture, model_type = _MIXTRAL
    if experts and model_type not in _EXPERT_NAMES and arch not in ("granitemoe", "granitehybrid"):
        raise ValueError(f"GGUF mixture-of-experts files ({experts} experts) of {arch!r} are not converted (Mixtral, "
                         "Qwen2-MoE, Qwen3-MoE and LFM2-MoE ones are); serve the model's Hugging Face checkpoint "
                         "directory instead")
    tensor_names = {t.name for t in tensors}

    hidden = int(_require_key(meta, f"{arch}.embedding_length"))
    n_heads = int(_require_key(meta, f"{arch}.attention.head_count"))
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", n_heads)
    # (LFM2, Granite 4.0-H and Nemotron-H list them per layer, 0 in their recurrent (and MLP) layers.)
    n_kv_heads = max(int(k) for k in kv_heads) if isinstance(kv_heads, list) else int(kv_heads)
    # (A Mamba file's head count is a placeholder 0.)
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // n_heads if n_heads else 0))
    rope_theta = _float32(meta.get(f"{arch}.rope.freq_base", 10000.0))
    embed = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    rope_parameters = _rope_parameters(meta, arch, rope_theta)
    rope_freqs = next((t for t in tensors if t.name == _ROPE_FREQS), None)
    if rope_freqs is not None:
        rope_parameters = _rope_from_freqs(rope_freqs, rope_parameters, head_dim)
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        # (Nemotron-H lists it per layer, 0 but in its MLP layers.)
        "intermediate_size": max(int(v) for v in ffn) if isinstance(ffn := _require_key(
            meta, f"{arch}.feed_forward_length"), list) else int(ffn),
        "num_hidden_layers": int(_require_key(meta, f"{arch}.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        # (LFM2's default is 1e-5 where a file leaves the key out, as transformers' Lfm2Config has it.)
        "rms_norm_eps": _float32(meta.get(f"{arch}.attention.layer_norm_rms_epsilon",
                                          1e-5 if arch in ("lfm2", "lfm2moe") else 1e-6)),
        # Both spellings: transformers 4.x reads rope_theta/rope_scaling, 5.x reads rope_parameters.
        "rope_theta": rope_theta,
        "rope_scaling": None if rope_parameters["rope_type"] == "default" else rope_parameters,
        "rope_parameters": rope_parameters,
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        # The embedding rows, not the optional vocab_size key: the weights must fit the config exactly.
        "vocab_size": int(embed.shape[-1]),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": any(name.endswith(".attn_q.bias") for name in tensor_names),
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": _DTYPE_NAMES[dtype],
    }
    if arch in _GEMMA_ARCHITECTURES:
        config.update(_gemma_config(meta, arch, config))
    elif arch in ("lfm2", "lfm2moe"):
        config.update(_lfm2_config(meta, kv_heads, config, tensor_names, arch))
    elif model_type.startswith("qwen"):
        config["use_sliding_window"] = False  # (llama.cpp's Qwen files run full attention in every layer)
    # (each family's own keys; the Granite family reads its experts itself)
    if arch in GRANITE_ARCHITECTURES:
        config.update(granite_config(meta, arch, config, kv_heads, experts, tensors))
    elif arch in NEMOTRON_H_ARCHITECTURES:
        config.update(nemotron_h_config(meta, arch, config, kv_heads, tensor_names))
    elif arch in FALCON_H1_ARCHITECTURES:
        config.update(falcon_h1_config(meta, arch, config, tensor_names))
    elif arch in MAMBA1_ARCHITECTURES or arch in MAMBA2_ARCHITECTURES:
        config.update((mamba1_config if arch in MAMBA1_ARCHITECTURES else mamba2_lm_config)(
            meta, arch, config, tensor_names))
        del config["max_position_embeddings"]  # (the file's 2^20 is a placeholder; Mamba states no length)
    elif arch in LLAMA_LIKE_ARCHITECTURES:
        config.update(llama_like_config(meta, arch, config, tensor_names, _float32))
    elif arch in CLASSIC_ARCHITECTURES:
        config.update(classic_config(meta, arch, config, tensors, _float32))
        for key in CLASSIC_UNSET_KEYS.get(arch, ()):
            del config[key]
    elif experts:
        config.update(_experts_config(meta, arch, experts, tensors))
    if arch in NEMOTRON_H_ARCHITECTURES or arch in MAMBA1_ARCHITECTURES or arch in MAMBA2_ARCHITECTURES:
        del config["rope_scaling"]  # (no positions: transformers' configs would warn of the key)
    return config


def _output_rows(tensors: list[ReaderTensor], suffix: str) -> int | None:
    """The output rows of the first tensor named ``...suffix`` (GGUF lists a matrix's dimensions
    columns first: [in, out] or, stacked, [in, out, experts]); None without one."""
    tensor = next((t for t in tensors if t.name.endswith(suffix)), None)
    return None if tensor is None else int(tensor.shape[1])


def _experts_config(meta: dict[str, Any], arch: str, experts: int, tensors: list[ReaderTensor]) -> dict[str, Any]:
    """A mixture-of-experts file's routing, as llama.cpp runs it: Mixtral's softmax top k renormalised,
    its experts feed_forward_length wide; Qwen2-MoE's not renormalised, beside a shared expert behind
    a sigmoid gate; Qwen3-MoE's renormalised; all three in every layer. LFM2-MoE's sigmoid scores
    through the expert bias (exp_probs_b), renormalised and scaled (expert_weights_scale), after
    leading_dense_block_count dense layers. The experts' (and shared expert's) widths where a file
    leaves their keys out (early Qwen1.5-MoE conversions): their tensors' rows."""
    tensor_names = {t.name for t in tensors}
    used = int(_require_key(meta, f"{arch}.expert_used_count"))
    if arch == "llama":  # (Mixtral: transformers' MixtralConfig names; no sliding window in llama.cpp)
        width = meta.get(f"{arch}.expert_feed_forward_length") or _require_key(meta, f"{arch}.feed_forward_length")
        return {"num_local_experts": experts, "num_experts_per_tok": used, "intermediate_size": int(width),
                "sliding_window": None}
    width = meta.get(f"{arch}.expert_feed_forward_length") or _output_rows(tensors, ".ffn_up_exps.weight")
    if width is None:
        raise ValueError(f"GGUF file: no {arch}.expert_feed_forward_length and no ffn_up_exps tensor to read the "
                         "experts' width from")
    config: dict[str, Any] = {"num_experts": experts, "num_experts_per_tok": used, "moe_intermediate_size": int(width),
                              "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", arch != "qwen2moe"))}
    if arch in ("qwen2moe", "qwen3moe"):
        config.update(decoder_sparse_step=1, mlp_only_layers=[])
    if arch == "qwen2moe":
        config["shared_expert_intermediate_size"] = int(meta.get(f"{arch}.expert_shared_feed_forward_length")
                                                        or _output_rows(tensors, ".ffn_up_shexp.weight") or 0)
    elif arch == "lfm2moe":
        config.update(num_dense_layers=int(meta.get(f"{arch}.leading_dense_block_count", 0)),
                      use_expert_bias=any(name.endswith(".exp_probs_b.bias") for name in tensor_names),
                      routed_scaling_factor=_float32(meta.get(f"{arch}.expert_weights_scale", 1.0) or 1.0))
    return config


def _lfm2_config(meta: dict[str, Any], kv_heads: Any, config: dict[str, Any], tensor_names: set[str],
                 arch: str = "lfm2") -> dict[str, Any]:
    """LFM2's config keys: its layer kinds (a layer with KV heads attends, else it is a short
    convolution), the convolution's taps, its norm epsilon's name; feed_forward_length is the MLP's
    width already adjusted (no block_auto_adjust_ff_dim)."""
    layers = int(config["num_hidden_layers"])
    per_layer = kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
    if len(per_layer) != layers:
        raise ValueError(f"lfm2.attention.head_count_kv lists {len(per_layer)} layers, the file has {layers}")
    return {"layer_types": ["full_attention" if int(k) else "conv" for k in per_layer],
            "conv_L_cache": int(_require_key(meta, f"{arch}.shortconv.l_cache")),
            "conv_bias": any(name.startswith("blk.") and ".shortconv." in name and name.endswith(".bias")
                             for name in tensor_names),
            "norm_eps": config["rms_norm_eps"], "block_auto_adjust_ff_dim": False}


def _gemma_config(meta: dict[str, Any], arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma's config keys, as llama.cpp reads the file (its defaults where the file is silent)."""
    extra: dict[str, Any] = {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh"}
    if arch == "gemma":
        return extra
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    is_27b = config["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]
    extra["query_pre_attn_scalar"] = hidden // heads if is_27b else config["head_dim"]
    window = meta.get(f"{arch}.attention.sliding_window")
    if arch == "gemma2":
        # llama.cpp's defaults for files written before these keys existed: a 4096 window, caps 50 / 30.
        extra["sliding_window"] = int(window or 4096)
        for key, default in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)):
            extra[key] = _float32(meta.get(f"{arch}.{key}", default))
        return extra
    extra["sliding_window"] = int(window) if window else None
    extra["attn_logit_softcapping"] = None
    final_cap = meta.get(f"{arch}.final_logit_softcapping")
    extra["final_logit_softcapping"] = None if final_cap is None else _float32(final_cap)
    # Gemma 3 rotates its windowed layers with plain RoPE of their own base (10k unless the file says).
    local_theta = _float32(meta.get(f"{arch}.rope.freq_base_swa", 10000.0))
    extra["rope_local_base_freq"] = local_theta
    extra["rope_parameters"] = {"full_attention": config["rope_parameters"],
                                "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 6)
    if not window:
        # (llama.cpp's converter writes no window for a pattern of 1: every layer global, global RoPE.)
        extra["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    elif isinstance(pattern, list):
        if len(pattern) != config["num_hidden_layers"]:
            raise ValueError(f"GGUF {arch}.attention.sliding_window_pattern lists {len(pattern)} layers, "
                             f"the model has {config['num_hidden_layers']}")
        extra["layer_types"] = ["sliding_attention" if windowed else "full_attention" for windowed in pattern]
    else:
        extra["sliding_window_pattern"] = int(pattern)
    return extra


# ---------------------------------------------------------------------------------------------- tensors


def unpermute_qk(weights: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's ``permute`` (convert_hf_to_gguf.py, LlamaModel) of q_proj/k_proj rows.

    llama.cpp reorders each head's rows from ``[half0, half1]`` to interleaved pairs so that its
    rotary kernel rotates adjacent elements; HF's ``rotate_half`` expects the halves back.
    ``n_heads`` is the number of heads the rows belong to (num_key_value_heads for k_proj).
    Works for weights ``[out, in]`` and biases ``[out]`` alike since only rows move.
    """
    rows = weights.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"cannot un-permute {rows} rows into {n_heads} heads of even size")
    half = rows // n_heads // 2
    return weights.reshape(n_heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def gguf_to_hf_name(name: str, model_type: str = "llama") -> str:
    """Map a llama.cpp tensor name to the HF parameter name (``model_type``: the HF config's)."""
    block = _BLOCK_RE.match(name)
    if block:
        layer, part, kind = block.groups()
        names = (_SANDWICH_BLOCK_NAMES if model_type in ("gemma2", "gemma3_text")
                 else _LFM2_BLOCK_NAMES if model_type == "lfm2" else _FAMILY_BLOCK_NAMES.get(model_type, _BLOCK_NAMES))
        if part not in names:
            raise ValueError(f"unexpected GGUF tensor {name!r}: unknown block component {part!r}")
        if part == "exp_probs_b":  # (LFM2-MoE's expert_bias: a bare tensor, which its converter named ".bias")
            return f"model.layers.{layer}.{names[part]}"
        return f"model.layers.{layer}.{names[part]}.{kind}"
    top = _TOP_RE.match(name)
    top_names = _LFM2_TOP_LEVEL_NAMES if model_type in ("lfm2", "lfm2_moe") else _TOP_LEVEL_NAMES
    if top and top.group(1) in top_names:
        return f"{top_names[top.group(1)]}.{top.group(2)}"
    raise ValueError(f"unexpected GGUF tensor {name!r}: no Hugging Face equivalent")


def _heads_for(name: str, config: dict[str, Any]) -> int | None:
    """The heads whose rows llama.cpp permuted in this tensor (None: not permuted; OLMo's converter
    permutes the weights alone, not biases)."""
    if config["model_type"] not in _PERMUTED_QK_MODEL_TYPES or (config["model_type"] in WEIGHTS_ONLY_PERMUTED
                                                                 and not name.endswith(".weight")):
        return None
    if ".attn_q." in name:
        return int(config["num_attention_heads"])
    if ".attn_k." in name:
        return int(config["num_key_value_heads"])
    return None


# The state-space families' checkpoint names, by model type (their tensors renamed by rename_hybrid_tensor).
_FAMILY_NAMES = {"nemotron_h": NEMOTRON_H_NAMES, "falcon_h1": FALCON_H1_NAMES, "mamba": MAMBA1_NAMES,
                 "falcon_mamba": MAMBA1_NAMES, "mamba2": MAMBA2_LM_NAMES}


def iter_hf_tensors(
    reader: GGUFReader, config: dict[str, Any], dtype: torch.dtype = torch.float32
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` one at a time so peak memory stays near one dequantised tensor."""
    return _hf_tensors(reader.tensors, config, dtype)


def _hf_tensors(
    tensors: list[ReaderTensor], config: dict[str, Any], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    # (Granite's and the state-space families' renaming, reshaping and merging: their own modules'.)
    granite = (GraniteTensors(config, _TOP_LEVEL_NAMES, _BLOCK_NAMES) if config["model_type"] in GRANITE_MODEL_TYPES
               else None)
    family_names = _FAMILY_NAMES.get(config["model_type"])
    convert = (granite.convert if granite is not None
               else functools.partial(rename_hybrid_tensor, names=family_names) if family_names is not None
               else functools.partial(classic_tensors, config=config) if config["architectures"][0] in CLASSIC_HF
               else None)
    for tensor in tensors:
        if tensor.name == _ROPE_FREQS:
            continue  # (read into the config's rope scaling)
        expected_shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        weights = dequantize(tensor.data, tensor.tensor_type)
        if weights.shape != expected_shape:
            # Would mean the reader's layout assumption above no longer holds; refuse rather than guess.
            raise ValueError(f"GGUF tensor {tensor.name!r} dequantised to {weights.shape}, expected {expected_shape}")
        heads = _heads_for(tensor.name, config)
        if heads is not None:
            weights = unpermute_qk(weights, heads)
        # Copy: F32/F16 tensors come back as views of the read-only memory map.
        array = np.array(weights, dtype=np.float32, order="C", copy=True)
        if convert is not None:
            for name, converted in convert(tensor.name, array):
                yield name, torch.from_numpy(np.ascontiguousarray(converted)).to(dtype)
            continue
        if (config["model_type"].startswith("gemma") or config["model_type"] == "nemotron") \
                and tensor.name.endswith("norm.weight"):
            array -= 1.0  # (llama.cpp stored Gemma's and Nemotron's 1 + w)
        if tensor.name.endswith(".shortconv.conv.weight"):
            array = array[:, None, :]  # (llama.cpp squeezed LFM2's Conv1d weight [channels, 1, taps])
        if tensor.name.endswith(".ffn_gate_inp_shexp.weight"):
            array = array.reshape(1, -1)  # (Qwen2-MoE's shared expert gate: one output, [1, hidden])
        if config["model_type"] == "ernie4_5_moe" and tensor.name.endswith(".exp_probs_b.bias"):
            array = array.reshape(1, -1)  # (ERNIE's correction bias: one group's, [1, experts])
        stacked, split = _EXPERT_BLOCK_RE.match(tensor.name), _SPLIT_EXPERT_RE.match(tensor.name)
        if stacked is not None or split is not None:
            prefix, projections = _EXPERT_NAMES[config["model_type"]]
            if stacked is not None:
                layer, part = stacked.groups()
                per_expert = list(enumerate(array))
            else:  # (one expert's projection: older Mixtral files)
                layer, kind, expert = split.groups()
                part, per_expert = f"ffn_{kind}_exps", [(int(expert), array)]
            for expert, weights in per_expert:
                name = f"model.layers.{layer}.{prefix}.{expert}.{projections[part]}.weight"
                yield name, torch.from_numpy(np.ascontiguousarray(weights)).to(dtype)
            continue
        yield gguf_to_hf_name(tensor.name, config["model_type"]), torch.from_numpy(array).to(dtype)
    if granite is not None:
        granite.finish()


def load_gguf(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.float32
) -> tuple[dict[str, Any], Iterator[tuple[str, torch.Tensor]]]:
    """Open a GGUF file (every shard of a split one) and return its HF config dict plus a lazy
    iterator over HF-named tensors."""
    shards = gguf_shards(Path(path))
    readers = [GGUFReader(os.fspath(shard)) for shard in shards]
    _check_split(readers, shards)
    tensors = [tensor for reader in readers for tensor in reader.tensors]
    config = build_hf_config(readers[0], dtype, tensors)
    return config, _hf_tensors(tensors, config, dtype)


def gguf_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The HF config a GGUF converts to, read before any weight is dequantised; its torch_dtype is
    None (the dtype the converter is asked for)."""
    config, _ = load_gguf(path)
    return {**config, "torch_dtype": None}


# ------------------------------------------------------------------------------------------ split files

# llama.cpp's split GGUFs (llama-gguf-split, or a converter's --split-max-*): <prefix>-00001-of-00003.gguf
# and its siblings, the first holding the metadata, each a share of the tensors (llama_split_path).
_SPLIT_NAME_RE = re.compile(r"^(.+)-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_MERGE_HINT = "or merge them into one file with `llama-gguf-split --merge <first shard> <output.gguf>`"


def split_prefix(gguf_path: Path) -> str | None:
    """The ``<prefix>`` of a shard's name (``<prefix>-00001-of-00003.gguf``); None: not a shard of several."""
    match = _SPLIT_NAME_RE.match(gguf_path.name)
    return match[1] if match and int(match[3]) > 1 else None


def gguf_shards(gguf_path: Path) -> list[Path]:
    """The files holding ``gguf_path``'s model, first shard first: itself, or every shard of the
    split file it is one shard of (whichever is named), which must sit beside it."""
    prefix = split_prefix(gguf_path)
    if prefix is None:
        return [gguf_path]
    count = int(_SPLIT_NAME_RE.match(gguf_path.name)[3])
    shards = [gguf_path.with_name(f"{prefix}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [shard.name for shard in shards if not shard.is_file()]
    if missing:
        raise FileNotFoundError(f"split GGUF {gguf_path}: shard(s) {', '.join(missing)} not found beside it; put "
                                f"all {count} shards in one folder, {_MERGE_HINT}")
    return shards


def _check_split(readers: list[GGUFReader], shards: list[Path]) -> None:
    """Refuse a split file whose shards are not the ones its metadata lists: converting a part of
    a model would cache a directory that can never load."""
    meta = read_metadata(readers[0])
    count = int(meta.get("split.count", 1) or 1)
    if count != len(shards):
        raise ValueError(f"GGUF {shards[0]} is shard 1 of {count} (split.count), but its name does not say so "
                         f"(llama.cpp names them <prefix>-00001-of-{count:05d}.gguf): rename the shards as "
                         f"llama.cpp does, {_MERGE_HINT}")
    if count == 1:
        return
    for index, reader in enumerate(readers):
        number = reader.fields.get("split.no")
        if number is None or field_value(number) != index:
            raise ValueError(f"GGUF shard {shards[index]} is not shard {index + 1} of its split file (split.no); "
                             f"{_MERGE_HINT}")
    expected = meta.get("split.tensors.count")
    found = sum(len(reader.tensors) for reader in readers)
    if expected is not None and found != int(expected):
        raise ValueError(f"split GGUF {shards[0]}: its {count} shards hold {found} tensors, split.tensors.count "
                         f"says {expected}; {_MERGE_HINT}")


# -------------------------------------------------------------------------------------------- tokenizer


def build_tokenizer(gguf_path: Path) -> Any:
    """A transformers fast tokenizer rebuilt from the tokenizer embedded in the GGUF file."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # deferred: importing transformers costs seconds

    try:
        tokenizer = AutoTokenizer.from_pretrained(os.fspath(gguf_path.parent), gguf_file=gguf_path.name)
    except ValueError as e:
        if "is not supported yet" not in str(e):
            raise
        # transformers reads no model config from this architecture's files (Gemma 1), only their
        # tokenizer: build that alone.
        tokenizer = PreTrainedTokenizerFast.from_pretrained(os.fspath(gguf_path.parent), gguf_file=gguf_path.name)
    if not getattr(tokenizer, "chat_template", None):
        template = _chat_template(gguf_path)
        if template:
            tokenizer.chat_template = template
    return tokenizer


def _save_tokenizer(gguf_path: Path, out_dir: Path, max_length: int | None) -> None:
    tokenizer = build_tokenizer(gguf_path)
    # Otherwise transformers records "unlimited" and never warns about over-long prompts.
    if max_length is not None:  # (a Mamba model's states no length: the tokenizer keeps no limit)
        tokenizer.model_max_length = int(max_length)
    tokenizer.save_pretrained(os.fspath(out_dir))
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    # Loader-call artefacts that would wrongly pin later loads to local files.
    for key in ("is_local", "local_files_only"):
        tokenizer_config.pop(key, None)
    # transformers 5 writes its new class name, which 4.x cannot load; the old name works in both.
    if tokenizer_config.get("tokenizer_class") == "TokenizersBackend":
        tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    _write_json(config_path, tokenizer_config)


def _chat_template(gguf_path: Path) -> str | None:
    field = GGUFReader(os.fspath(gguf_path)).fields.get("tokenizer.chat_template")
    return None if field is None else field_value(field)


# ------------------------------------------------------------------------------------------- conversion


def _save_weights(tensors: Iterator[tuple[str, torch.Tensor]], out_dir: Path, max_shard_bytes: int) -> None:
    """Write safetensors shards, bounded in size so big models never sit in memory whole."""
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total_bytes = 0
    shards: list[tuple[Path, list[str]]] = []
    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + size > max_shard_bytes:
            shards.append(_flush_shard(shard, out_dir, len(shards)))
            shard, shard_bytes = {}, 0
        shard[name] = tensor
        shard_bytes += size
        total_bytes += size
    shards.append(_flush_shard(shard, out_dir, len(shards)))
    _name_shards(shards, out_dir, total_bytes)


def _flush_shard(tensors: dict[str, torch.Tensor], out_dir: Path, index: int) -> tuple[Path, list[str]]:
    path = out_dir / f"shard-{index:05d}.tmp.safetensors"
    save_file(tensors, os.fspath(path), metadata={"format": "pt"})
    return path, list(tensors)


def _name_shards(shards: list[tuple[Path, list[str]]], out_dir: Path, total_bytes: int) -> None:
    """Rename shards to HF's conventions; several shards also need an index mapping tensor to file."""
    if len(shards) == 1:
        shards[0][0].rename(out_dir / "model.safetensors")
        return
    weight_map: dict[str, str] = {}
    for i, (tmp, names) in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tmp.rename(out_dir / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    _write_json(out_dir / "model.safetensors.index.json", index)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


# End-of-turn tokens llama.cpp finds by their text when a file names none (Gemma's files do not).
_END_OF_TURN_TEXTS = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>", "<EOT>")


def _end_of_turn_by_text(reader: GGUFReader) -> int | None:
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        return None
    position = {bytes(field.parts[i]).decode("utf-8", errors="replace"): n for n, i in enumerate(field.data)}
    return next((position[text] for text in _END_OF_TURN_TEXTS if text in position), None)


def _generation_config(config: dict[str, Any], meta: dict[str, Any], end_of_turn: int | None = None
                       ) -> dict[str, Any]:
    # The engine stops on every eos id of generation_config.json: the GGUF's eos and, as llama.cpp
    # does, its end-of-turn and end-of-message tokens (Llama-3 chat files: eos 128001, eot 128009),
    # the end of turn found by its text (``end_of_turn``) where the file names none.
    data: dict[str, Any] = {"_from_model_config": True}
    for key in ("bos_token_id", "pad_token_id"):
        if config.get(key) is not None:
            data[key] = config[key]
    if meta.get("tokenizer.ggml.eot_token_id") is None and end_of_turn is not None:
        meta = {**meta, "tokenizer.ggml.eot_token_id": end_of_turn}
    stops = [meta.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    stops = list(dict.fromkeys(t for t in stops if t is not None))
    if stops:
        data["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    return data


def convert_gguf_to_hf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write a complete HF model directory for ``gguf_path`` into the existing, empty ``out_dir``.

    Not atomic by itself; ``ensure_converted`` wraps it with a temp dir + rename.
    """
    shards, out = gguf_shards(Path(gguf_path)), Path(out_dir)
    # (A split file's metadata and tokenizer are in its first shard; its tensors in all of them.)
    gguf_path = shards[0]
    config, tensors = load_gguf(gguf_path, dtype)
    _save_weights(tensors, out, max_shard_bytes)
    _write_json(out / "config.json", config)
    reader = GGUFReader(gguf_path)
    _write_json(out / "generation_config.json",
                _generation_config(config, read_metadata(reader), _end_of_turn_by_text(reader)))
    _save_tokenizer(gguf_path, out, config.get("max_position_embeddings"))
    stat = gguf_path.stat()
    source = {"gguf_path": os.fspath(gguf_path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
              "converter_version": CONVERTER_VERSION, "dtype": _DTYPE_NAMES[dtype]}
    if len(shards) > 1:
        source["shards"] = [os.fspath(shard.resolve()) for shard in shards]
    _write_json(out / "gguf_source.json", source)
    return out


# ------------------------------------------------------------------------------------------------ cache


def default_cache_root() -> Path:
    configured = os.environ.get(CACHE_ENV_VAR)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "llm-cluster"


def cache_key(gguf_path: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> str:
    """``<stem>-<hash>``: the hash covers path, size and mtime (of every shard of a split file,
    whichever is named) so a replaced file is converted again."""
    shards = [shard.resolve() for shard in gguf_shards(Path(gguf_path))]
    files = "|".join(f"{shard}|{shard.stat().st_size}|{shard.stat().st_mtime_ns}" for shard in shards)
    fingerprint = f"{files}|{_DTYPE_NAMES[dtype]}|v{CONVERTER_VERSION}"
    digest = hashlib.sha256(fingerprint.encode()).hexdigest()[:12]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", split_prefix(shards[0]) or shards[0].stem)
    return f"{stem}-{digest}"


def _is_complete(model_dir: Path) -> bool:
    return (model_dir / "config.json").is_file() and (model_dir / "gguf_source.json").is_file()


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    # Several workers on one node may resolve the same GGUF at once; only one should pay for conversion.
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_converted(
    gguf_path: str | os.PathLike[str],
    cache_root: str | os.PathLike[str] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Return the cached HF directory for ``gguf_path``, converting it first if needed."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    root.mkdir(parents=True, exist_ok=True)
    key = cache_key(gguf_path, dtype)
    final = root / key
    if _is_complete(final):
        return final
    with _file_lock(root / f".{key}.lock"):
        if _is_complete(final):
            return final
        _convert_atomically(gguf_path, root, final, dtype)
    return final


def _make_readable(model_dir: Path) -> None:
    # mkdtemp and safetensors create owner-only entries; the cache may be shared by several service users.
    model_dir.chmod(0o755)
    for entry in model_dir.iterdir():
        entry.chmod(0o644)


def _convert_atomically(gguf_path: Path, root: Path, final: Path, dtype: torch.dtype) -> None:
    # Same filesystem as the destination, so the rename below is atomic: readers see all or nothing.
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        start = time.perf_counter()
        convert_gguf_to_hf(gguf_path, tmp, dtype)
        _make_readable(tmp)
        if final.exists():
            # Leftover from an interrupted run of an older layout; it failed _is_complete.
            shutil.rmtree(final)
        tmp.rename(final)
        logger.info("converted %s to %s in %.1fs", gguf_path, final, time.perf_counter() - start)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
