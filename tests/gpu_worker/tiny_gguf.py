"""Build tiny Llama, Mixtral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE, Gemma (1, 2, 3), LFM2 and LFM2-MoE GGUFs the way
llama.cpp's convert_hf_to_gguf.py does, for loader tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    Lfm2Config,
    Lfm2ForCausalLM,
    Lfm2MoeConfig,
    Lfm2MoeForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers import Qwen2ForCausalLM as HFQwen2ForCausalLM
from transformers import Qwen2MoeForCausalLM as HFQwen2MoeForCausalLM
from transformers import Qwen3ForCausalLM as HFQwen3ForCausalLM
from transformers import Qwen3MoeForCausalLM as HFQwen3MoeForCausalLM

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "e r"]

_HF_TO_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",  # Qwen2-MoE's shared expert and its gate
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values (bytes_to_unicode)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = [], 0
    for byte in range(256):
        if byte in printable:
            codes.append(byte)
        else:
            codes.append(256 + extra)
            extra += 1
    return [chr(c) for c in codes]


def tiny_vocab() -> list[str]:
    merged = [a + b for a, b in (m.split(" ") for m in MERGES)]
    return SPECIAL_TOKENS + byte_level_alphabet() + merged


_KINDS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, HFQwen2ForCausalLM),
          "qwen3": (Qwen3Config, HFQwen3ForCausalLM), "qwen3_moe": (Qwen3MoeConfig, HFQwen3MoeForCausalLM),
          "mixtral": (MixtralConfig, MixtralForCausalLM), "qwen2_moe": (Qwen2MoeConfig, HFQwen2MoeForCausalLM),
          "gemma": (GemmaConfig, GemmaForCausalLM),
          "gemma2": (Gemma2Config, Gemma2ForCausalLM), "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM)}
# Qwen3-MoE's, Mixtral's and Qwen2-MoE's experts (Qwen2-MoE's shared expert too); Gemma 2 and 3's
# extra keys: a window of 8 (every other layer for Gemma 2; Gemma 3's pattern of 2), soft caps that
# bind for Gemma 2; their scale is 1 / sqrt(head_dim), as llama.cpp assumes below 27B.
_EXTRA_KEYS = {"qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                            "norm_topk_prob": True},
               "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None},
               "qwen2_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                             "shared_expert_intermediate_size": 96, "norm_topk_prob": False},
               "gemma2": {"sliding_window": 8, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 2.0,
                          "final_logit_softcapping": 5.0},
               "gemma3": {"sliding_window": 8, "query_pre_attn_scalar": 16, "sliding_window_pattern": 2,
                          "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                 "rope_theta": 1000000.0},
                                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}}
# transformers' Gemma 2/3 names for the norms around the attention and the MLP -> llama.cpp's.
_SANDWICH_HF_TO_GGUF = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                        "post_feedforward_layernorm": "post_ffw_norm"}


def tiny_llama(tie_word_embeddings: bool = False, seed: int = 0, kind: str = "llama") -> PreTrainedModel:
    """A tiny random model of ``kind`` (llama; qwen2, with q/k/v biases; qwen3, with per-head q/k
    norms and a head_dim of its own; qwen3_moe, Qwen3's attention and 8 experts, 2 a token; mixtral,
    Llama's attention and 8 experts of intermediate_size, 2 a token; qwen2_moe, Qwen2's attention, 8
    experts, 2 a token, not renormalised, and a gated shared expert)."""
    config_class, model_class = _KINDS[kind]
    rope = {} if kind == "gemma3" else {"rope_theta": 10000.0}
    config = config_class(
        vocab_size=len(tiny_vocab()), hidden_size=64, intermediate_size=128,
        num_hidden_layers=3 if kind.startswith("gemma") else 2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24 if kind.startswith("qwen3") else 16,
        max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, **rope, **_EXTRA_KEYS.get(kind, {}),
    )
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        # Random init leaves norms at exactly 1 and biases at 0; perturb them so a swapped norm or a
        # lost bias would be caught.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.normal_(0.0, 0.5)
    return model


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """Verbatim logic of ``LlamaModel.permute`` in llama.cpp's convert_hf_to_gguf.py."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gguf_tensor_name(hf_name: str, model_type: str = "llama") -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, *rest = hf_name.split(".")
    module, kind = ".".join(rest[:-1]), rest[-1]
    names = {**_HF_TO_GGUF_BLOCK, **_SANDWICH_HF_TO_GGUF} if model_type in ("gemma2", "gemma3_text") \
        else _HF_TO_GGUF_BLOCK
    return f"blk.{layer}.{names[module]}.{kind}"


def gguf_tensors(model: PreTrainedModel) -> dict[str, np.ndarray]:
    """HF state dict renamed and, for Llama, with q/k rows permuted as llama.cpp writes them (its
    Qwen converters keep HF's order)."""
    config = model.config
    out: dict[str, np.ndarray] = {}
    for hf_name, data in state_arrays(model, out):
        if hf_name.endswith(".mlp.shared_expert_gate.weight"):
            data = data.reshape(-1)  # (llama.cpp holds Qwen2-MoE's [1, hidden] gate as an F32 vector)
        permuted = config.model_type in ("llama", "mixtral")
        if permuted and ".q_proj." in hf_name:
            data = llama_cpp_permute(data, config.num_attention_heads, config.num_attention_heads)
        elif permuted and ".k_proj." in hf_name:
            data = llama_cpp_permute(data, config.num_attention_heads, config.num_key_value_heads)
        if config.model_type.startswith("gemma") and hf_name.endswith("norm.weight"):
            data = data + 1  # (llama.cpp's Gemma converters store 1 + w)
        out[gguf_tensor_name(hf_name, config.model_type)] = data
    return out


def state_arrays(model: PreTrainedModel, out: dict[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """``model``'s tensors as float32 arrays (the head left out where tied), but the experts' and their
    router's, which go into ``out`` under llama.cpp's stacked names."""
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy().copy()
        if ".mlp.experts." in hf_name or hf_name.endswith(".mlp.gate.weight"):
            out.update(_stacked_experts(hf_name, data, "mlp"))
        else:
            yield hf_name, data


def write_tiny_gguf(
    path: Path, model: PreTrainedModel, quant: GGMLQuantizationType = GGMLQuantizationType.F32,
    architecture: str | None = None, expert_count: int = 0, split_experts: bool = False, expert_widths: bool = True,
) -> Path:
    """Write ``model`` as GGUF (its own architecture unless one is named); 2-D weights use
    ``quant``, norms and biases stay F32 as in llama.cpp. ``expert_count`` writes the key a
    mixture-of-experts file carries (for a model without experts). ``split_experts``: each expert's
    projections as their own tensors (ffn_gate.E ...), as older Mixtral files hold them. Without
    ``expert_widths``, the experts' and shared expert's widths are left out (early Qwen1.5-MoE files)."""
    config = model.config
    arch = architecture or {"gemma3_text": "gemma3", "qwen3_moe": "qwen3moe", "mixtral": "llama",
                            "qwen2_moe": "qwen2moe"}.get(config.model_type, config.model_type)
    writer = start_gguf(path, arch, "tiny-llama", config.num_hidden_layers, config.max_position_embeddings,
                        config.hidden_size, config.intermediate_size, config.num_attention_heads,
                        config.num_key_value_heads, config.rms_norm_eps)
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch == "gemma3":
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config.layer_types])
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0)
    if expert_count or experts:
        writer.add_expert_count(expert_count or experts)
    if experts:  # (Mixtral's experts are feed_forward_length wide: its converter writes no expert width)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if config.model_type != "mixtral" and expert_widths:
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "shared_expert_intermediate_size", 0) and expert_widths:
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    _add_tokenizer(writer)
    tensors = gguf_tensors(model)
    if split_experts:
        tensors = dict(_split_experts(tensors))
    return write_tensors_and_close(writer, path, tensors, quant, lambda name, data: data.ndim == 2)


def start_gguf(path: Path, arch: str, name: str, layers: int, context: int, hidden: int, ffn: int | list[int],
               heads: int, kv_heads: int | list[int], eps: float) -> GGUFWriter:
    """A writer of ``arch`` holding the keys every file has (its shape; per-layer lists where given)."""
    writer = GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(eps)
    return writer


def write_tensors_and_close(writer: GGUFWriter, path: Path, tensors: dict[str, np.ndarray],
                            quant: GGMLQuantizationType, quantized: Callable[[str, np.ndarray], bool]) -> Path:
    """Add ``tensors`` to ``writer`` (those ``quantized`` says in ``quant``, the others as they are),
    write the file out and close it."""
    for name, data in tensors.items():
        data = np.ascontiguousarray(data, dtype=np.float32)
        if quant != GGMLQuantizationType.F32 and quantized(name, data):
            writer.add_tensor(name, quantize(data, quant), raw_dtype=quant)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer: GGUFWriter) -> None:
    vocab = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab)
    writer.add_token_types([TokenType.CONTROL if t in SPECIAL_TOKENS else TokenType.NORMAL for t in vocab])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


# LFM2's names (llama.cpp's LFM2 tensor map): its norms, q/k norms, SwiGLU and short convolutions.
_LFM2_HF_TO_GGUF = {"operator_norm": "attn_norm", "ffn_norm": "ffn_norm", "self_attn.q_proj": "attn_q",
                    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_output",
                    "self_attn.q_layernorm": "attn_q_norm", "self_attn.k_layernorm": "attn_k_norm",
                    "feed_forward.w1": "ffn_gate", "feed_forward.w3": "ffn_up", "feed_forward.w2": "ffn_down",
                    "conv.in_proj": "shortconv.in_proj", "conv.conv": "shortconv.conv",
                    "conv.out_proj": "shortconv.out_proj"}


def _stacked_experts(hf_name: str, data: np.ndarray, block: str) -> dict[str, np.ndarray]:
    """A layer's experts as llama.cpp's MoE converters write them: every expert's gate, up and down
    stacked [experts, rows, columns] (ffn_{gate,up,down}_exps), the router as ffn_gate_inp; from
    transformers 5's fused gate_up_proj / down_proj (the gate's rows first)."""
    layer = hf_name.split(".")[2]
    if hf_name.endswith(f".{block}.gate.weight"):
        return {f"blk.{layer}.ffn_gate_inp.weight": data}
    if hf_name.endswith(".experts.gate_up_proj"):
        half = data.shape[1] // 2
        return {f"blk.{layer}.ffn_gate_exps.weight": data[:, :half].copy(),
                f"blk.{layer}.ffn_up_exps.weight": data[:, half:].copy()}
    if hf_name.endswith(".experts.down_proj"):
        return {f"blk.{layer}.ffn_down_exps.weight": data}
    raise ValueError(f"unexpected expert tensor {hf_name!r}")


def _split_experts(tensors: dict[str, np.ndarray]):
    """Stacked ffn_{gate,up,down}_exps [experts, rows, columns] as one tensor per expert
    (blk.N.ffn_gate.E.weight ...), the layout of Mixtral GGUFs written before llama.cpp stacked them."""
    for name, data in tensors.items():
        if name.endswith("_exps.weight"):
            prefix, part = name.removesuffix(".weight").rsplit(".", 1)
            for expert, weights in enumerate(data):
                yield f"{prefix}.{part.removesuffix('_exps')}.{expert}.weight", weights.copy()
        else:
            yield name, data


def tiny_lfm2(seed: int = 0, conv_bias: bool = False, moe: bool = False) -> Lfm2ForCausalLM | Lfm2MoeForCausalLM:
    """A tiny random LFM2: short convolutions around an attention layer, tied embeddings, its MLP
    width adjusted from block_ff_dim 192 (128); LFM2-MoE (``moe``): 8 experts, 2 a token, chosen
    through a (random) expert bias after one dense layer, scaled by 2.5."""
    common = dict(vocab_size=len(tiny_vocab()), hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, conv_bias=conv_bias, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    if moe:
        config = Lfm2MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                               num_experts_per_tok=2, num_dense_layers=1, routed_scaling_factor=2.5,
                               layer_types=["conv", "full_attention", "conv", "conv"], norm_eps=1e-5)
    else:
        config = Lfm2Config(**common, block_ff_dim=192, block_multiple_of=32, full_attn_idxs=[1], norm_eps=1e-5)
    torch.manual_seed(seed)
    model = (Lfm2MoeForCausalLM if moe else Lfm2ForCausalLM)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                param.add_(0.3 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.normal_(0.0, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):
                buffer.normal_(0.0, 0.3)
    return model


def write_tiny_lfm2_gguf(path: Path, model: Lfm2ForCausalLM | Lfm2MoeForCausalLM,
                         quant: GGMLQuantizationType = GGMLQuantizationType.F32) -> Path:
    """``model`` as llama.cpp's LFM2Model (LFM2MoeModel) converter writes it: KV heads per layer (0 in
    the short convolutions), the adjusted MLP width, conv_L_cache, the Conv1d weights squeezed to
    2-D; LFM2-MoE's experts stacked, its expert bias as exp_probs_b.bias, its dense layers' count."""
    config = model.config
    moe = config.model_type == "lfm2_moe"
    writer = start_gguf(path, "lfm2moe" if moe else "lfm2", "tiny-lfm2", config.num_hidden_layers,
                        config.max_position_embeddings, config.hidden_size,
                        model.model.layers[0].feed_forward.w1.out_features, config.num_attention_heads,
                        [config.num_key_value_heads if kind != "conv" else 0 for kind in config.layer_types],
                        config.norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    writer.add_shortconv_l_cache(config.conv_L_cache)
    if moe:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_leading_dense_block_count(config.num_dense_layers)
        writer.add_expert_weights_scale(config.routed_scaling_factor)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    _add_tokenizer(writer)
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.embedding_norm.weight": "token_embd_norm.weight",
           "lm_head.weight": "output.weight"}
    tensors, unquantized = {}, set()  # (the experts' tensors and the router stay F32 here)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy().copy()
        if hf_name.endswith(".conv.conv.weight"):
            data = data.squeeze(1)
        if ".feed_forward.experts." in hf_name or hf_name.endswith(".feed_forward.gate.weight"):
            stacked = _stacked_experts(hf_name, data, "feed_forward")
            tensors.update(stacked)
            unquantized.update(stacked)
            continue
        if hf_name.endswith(".feed_forward.expert_bias"):
            tensors[f"blk.{hf_name.split('.')[2]}.exp_probs_b.bias"] = data
            continue
        if hf_name in top:
            name = top[hf_name]
        else:
            _, _, layer, *rest = hf_name.split(".")
            name = f"blk.{layer}.{_LFM2_HF_TO_GGUF['.'.join(rest[:-1])]}.{rest[-1]}"
        tensors[name] = data
    return write_tensors_and_close(
        writer, path, tensors, quant,
        lambda name, data: data.ndim == 2 and ".shortconv.conv." not in name and name not in unquantized)
