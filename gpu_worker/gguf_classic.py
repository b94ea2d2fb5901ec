"""llama.cpp's GGUF files of the classic families whose checkpoints name their tensors otherwise than
Llama's: Phi (phi2), GPT-NeoX (gptneox), GPT-2 (gpt2) and GPTBigCode (starcoder), read back into their
Hugging Face configs and tensor names (gpu_worker.gguf_loader does the reading), Falcon's (falcon), and
the ALiBi families' BLOOM (bloom) and MPT (mpt).

What llama.cpp's converter does to them, and is undone or read here:
  * no q/k rows are permuted (llama.cpp rotates these families' halves, as transformers does);
  * their norms are LayerNorms with biases (attention.layer_norm_epsilon), the rotary width of Phi's
    and GPT-NeoX's heads is rope.dimension_count (none written: a base of 10000), the MLP's width is
    4 x n_embd for Phi, GPT-2 and GPTBigCode whatever the config said;
  * GPT-NeoX's fused query_key_value, each head's q, k and v rows together in the checkpoint, is
    written as all q rows, then k's, then v's (attn_qkv): put back per head; its parallel residual is
    use_parallel_residual;
  * GPT-2's Conv1D weights ([in, out]) are written transposed: transposed back; its learned positions
    are position_embd; GPTBigCode's files state one KV head (multi-query);
  * Phi's head has a bias (output.bias); a phi-2 file of Microsoft's first layout holds q, k and v as
    one attn_qkv (split into the three);
  * Falcon's query_key_value, grouped by KV head in its checkpoints (each group's queries, then its
    key and value), is written as all q rows, then k's, then v's: regrouped; its layout is read from
    the file (a second norm, attn_norm_2, or more than one KV head: new_decoder_architecture; falcon-7b
    otherwise), its context from the key the converter always writes as 2048;
  * BLOOM's query_key_value (each head's q, k and v together) is written as GPT-NeoX's is: put back
    per head; its head, tied in its checkpoints, is written as a copy of the embedding (output): read
    as tied when the two hold the same bytes; its context is seq_length, or n_embed where its config
    has none (read then as BLOOM's 2048);
  * MPT's norms have no biases; its clip_qkv is attention.clamp_kqv, its alibi_bias_max
    attention.max_alibi_bias (0: no ALiBi, refused), its layer norms' epsilon always 1e-5; its
    softmax_scale is not written (None in every release).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import ReaderTensor

# GGUF general.architecture -> HF (architecture, model_type).
CLASSIC_ARCHITECTURES = {
    "phi2": ("PhiForCausalLM", "phi"),
    "gptneox": ("GPTNeoXForCausalLM", "gpt_neox"),
    "gpt2": ("GPT2LMHeadModel", "gpt2"),
    "starcoder": ("GPTBigCodeForCausalLM", "gpt_bigcode"),
    "falcon": ("FalconForCausalLM", "falcon"),
    "bloom": ("BloomForCausalLM", "bloom"),
    "mpt": ("MptForCausalLM", "mpt"),
}


@dataclass(frozen=True)
class ClassicNames:
    """A family's checkpoint names for llama.cpp's: its top-level tensors, its layers' prefix, its
    layers' parts."""

    top_level: dict[str, str]
    layers: str
    block: dict[str, str]


_GPT2_NAMES = ClassicNames(
    top_level={"token_embd": "transformer.wte", "position_embd": "transformer.wpe", "output_norm": "transformer.ln_f",
               "output": "lm_head"},
    layers="transformer.h",
    block={"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
           "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"})
_NAMES = {
    "phi": ClassicNames(
        top_level={"token_embd": "model.embed_tokens", "output_norm": "model.final_layernorm", "output": "lm_head"},
        layers="model.layers",
        block={"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.dense", "ffn_up": "mlp.fc1",
               "ffn_down": "mlp.fc2"}),
    "gpt_neox": ClassicNames(
        top_level={"token_embd": "gpt_neox.embed_in", "output_norm": "gpt_neox.final_layer_norm",
                   "output": "embed_out"},
        layers="gpt_neox.layers",
        block={"attn_norm": "input_layernorm", "attn_qkv": "attention.query_key_value",
               "attn_output": "attention.dense", "ffn_norm": "post_attention_layernorm",
               "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"}),
    "gpt2": _GPT2_NAMES,
    "gpt_bigcode": _GPT2_NAMES,
    "falcon": ClassicNames(
        top_level={"token_embd": "transformer.word_embeddings", "output_norm": "transformer.ln_f", "output": "lm_head"},
        layers="transformer.h",
        block={"attn_norm": "input_layernorm", "attn_qkv": "self_attention.query_key_value",
               "attn_output": "self_attention.dense", "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"}),
    "bloom": ClassicNames(
        top_level={"token_embd": "transformer.word_embeddings",
                   "token_embd_norm": "transformer.word_embeddings_layernorm", "output_norm": "transformer.ln_f",
                   "output": "lm_head"},
        layers="transformer.h",
        block={"attn_norm": "input_layernorm", "attn_qkv": "self_attention.query_key_value",
               "attn_output": "self_attention.dense", "ffn_norm": "post_attention_layernorm",
               "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"}),
    "mpt": ClassicNames(
        top_level={"token_embd": "transformer.wte", "output_norm": "transformer.norm_f", "output": "lm_head"},
        layers="transformer.blocks",
        block={"attn_norm": "norm_1", "attn_qkv": "attn.Wqkv", "attn_output": "attn.out_proj", "ffn_norm": "norm_2",
               "ffn_up": "ffn.up_proj", "ffn_down": "ffn.down_proj"}),
}
# Keys of the converted config a family's transformers config cannot take (FalconConfig's head_dim is a
# property of its own).
CLASSIC_UNSET_KEYS = {"falcon": ("head_dim",)}
# (falcon-40b's and 180B's two norms: ln_attn, ln_mlp.)
_FALCON_TWO_NORMS = {"attn_norm": "ln_attn", "attn_norm_2": "ln_mlp"}
# GPT-2's Conv1D modules (their weights stored [in, out] in its checkpoints).
_CONV1D = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")


def _rotary_share(meta: dict[str, Any], arch: str, head_dim: int) -> float:
    rotary = meta.get(f"{arch}.rope.dimension_count")
    return int(rotary) / head_dim if rotary is not None else 1.0


def _output_is_the_embedding(tensors: list[ReaderTensor]) -> bool:
    """Whether the file's head (output) holds the embedding's very bytes (BLOOM's converter copies it)."""
    by_name = {tensor.name: tensor for tensor in tensors}
    output, embedding = by_name.get("output.weight"), by_name.get("token_embd.weight")
    if output is None or embedding is None or output.tensor_type != embedding.tensor_type \
            or output.data.shape != embedding.data.shape:
        return False
    # (A chunk of rows at a time: a head of its own differs within the first, a copy is read through once.)
    rows = max(1, (1 << 24) // max(1, output.data[0].nbytes))
    return all(np.array_equal(output.data[i: i + rows], embedding.data[i: i + rows])
               for i in range(0, output.data.shape[0], rows))


def classic_config(meta: dict[str, Any], arch: str, config: dict[str, Any], tensors: list[ReaderTensor],
                   read_float: Any) -> dict[str, Any]:
    """The family's own config keys, as its converter wrote them (``read_float``: the loader's reading
    of a float32 value)."""
    tensor_names = {tensor.name for tensor in tensors}
    eps = read_float(meta.get(f"{arch}.attention.layer_norm_epsilon", 1e-5))
    head_dim = int(config["hidden_size"]) // int(config["num_attention_heads"])
    if arch == "phi2":
        partial = _rotary_share(meta, arch, head_dim)
        return {"layer_norm_eps": eps, "hidden_act": "gelu_new", "partial_rotary_factor": partial,
                "rope_parameters": {**config["rope_parameters"], "partial_rotary_factor": partial}}
    if arch == "gptneox":
        partial = _rotary_share(meta, arch, head_dim)
        return {"layer_norm_eps": eps, "hidden_act": "gelu", "rotary_pct": partial,
                "rope_parameters": {**config["rope_parameters"], "partial_rotary_factor": partial},
                "use_parallel_residual": bool(meta.get(f"{arch}.use_parallel_residual", True)),
                "attention_bias": any(name.endswith(".attn_qkv.bias") for name in tensor_names)}
    if arch == "falcon":
        kv_heads, two_norms = int(config["num_key_value_heads"]), any(".attn_norm_2." in n for n in tensor_names)
        new = two_norms or kv_heads > 1
        return {"layer_norm_epsilon": eps, "new_decoder_architecture": new, "multi_query": not new,
                "parallel_attn": True, "num_kv_heads": kv_heads, "num_ln_in_parallel_attn": 2 if two_norms else 1,
                "ffn_hidden_size": config["intermediate_size"], "activation": "gelu", "alibi": False,
                "bias": any(name.endswith(".attn_qkv.bias") for name in tensor_names)}
    if arch == "bloom":
        context = int(config["max_position_embeddings"])
        return {"n_layer": config["num_hidden_layers"], "n_head": config["num_attention_heads"],
                "layer_norm_epsilon": eps, "seq_length": 2048 if context == int(config["hidden_size"]) else context,
                "tie_word_embeddings": "output.weight" not in tensor_names or _output_is_the_embedding(tensors)}
    if arch == "mpt":
        if int(config["num_key_value_heads"]) != int(config["num_attention_heads"]):
            raise ValueError("an MPT file of fewer KV heads than query heads is not served")
        clamp = meta.get(f"{arch}.attention.clamp_kqv")
        bias_max = read_float(meta.get(f"{arch}.attention.max_alibi_bias", 0.0))
        return {"d_model": config["hidden_size"], "n_heads": config["num_attention_heads"],
                "n_layers": config["num_hidden_layers"], "max_seq_len": config["max_position_embeddings"],
                "expansion_ratio": int(config["intermediate_size"]) // int(config["hidden_size"]),
                "layer_norm_epsilon": eps, "no_bias": not any(name.endswith(".bias") for name in tensor_names),
                "attn_config": {"clip_qkv": None if clamp is None else read_float(clamp),
                                "alibi": bias_max > 0,  # (an integer where it is one, as MptConfig takes it)
                                "alibi_bias_max": int(bias_max) if bias_max.is_integer() else bias_max}}
    # GPT-2 and GPTBigCode, in GPT-2's key names; their positions those of the learned table (GPT-2's
    # converter states n_ctx as the context, which may differ).
    table = next(tensor for tensor in tensors if tensor.name == "position_embd.weight")
    return {"n_embd": config["hidden_size"], "n_layer": config["num_hidden_layers"],
            "n_head": config["num_attention_heads"], "n_positions": int(table.shape[-1]),
            "max_position_embeddings": int(table.shape[-1]),
            "n_inner": config["intermediate_size"], "layer_norm_epsilon": eps,
            "activation_function": "gelu_new" if arch == "gpt2" else "gelu_pytorch_tanh",
            **({"multi_query": int(config["num_key_value_heads"]) == 1} if arch == "starcoder" else {})}


def classic_tensors(name: str, array: np.ndarray, config: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """One tensor of a classic family's file (dequantised) under its checkpoint's name, as the
    checkpoint stores it."""
    model_type = config["model_type"]
    names = _NAMES[model_type]
    parts = name.split(".")
    if name == "output.weight" and model_type == "bloom" and config.get("tie_word_embeddings"):
        return  # (the embedding's copy)
    if parts[0] != "blk":
        if parts[0] not in names.top_level:
            raise ValueError(f"unexpected GGUF tensor {name!r}: no {model_type} equivalent")
        yield f"{names.top_level[parts[0]]}.{parts[1]}", array
        return
    layer, part, kind = parts[1], parts[2], parts[3]
    prefix = f"{names.layers}.{layer}"
    if model_type == "phi" and part == "attn_qkv":  # (q, k and v rows in turn, as many heads each)
        for projection, rows in zip(("q_proj", "k_proj", "v_proj"), np.split(array, 3), strict=True):
            yield f"{prefix}.self_attn.{projection}.{kind}", rows
        return
    block = {**names.block, **_FALCON_TWO_NORMS} if config.get("num_ln_in_parallel_attn") == 2 else names.block
    if part not in block:
        raise ValueError(f"unexpected GGUF tensor {name!r}: unknown {model_type} block component {part!r}")
    if model_type == "falcon" and part == "attn_qkv":  # (all q rows, k's, v's -> grouped by KV head)
        heads, kv_heads = int(config["num_attention_heads"]), int(config["num_kv_heads"])
        head_rows = array.shape[0] // (heads + 2 * kv_heads)
        q, k, v = np.split(array, [heads * head_rows, (heads + kv_heads) * head_rows])
        groups = [rows.reshape(kv_heads, -1, *rows.shape[1:]) for rows in (q, k, v)]
        array = np.concatenate(groups, axis=1).reshape(array.shape)
    if model_type in ("gpt_neox", "bloom") and part == "attn_qkv":  # (all q rows, k's, v's -> each head's q, k, v)
        heads = int(config["num_attention_heads"])
        per_head = [rows.reshape(heads, -1, *rows.shape[1:]) for rows in np.split(array, 3)]
        array = np.stack(per_head, axis=1).reshape(array.shape)  # ([heads, 3, head_dim] rows)
    if model_type == "gpt2" and part in _CONV1D and kind == "weight":
        array = np.ascontiguousarray(array.T)
    yield f"{prefix}.{block[part]}.{kind}", array
