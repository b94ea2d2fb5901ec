"""MiniCPM (MiniCPMForCausalLM: MiniCPM-1B / 2B, MiniCPM4, MiniCPM-MoE-8x2B), whose code is its own
(remote code, which transformers does not ship): the Llama block with MiniCPM's scalings, the same
arithmetic as transformers' Granite with embedding_multiplier = scale_emb, residual_multiplier =
scale_depth / sqrt(num_hidden_layers), attention_multiplier = head_dim ** -0.5 and logits_scaling =
hidden_size / dim_model_base (Granite MoE's routing, the softmax's top k renormalised, is Mixtral's and
MiniCPM-MoE's). So a random Granite model, saved as MiniCPM names and describes it, is the reference."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GraniteConfig, GraniteMoeConfig

from gpu_worker.config import ModelConfig
from tests.gpu_worker import test_model_runner
from tests.gpu_worker.utils import _SMALL, make_runner, prefill_logits

SCALE_EMB, SCALE_DEPTH, DIM_MODEL_BASE = 12.0, 1.4, 16


def save_minicpm(path: Path, num_experts: int = 0, seed: int = 0, **overrides) -> tuple[Path, torch.nn.Module]:
    """A random MiniCPM checkpoint (MiniCPM-MoE's, with ``num_experts``) and the Granite (MoE) model
    that computes what it should; ``overrides`` go to both configs (rope_scaling, tie_word_embeddings...)."""
    kw = {**_SMALL, **overrides}
    layers, hidden, heads = kw["num_hidden_layers"], kw["hidden_size"], kw["num_attention_heads"]
    scalings = dict(embedding_multiplier=SCALE_EMB, residual_multiplier=SCALE_DEPTH / math.sqrt(layers),
                    attention_multiplier=(hidden // heads) ** -0.5, logits_scaling=hidden / DIM_MODEL_BASE)
    torch.manual_seed(seed)
    if num_experts:
        config = GraniteMoeConfig(**{**kw, "intermediate_size": 32}, **scalings, num_local_experts=num_experts,
                                  num_experts_per_tok=2)
    else:
        config = GraniteConfig(**kw, **scalings)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    reference.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if ".block_sparse_moe." in n]:  # (MiniCPM-MoE's: Mixtral's experts)
        tensor, prefix = tensors.pop(name), name.split(".block_sparse_moe.")[0] + ".mlp."
        if name.endswith("router.layer.weight"):
            tensors[prefix + "gate.weight"] = tensor
        for expert in range(num_experts):
            if name.endswith("input_linear.weight"):
                gate, up = tensor[expert].chunk(2)
                tensors[f"{prefix}experts.{expert}.w1.weight"] = gate.contiguous()
                tensors[f"{prefix}experts.{expert}.w3.weight"] = up.contiguous()
            elif name.endswith("output_linear.weight"):
                tensors[f"{prefix}experts.{expert}.w2.weight"] = tensor[expert].contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    minicpm = {"architectures": ["MiniCPMForCausalLM"], "model_type": "minicpm", "hidden_act": "silu",
               "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32", "rms_norm_eps": config.rms_norm_eps,
               "scale_emb": SCALE_EMB, "scale_depth": SCALE_DEPTH, "dim_model_base": DIM_MODEL_BASE,
               "tie_word_embeddings": config.tie_word_embeddings,
               **{k: getattr(config, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                  "num_attention_heads", "num_key_value_heads", "vocab_size",
                                                  "max_position_embeddings")}}
    minicpm.update({k: v for k, v in overrides.items() if k == "rope_scaling"})
    if num_experts:
        minicpm.update(num_experts=num_experts, num_experts_per_tok=2)
    (path / "config.json").write_text(json.dumps(minicpm))
    return path, reference


CASES = {
    "tied": (0, {"tie_word_embeddings": True}),
    "untied_mqa": (0, {"tie_word_embeddings": False, "num_key_value_heads": 1}),
    "moe": (8, {}),
    # MiniCPM4's LongRoPE: the 21-token prompt past a pretrained 16 positions (the long factors).
    "longrope": (0, {"max_position_embeddings": 64, "rope_scaling": {
        "rope_type": "longrope", "short_factor": [1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.8, 2.0],
        "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0], "original_max_position_embeddings": 16}}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_minicpms_logits_are_granites_with_its_scalings(tmp_path, case):
    num_experts, overrides = CASES[case]
    path, reference = save_minicpm(tmp_path, num_experts, **overrides)
    runner = make_runner(path)
    tokens = [(7 * i + 3) % 256 for i in range(21)]
    ours = prefill_logits(runner, tokens, list(range(6)))
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, expected, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("num_experts", [0, 8], ids=["dense", "moe"])
def test_minicpm_greedy_through_chunked_prefill_matches_its_reference(tmp_path, num_experts):
    path, reference = save_minicpm(tmp_path, num_experts)
    test_model_runner.test_greedy_matches_hf_with_chunked_prefill(path, reference, 13, 5, decode_in_place=True)


def test_minicpm_configs_as_released(caplog):
    """MiniCPM-2B-sft's config (its remote code's keys, tied embeddings unstated), MiniCPM-MoE-8x2B's
    (8 experts, 2 a token) and MiniCPM4-8B's (LongRoPE, untied, sparse_config: logged, not followed);
    heads of another width (kv_channels) and scalings turned off refused."""
    minicpm_2b = {"architectures": ["MiniCPMForCausalLM"], "hidden_size": 2304, "intermediate_size": 5760,
                  "num_hidden_layers": 40, "num_attention_heads": 36, "num_key_value_heads": 36,
                  "vocab_size": 122753, "max_position_embeddings": 2048, "rms_norm_eps": 1e-05,
                  "rope_theta": 10000.0, "scale_emb": 12, "dim_model_base": 256, "scale_depth": 1.4}
    config = ModelConfig.from_dict(minicpm_2b)
    assert (config.embedding_multiplier, config.logits_scaling) == (12.0, 9.0) and config.tie_word_embeddings
    assert config.residual_multiplier == pytest.approx(1.4 / math.sqrt(40)) and config.head_dim == 64
    assert config.attention_scale == pytest.approx(64 ** -0.5) and config.num_experts == 0
    moe = ModelConfig.from_dict({**minicpm_2b, "num_experts": 8, "num_experts_per_tok": 2})
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (8, 2, 5760)
    assert moe.norm_topk_prob and all(moe.layer_is_moe(i) for i in range(40))
    minicpm4 = {"architectures": ["MiniCPMForCausalLM"], "hidden_size": 4096, "intermediate_size": 16384,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 2, "vocab_size": 73448,
                "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
                "scale_emb": 12, "dim_model_base": 256, "scale_depth": 1.4,
                "rope_scaling": {"rope_type": "longrope", "long_factor": [1.0] * 64, "short_factor": [1.0] * 64,
                                 "original_max_position_embeddings": 32768},
                "sparse_config": {"kernel_size": 32, "kernel_stride": 16, "init_blocks": 1, "block_size": 64,
                                  "window_size": 2048, "topk": 64, "use_nope": False, "dense_len": 8192}}
    with caplog.at_level(logging.WARNING, logger="gpu_worker.config"):
        config = ModelConfig.from_dict(minicpm4)
    assert "sparse_config is not followed" in caplog.text and "8192" in caplog.text
    assert config.rope_scaling["rope_type"] == "longrope" and not config.tie_word_embeddings
    assert (config.num_key_value_heads, config.head_dim, config.logits_scaling) == (2, 128, 16.0)
    with pytest.raises(ValueError, match="kv_channels"):
        ModelConfig.from_dict({**minicpm4, "kv_channels": 64})
    with pytest.raises(ValueError, match="use_mup"):
        ModelConfig.from_dict({**minicpm4, "use_mup": False})
