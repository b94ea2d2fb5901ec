"""Tiny IBM Granite models (Granite 3.x dense, Granite MoE with a shared expert, Granite 4.0-H with and
without experts), NVIDIA Nemotron-H, TII Falcon-H1 and Mamba / Falcon-Mamba models, and their GGUF files
written the way llama.cpp's convert_hf_to_gguf.py writes them (GraniteModel, GraniteMoeModel,
GraniteHybridModel, NemotronHModel, FalconH1Model, MambaModel), for the loader's tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from transformers import (
    FalconH1ForCausalLM,
    FalconMambaForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    GraniteMoeHybridConfig,
    GraniteMoeHybridForCausalLM,
    GraniteMoeSharedConfig,
    GraniteMoeSharedForCausalLM,
    Mamba2ForCausalLM,
    MambaForCausalLM,
    NemotronHConfig,
    NemotronHForCausalLM,
    PreTrainedModel,
)

from .tiny_gguf import (
    _add_tokenizer,
    gguf_tensor_name,
    llama_cpp_permute,
    start_gguf,
    tiny_vocab,
    write_tensors_and_close,
)
from .utils import make_config

# Granite's muP multipliers, away from 1 so a lost one shows.
_MULTIPLIERS = dict(embedding_multiplier=3.0, attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=2.0)
GRANITE_KINDS = ("granite", "granitemoeshared", "granitehybrid", "granitehybrid_dense", "granite4_micro")
_ARCH = {"granite": "granite", "granitemoeshared": "granitemoe", "granitehybrid": "granitehybrid",
         "granitehybrid_dense": "granitehybrid", "granite4_micro": "granite"}
# The tensors llama.cpp quantizes (matrix multiplications); norms, the SSM's A, D, dt bias and
# convolution stay F32.
_QUANTIZED = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_shexp",
              "ffn_up_shexp", "ffn_down_shexp", "ssm_in", "ssm_out", "token_embd", "output")


def tiny_granite(kind: str, seed: int = 0) -> PreTrainedModel:
    """A tiny random Granite of ``kind`` (GRANITE_KINDS): granite, a dense Granite 3.x; granitemoeshared,
    8 experts (2 a token) beside a shared expert; granitehybrid, Granite 4.0-H's Mamba-2 layers around
    an attention layer without positions, experts and a shared expert; granitehybrid_dense, its
    shared MLP alone; granite4_micro, Granite 4.0's architecture with attention (and RoPE) in every
    layer and the shared MLP alone (granite-4.0-micro), whose shared MLP is wider than the
    intermediate_size its config states."""
    common = dict(vocab_size=len(tiny_vocab()), hidden_size=64, intermediate_size=32, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, tie_word_embeddings=kind != "granite", **_MULTIPLIERS)
    if kind == "granite":
        model: PreTrainedModel = GraniteForCausalLM(GraniteConfig(**common, num_hidden_layers=2))
    elif kind == "granitemoeshared":
        model = GraniteMoeSharedForCausalLM(GraniteMoeSharedConfig(
            **common, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=64))
    elif kind == "granite4_micro":
        model = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
            **common, num_hidden_layers=2, layer_types=["attention", "attention"], num_local_experts=0,
            shared_intermediate_size=64, position_embedding_type="rope"))
    else:
        model = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
            **common, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
            num_local_experts=8 if kind == "granitehybrid" else 0, num_experts_per_tok=2,
            shared_intermediate_size=64, position_embedding_type="nope", mamba_n_heads=8, mamba_d_head=16,
            mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=4,
            mamba_conv_bias=True, mamba_proj_bias=False))
    return _perturbed(model, seed)


def _perturbed(model: PreTrainedModel, seed: int) -> PreTrainedModel:
    """``model``'s architecture with fresh random weights, norms and biases away from 1 and 0 (so a
    swapped norm or a lost bias shows)."""
    torch.manual_seed(seed)
    model = type(model)(model.config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.3 * torch.randn_like(param))
            elif name.endswith(("bias", "dt_bias", ".D")):
                param.normal_(0.0, 0.5)
    return model


def write_tiny_granite_gguf(path: Path, model: PreTrainedModel, kind: str,
                            quant: GGMLQuantizationType = GGMLQuantizationType.F32, rope: bool = False) -> Path:
    """``model`` as llama.cpp writes a Granite file: the multipliers as *_scale keys, q/k rows
    permuted, the merged gate-and-up tensors split, a hybrid's KV heads per layer (0 in its Mamba
    layers), no RoPE and a 2^20 context (``rope``: marked as rotating, as a Bamba file is), its SSM
    tensors reshaped (A as -exp(A_log))."""
    config, arch = model.config, _ARCH[kind]
    hybrid, experts = arch == "granitehybrid", getattr(config, "num_local_experts", 0)
    # (llama.cpp writes a hybrid config's keys even where it converts it as "granite": granite-4.0-micro)
    from_hybrid = config.model_type == "granitemoehybrid"
    writer = start_gguf(path, arch, f"tiny-{kind}", config.num_hidden_layers,
                        2**20 if hybrid and not rope else config.max_position_embeddings, config.hidden_size,
                        config.intermediate_size, config.num_attention_heads,
                        [config.num_key_value_heads if t in ("attention", "full_attention") else 0
                         for t in config.layer_types] if from_hybrid else config.num_key_value_heads,
                        config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)
    writer.add_attention_scale(config.attention_multiplier)
    writer.add_embedding_scale(config.embedding_multiplier)
    writer.add_residual_scale(config.residual_multiplier)
    writer.add_logit_scale(config.logits_scaling)
    if experts or from_hybrid:
        writer.add_expert_count(experts)
    if experts:
        writer.add_expert_used_count(config.num_experts_per_tok)
    if getattr(config, "shared_intermediate_size", 0):
        writer.add_expert_shared_feed_forward_length(config.shared_intermediate_size)
    if from_hybrid:
        _add_ssm_keys(writer, config.mamba_d_conv, config.mamba_d_state, config.mamba_n_groups,
                      config.mamba_n_heads, config.mamba_d_head)
        writer.add_rope_scaling_finetuned(rope)
    _add_tokenizer(writer)
    return write_tensors_and_close(writer, path, _granite_tensors(model, experts), quant, _matmul)


def _matmul(name: str, data: np.ndarray) -> bool:
    return name.split(".")[-2] in _QUANTIZED


def _granite_tensors(model: PreTrainedModel, experts: int) -> dict[str, np.ndarray]:
    config, out = model.config, {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy().copy()
        if not hf_name.startswith("model.layers."):
            out[gguf_tensor_name(hf_name)] = data
            continue
        _, _, layer, *rest = hf_name.split(".")
        module, blk = ".".join(rest), f"blk.{layer}"
        if module == "block_sparse_moe.router.weight":
            out[f"{blk}.ffn_gate_inp.weight"] = data
        elif module == "block_sparse_moe.experts.gate_up_proj":  # ([experts, 2 x width, hidden], gate rows first)
            half = data.shape[1] // 2
            out[f"{blk}.ffn_gate_exps.weight"], out[f"{blk}.ffn_up_exps.weight"] = data[:, :half], data[:, half:]
        elif module == "block_sparse_moe.experts.down_proj":
            out[f"{blk}.ffn_down_exps.weight"] = data
        elif module == "shared_mlp.input_linear.weight":
            half, suffix = data.shape[0] // 2, "_shexp" if experts else ""
            out[f"{blk}.ffn_gate{suffix}.weight"], out[f"{blk}.ffn_up{suffix}.weight"] = data[:half], data[half:]
        elif module == "shared_mlp.output_linear.weight":
            out[f"{blk}.ffn_down{'_shexp' if experts else ''}.weight"] = data
        elif module.startswith("mamba."):
            out.update(_mamba_tensor(blk, module.removeprefix("mamba."), data, config.mamba_n_groups))
        else:
            if module == "self_attn.q_proj.weight":
                data = llama_cpp_permute(data, config.num_attention_heads, config.num_attention_heads)
            elif module == "self_attn.k_proj.weight":
                data = llama_cpp_permute(data, config.num_attention_heads, config.num_key_value_heads)
            out[gguf_tensor_name(hf_name)] = data
    return {name: np.ascontiguousarray(data) for name, data in out.items()}


def _add_ssm_keys(writer: GGUFWriter, conv: int, state: int, groups: int, heads: int, head_dim: int) -> None:
    """The Mamba-2 keys llama.cpp writes: the heads as ssm.time_step_rank, their width as ssm.inner_size."""
    writer.add_ssm_conv_kernel(conv)
    writer.add_ssm_state_size(state)
    writer.add_ssm_group_count(groups)
    writer.add_ssm_inner_size(heads * head_dim)
    writer.add_ssm_time_step_rank(heads)


def _mamba_tensor(blk: str, name: str, data: np.ndarray, groups: int) -> dict[str, np.ndarray]:
    """One Mamba-2 tensor as llama.cpp's Mamba2Model writes it."""
    if name == "A_log":
        return {f"{blk}.ssm_a": -np.exp(data)[:, None]}
    if name == "D":
        return {f"{blk}.ssm_d": data[:, None]}
    if name == "dt_bias":
        return {f"{blk}.ssm_dt.bias": data}
    if name == "conv1d.weight":
        return {f"{blk}.ssm_conv1d.weight": data.squeeze(1)}
    if name == "norm.weight":
        return {f"{blk}.ssm_norm.weight": data.reshape(groups, -1)}
    renamed = {"in_proj": "ssm_in", "conv1d": "ssm_conv1d", "out_proj": "ssm_out"}
    module, kind = name.rsplit(".", 1)
    return {f"{blk}.{renamed[module]}.{kind}": data}


def tiny_nemotron_h(seed: int = 0) -> NemotronHForCausalLM:
    """A tiny random Nemotron-H: Mamba-2 (8 heads of 16 in 2 groups), relu^2 MLP and attention blocks
    (heads of 24: not hidden / heads, as Nemotron Nano 9B v2's 128 are not 4480 / 40)."""
    config = NemotronHConfig(vocab_size=len(tiny_vocab()), hidden_size=64, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=24, intermediate_size=32, hybrid_override_pattern="M-*M-M",
                             mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, chunk_size=8,
                             conv_kernel=4, use_conv_bias=True, layer_norm_epsilon=1e-5, bos_token_id=1,
                             eos_token_id=2, pad_token_id=0)
    return _perturbed(NemotronHForCausalLM(config), seed)


def write_tiny_nemotron_h_gguf(path: Path, model: NemotronHForCausalLM,
                               quant: GGMLQuantizationType = GGMLQuantizationType.F32) -> Path:
    """``model`` as llama.cpp's NemotronHModel writes it: the block kinds as per-layer KV heads
    (attention) and feed_forward_length (MLP), both 0 in a Mamba-2 block; q/k rows permuted; the
    Mamba-2 tensors reshaped; no RoPE and a 2^20 context."""
    config = model.config
    kinds = "".join({"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-"}[k]
                    for k in config.layers_block_type)
    writer = start_gguf(path, "nemotron_h", "tiny-nemotron-h", len(kinds), 2**20, config.hidden_size,
                        [config.intermediate_size if k == "-" else 0 for k in kinds], config.num_attention_heads,
                        [config.num_key_value_heads if k == "*" else 0 for k in kinds], config.layer_norm_epsilon)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    _add_ssm_keys(writer, config.conv_kernel, config.ssm_state_size, config.n_groups, config.mamba_num_heads,
                  config.mamba_head_dim)
    writer.add_rope_scaling_finetuned(False)
    _add_tokenizer(writer)
    top = {"model.embeddings.weight": "token_embd.weight", "model.norm_f.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    block = {"norm": "attn_norm", "mixer.q_proj": "attn_q", "mixer.k_proj": "attn_k", "mixer.v_proj": "attn_v",
             "mixer.o_proj": "attn_output", "mixer.up_proj": "ffn_up", "mixer.down_proj": "ffn_down"}
    tensors = {}
    for hf_name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy().copy()
        if hf_name in top:
            tensors[top[hf_name]] = data
            continue
        _, _, layer, *rest = hf_name.split(".")
        module, kind = ".".join(rest[:-1]), rest[-1]
        if kinds[int(layer)] == "M" and module != "norm":  # (its mixer's; the block's norm is attn_norm)
            tensors.update(_mamba_tensor(f"blk.{layer}", ".".join(rest[1:]), data, config.n_groups))
            continue
        if module == "mixer.q_proj":
            data = llama_cpp_permute(data, config.num_attention_heads, config.num_attention_heads)
        elif module == "mixer.k_proj":
            data = llama_cpp_permute(data, config.num_attention_heads, config.num_key_value_heads)
        tensors[f"blk.{layer}.{block[module]}.{kind}"] = data
    return write_tensors_and_close(writer, path, tensors, quant, _matmul)


def tiny_falcon_h1(seed: int = 0, rms_norm: bool = False) -> FalconH1ForCausalLM:
    """A tiny random Falcon-H1 (tests.gpu_worker.utils' falcon_h1: muP multipliers away from 1 on every
    projection); ``rms_norm``: with the mixer's gated norm (after the gate, as llama.cpp computes it)."""
    config = make_config("falcon_h1", vocab_size=len(tiny_vocab()), mamba_rms_norm=rms_norm,
                         mamba_norm_before_gate=False)
    return _perturbed(FalconH1ForCausalLM(config), seed)


def write_tiny_falcon_h1_gguf(path: Path, model: FalconH1ForCausalLM,
                              quant: GGMLQuantizationType = GGMLQuantizationType.F32) -> Path:
    """``model`` as llama.cpp's FalconH1Model writes it: every muP multiplier folded into its weights
    (in_proj's z, x, B, C and dt rows each by their own), q/k rows as they are, the Mamba-2 tensors
    reshaped."""
    config = model.config
    inner, bc = config.mamba_d_ssm, config.mamba_n_groups * config.mamba_d_state
    writer = start_gguf(path, "falcon-h1", "tiny-falcon-h1", config.num_hidden_layers, config.max_position_embeddings,
                        config.hidden_size, config.intermediate_size, config.num_attention_heads,
                        config.num_key_value_heads, config.rms_norm_eps)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    _add_ssm_keys(writer, config.mamba_d_conv, config.mamba_d_state, config.mamba_n_groups,
                  inner // config.mamba_d_head, config.mamba_d_head)
    _add_tokenizer(writer)
    scale = {"feed_forward.down_proj": config.mlp_multipliers[1], "feed_forward.gate_proj": config.mlp_multipliers[0],
             "self_attn.k_proj": config.key_multiplier * config.attention_in_multiplier,
             "self_attn.q_proj": config.attention_in_multiplier, "self_attn.v_proj": config.attention_in_multiplier,
             "self_attn.o_proj": config.attention_out_multiplier, "mamba.out_proj": config.ssm_out_multiplier}
    top = {"model.embed_tokens.weight": ("token_embd.weight", config.embedding_multiplier),
           "model.final_layernorm.weight": ("output_norm.weight", 1.0),
           "lm_head.weight": ("output.weight", config.lm_head_multiplier)}
    block = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "pre_ff_layernorm": "ffn_norm",
             "feed_forward.gate_proj": "ffn_gate", "feed_forward.up_proj": "ffn_up",
             "feed_forward.down_proj": "ffn_down"}
    tensors = {}
    for hf_name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy().copy()
        if hf_name in top:
            name, multiplier = top[hf_name]
            tensors[name] = data * multiplier
            continue
        _, _, layer, *rest = hf_name.split(".")
        module, kind = ".".join(rest[:-1]), rest[-1]
        if module == "mamba.in_proj":
            rows = np.concatenate([np.full(count, m) for count, m in zip(
                (inner, inner, bc, bc, data.shape[0] - 2 * inner - 2 * bc), config.ssm_multipliers, strict=True)])
            data = data * config.ssm_in_multiplier * rows[:, None]
        data = data * scale.get(module, 1.0)
        if rest[0] == "mamba" and module != "mamba.out_proj" and module != "mamba.in_proj":
            tensors.update(_mamba_tensor(f"blk.{layer}", ".".join(rest[1:]), data, config.mamba_n_groups))
        elif module in ("mamba.in_proj", "mamba.out_proj"):
            tensors[f"blk.{layer}.{'ssm_in' if module == 'mamba.in_proj' else 'ssm_out'}.{kind}"] = data
        else:
            tensors[f"blk.{layer}.{block[module]}.{kind}"] = data
    return write_tensors_and_close(writer, path, tensors, quant, _matmul)


_STATE_SPACE_MODELS = {"mamba": MambaForCausalLM, "falcon_mamba": FalconMambaForCausalLM, "mamba2": Mamba2ForCausalLM}


def tiny_mamba(kind: str, seed: int = 0, tied: bool = False) -> PreTrainedModel:
    """A tiny random Mamba, Falcon-Mamba or Mamba-2 (``kind``: "mamba" / "falcon_mamba" / "mamba2";
    tests.gpu_worker.utils' geometries)."""
    config = make_config(kind, vocab_size=len(tiny_vocab()), tie_word_embeddings=tied)
    return _perturbed(_STATE_SPACE_MODELS[kind](config), seed)


def write_tiny_mamba_gguf(path: Path, model: PreTrainedModel) -> Path:
    """``model`` as llama.cpp's MambaModel (Mamba2Model) writes it: head count and feed_forward_length
    0, a 2^20 context, A as -exp(A_log), the convolution squeezed (Mamba-2's tensors as _mamba_tensor
    writes them), the LM head left out where it is the embedding, Falcon-Mamba's dt/B/C norms as
    ssm.dt_b_c_rms."""
    config = model.config
    mamba2 = config.model_type == "mamba2"
    writer = start_gguf(path, "mamba2" if mamba2 else "mamba", "tiny-mamba", config.num_hidden_layers, 2**20,
                        config.hidden_size, 0, 0, 0, config.layer_norm_epsilon)
    writer.add_vocab_size(config.vocab_size)
    if mamba2:
        _add_ssm_keys(writer, config.conv_kernel, config.state_size, config.n_groups, config.num_heads,
                      config.head_dim)
    else:
        writer.add_ssm_conv_kernel(config.conv_kernel)
        writer.add_ssm_inner_size(config.intermediate_size)
        writer.add_ssm_state_size(config.state_size)
        writer.add_ssm_time_step_rank(config.time_step_rank)
        writer.add_ssm_dt_b_c_rms(config.model_type == "falcon_mamba")
    _add_tokenizer(writer)
    renamed = {"norm": "attn_norm", "mixer.in_proj": "ssm_in", "mixer.conv1d": "ssm_conv1d", "mixer.x_proj": "ssm_x",
               "mixer.dt_proj": "ssm_dt", "mixer.out_proj": "ssm_out"}
    top = {"backbone.embeddings.weight": "token_embd.weight", "backbone.norm_f.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    state = model.state_dict()
    tensors = {}
    for hf_name, tensor in state.items():
        data = tensor.detach().float().numpy().copy()
        if hf_name == "lm_head.weight" and np.array_equal(data, state["backbone.embeddings.weight"].numpy()):
            continue  # (llama.cpp omits an output equal to the embedding)
        if hf_name in top:
            tensors[top[hf_name]] = data
            continue
        _, _, layer, *rest = hf_name.split(".")
        module, kind = ".".join(rest[:-1]), rest[-1]
        if mamba2 and rest[0] == "mixer":
            tensors.update(_mamba_tensor(f"blk.{layer}", ".".join(rest[1:]), data, config.n_groups))
        elif module == "mixer" and kind == "A_log":
            tensors[f"blk.{layer}.ssm_a"] = -np.exp(data)
        elif module == "mixer" and kind == "D":
            tensors[f"blk.{layer}.ssm_d"] = data
        elif module == "mixer.conv1d" and kind == "weight":
            tensors[f"blk.{layer}.ssm_conv1d.weight"] = data.squeeze(1)
        else:
            tensors[f"blk.{layer}.{renamed[module]}.{kind}"] = data
    return write_tensors_and_close(writer, path, tensors, GGMLQuantizationType.F32, _matmul)
