"""InternLM2 / 2.5, InternLM3 and EXAONE 3.x, whose code is their own (remote code transformers does not
ship): the Llama block under their names and config keys. A random transformers Llama (Qwen2 for
InternLM3's q/k/v biases without an output bias) saved as each names and describes its tensors is the
reference: the same arithmetic, so the same logits."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from gpu_worker.config import ModelConfig
from tests.gpu_worker import test_model_runner
from tests.gpu_worker.utils import _SMALL, LLAMA3_ROPE, make_runner, prefill_logits


def save_as(path: Path, reference_config, rename: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
            config: dict) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(reference_config, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():  # (biases drawn, so that one not loaded shows)
        for name, param in reference.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
    reference.save_pretrained(path)
    tensors = rename(load_file(path / "model.safetensors"))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({"torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
                                                  **config}))
    return path, reference


def _shape(reference) -> dict:
    return {k: getattr(reference, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                               "num_key_value_heads", "vocab_size", "max_position_embeddings")}


def _renamed(tensors: dict[str, torch.Tensor], parts: tuple[tuple[str, str], ...]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in tensors.items():
        for ours, theirs in parts:
            name = name.replace(ours, theirs)
        out[name] = tensor
    return out


def internlm2(path: Path, bias: bool = False, **overrides) -> tuple[Path, torch.nn.Module]:
    """InternLM2's files: wqkv grouped by KV head (each group's queries, its key, its value)."""
    reference = LlamaConfig(**{**_SMALL, "attention_bias": bias, **overrides})
    heads, kv_heads = reference.num_attention_heads, reference.num_key_value_heads
    head_dim = reference.hidden_size // heads

    def rename(tensors):
        for layer in range(reference.num_hidden_layers):
            prefix = f"model.layers.{layer}.self_attn."
            for kind in ("weight", "bias") if bias else ("weight",):
                q, k, v = (tensors.pop(f"{prefix}{p}_proj.{kind}") for p in "qkv")
                rest = q.shape[1:]
                grouped = torch.cat((q.reshape(kv_heads, heads // kv_heads, head_dim, *rest),
                                     k.reshape(kv_heads, 1, head_dim, *rest), v.reshape(kv_heads, 1, head_dim, *rest)),
                                    dim=1)
                tensors[f"model.layers.{layer}.attention.wqkv.{kind}"] = grouped.reshape(-1, *rest).contiguous()
        return _renamed(tensors, (("model.embed_tokens.", "model.tok_embeddings."),
                                  (".self_attn.o_proj.", ".attention.wo."), (".mlp.gate_proj.", ".feed_forward.w1."),
                                  (".mlp.up_proj.", ".feed_forward.w3."),
                                  (".mlp.down_proj.", ".feed_forward.w2."), (".input_layernorm.", ".attention_norm."),
                                  (".post_attention_layernorm.", ".ffn_norm."), ("lm_head.weight", "output.weight")))

    config = {"architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2", "bias": bias,
              "num_hidden_layers": reference.num_hidden_layers, "rms_norm_eps": reference.rms_norm_eps,
              "rope_theta": reference.rope_parameters["rope_theta"], **_shape(reference),
              **({"rope_scaling": overrides["rope_scaling"]} if "rope_scaling" in overrides else {})}
    return save_as(path, reference, rename, config)


def internlm3(path: Path, qkv_bias: bool) -> tuple[Path, torch.nn.Module]:
    """InternLM3's files: Llama's names; q/k/v biases without an output bias (Qwen2's arithmetic)."""
    reference = (Qwen2Config(**_SMALL) if qkv_bias else LlamaConfig(**_SMALL))
    config = {"architectures": ["InternLM3ForCausalLM"], "model_type": "internlm3", "qkv_bias": qkv_bias,
              "bias": False, "head_dim": reference.hidden_size // reference.num_attention_heads,
              "num_hidden_layers": reference.num_hidden_layers, "rms_norm_eps": reference.rms_norm_eps,
              "rope_theta": reference.rope_parameters["rope_theta"], **_shape(reference),
              "rope_scaling": {"rope_type": "dynamic", "factor": 6.0}}
    return save_as(path, reference, lambda tensors: tensors, config)


def exaone(path: Path, tied: bool = False, **overrides) -> tuple[Path, torch.nn.Module]:
    """EXAONE 3.x's files: transformer.h.N with ln_1 / ln_2, attn.attention, mlp.c_fc_0 / c_fc_1 / c_proj."""
    reference = LlamaConfig(**{**_SMALL, "tie_word_embeddings": tied, **overrides})
    shape = _shape(reference)
    config = {"architectures": ["ExaoneForCausalLM"], "model_type": "exaone", "num_layers": reference.num_hidden_layers,
              "layer_norm_epsilon": reference.rms_norm_eps, "activation_function": "silu",
              "rope_theta": reference.rope_parameters["rope_theta"], "tie_word_embeddings": tied, **shape,
              **({"rope_scaling": overrides["rope_scaling"]} if "rope_scaling" in overrides else {})}
    parts = (("model.embed_tokens.", "transformer.wte."), ("model.layers.", "transformer.h."),
             ("model.norm.", "transformer.ln_f."), (".input_layernorm.", ".ln_1."),
             (".post_attention_layernorm.", ".ln_2."), (".self_attn.o_proj.", ".attn.attention.out_proj."),
             (".self_attn.", ".attn.attention."), (".mlp.gate_proj.", ".mlp.c_fc_0."),
             (".mlp.up_proj.", ".mlp.c_fc_1."), (".mlp.down_proj.", ".mlp.c_proj."))
    return save_as(path, reference, lambda tensors: _renamed(tensors, parts), config)


CASES = {
    "internlm2": lambda p: internlm2(p),
    "internlm2_biases_mqa": lambda p: internlm2(p, bias=True, num_key_value_heads=1),
    # (InternLM2.5's dynamic NTK RoPE: plain within max_position_embeddings, as transformers' Llama too.)
    "internlm2_dynamic_ntk": lambda p: internlm2(p, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "internlm3_qkv_biases": lambda p: internlm3(p, qkv_bias=True),
    "internlm3": lambda p: internlm3(p, qkv_bias=False),
    "exaone": lambda p: exaone(p),
    "exaone_3_5_llama3_rope_tied": lambda p: exaone(p, tied=True, rope_scaling=LLAMA3_ROPE),
}


@pytest.mark.parametrize("case", list(CASES))
def test_their_logits_are_the_reference_llamas(tmp_path, case):
    path, reference = CASES[case](tmp_path)
    tokens = [(7 * i + 3) % 256 for i in range(45)]
    ours = prefill_logits(make_runner(path), tokens, list(range(12)))
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, expected, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("case", ["internlm2_biases_mqa", "exaone"])
def test_greedy_through_chunked_prefill_matches_the_reference(tmp_path, case):
    path, reference = CASES[case](tmp_path)
    test_model_runner.test_greedy_matches_hf_with_chunked_prefill(path, reference, 13, 5, decode_in_place=True)


def test_configs_as_released(caplog):
    """internlm2_5-7b-chat's config (dynamic NTK RoPE, logged and served plain within its 32,768
    positions; no biases), InternLM3-8B-Instruct's and EXAONE-3.5-7.8B-Instruct's (remote-code keys,
    llama3 RoPE)."""
    internlm2_5 = {"architectures": ["InternLM2ForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32, "bias": False,
                   "rms_norm_eps": 1e-05, "rope_theta": 1000000, "max_position_embeddings": 32768,
                   "rope_scaling": {"type": "dynamic", "factor": 2.0}, "vocab_size": 92544}
    with caplog.at_level(logging.INFO, logger="gpu_worker.config"):
        config = ModelConfig.from_dict(internlm2_5)
    assert "dynamic NTK RoPE is served as plain RoPE" in caplog.text
    assert config.rope_scaling is None and config.rope_theta == 1000000.0 and config.max_context_len == 32768
    assert not (config.qkv_bias or config.o_proj_bias) and config.head_dim == 128 and not config.tie_word_embeddings
    assert ModelConfig.from_dict({k: v for k, v in internlm2_5.items() if k != "bias"}).o_proj_bias  # (its default)
    internlm3 = {"architectures": ["InternLM3ForCausalLM"], "hidden_size": 4096, "intermediate_size": 10240,
                 "num_attention_heads": 32, "num_key_value_heads": 2, "num_hidden_layers": 48, "head_dim": 128,
                 "qkv_bias": False, "bias": False, "rope_theta": 50000000, "max_position_embeddings": 32768,
                 "rope_scaling": {"rope_type": "dynamic", "factor": 6.0}, "vocab_size": 128512}
    config = ModelConfig.from_dict(internlm3)
    assert config.rope_scaling is None and (config.num_key_value_heads, config.head_dim) == (2, 128)
    assert ModelConfig.from_dict({**internlm3, "qkv_bias": True}).qkv_bias
    exaone_3_5 = {"architectures": ["ExaoneForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "num_layers": 32, "activation_function": "silu",
                  "layer_norm_epsilon": 1e-05, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
                  "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                  "tie_word_embeddings": False, "vocab_size": 102400}
    config = ModelConfig.from_dict(exaone_3_5)
    assert (config.num_hidden_layers, config.rms_norm_eps, config.hidden_act) == (32, 1e-05, "silu")
    assert config.rope_scaling["rope_type"] == "llama3" and not config.tie_word_embeddings
    assert ModelConfig.from_dict({**exaone_3_5, "intermediate_size": None}).intermediate_size == 4 * 4096
