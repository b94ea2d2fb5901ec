"""Ling 3 (BailingHybridForCausalLM): Kimi Delta Attention with whole-projection, safe gates beside
rotating, head-gated MLA and clipped experts, against transformers' model; its released config keys."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.config import ModelConfig
from gpu_worker.mamba_config import KimiDeltaAttentionConfig
from tests.gpu_worker.utils import load_hf, make_runner, prefill_logits, save_tiny_model


def _hf_token_by_token(hf, prompt: list[int]) -> torch.Tensor:
    """transformers' logits for each prompt token, one token a forward (its KDA recurrence): its chunked
    prefill drifts ~2e-4 from this with the safe gate's strong decays, ours ~5e-5."""
    with torch.no_grad():
        out = hf(torch.tensor([prompt[:1]]), use_cache=True)
        cache, logits = out.past_key_values, [out.logits[0]]
        for token in prompt[1:]:
            out = hf(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits[0])
    return torch.cat(logits)


@pytest.mark.parametrize("overrides", [{}, {"kda_safe_gate": False, "q_lora_rank": 16}],
                         ids=["safe_gate", "softplus_gate_query_bottleneck"])
def test_logits_match_transformers(tmp_path, overrides):
    """A 45-token prompt through scattered cache blocks (the released names: word_embeddings, attention,
    dense, expert_bias), against transformers' token-by-token logits."""
    path = save_tiny_model(tmp_path, "bailing_hybrid", **overrides)
    runner = make_runner(path, num_blocks=16, block_size=4)
    prompt = [(7 * i + 3) % 256 for i in range(45)]
    ours = prefill_logits(runner, prompt, [5, 2, 9, 0, 11, 3, 7, 8, 1, 4, 6, 10])
    torch.testing.assert_close(ours, _hf_token_by_token(load_hf(path), prompt), atol=1e-4, rtol=1e-4)


def test_the_clips_and_gates_are_applied(tmp_path):
    """Without the experts' clips the logits move (the tiny model's activations cross its limits)."""
    from gpu_worker.layers.activation import SiluAndMul

    path = save_tiny_model(tmp_path, "bailing_hybrid")
    prompt = [(7 * i + 3) % 256 for i in range(21)]
    clipped = prefill_logits(make_runner(path, num_blocks=16, block_size=4), prompt, list(range(6)))
    runner = make_runner(path, num_blocks=16, block_size=4)
    for layer in runner.model.model.layers:
        if getattr(layer.mlp, "experts", None) is not None:
            layer.mlp.experts.activation = "silu"
            layer.mlp.shared_experts.act = SiluAndMul()
    assert (prefill_logits(runner, prompt, list(range(6))) - clipped).abs().max() > 1e-2


# Ling 3's config keys as its release states them (its architecture's released name, use_qk_norm left from
# Ling 2, a partial RoPE share equal to qk_rope_head_dim; its geometry shrunk to two groups of three layers).
RELEASED = {"architectures": ["BailingMoeV3ForCausalLM"], "model_type": "bailing_hybrid", "vocab_size": 157184,
            "hidden_size": 2560, "intermediate_size": 6144, "num_hidden_layers": 6, "num_attention_heads": 32,
            "num_key_value_heads": 32, "head_dim": 128, "layer_group_size": 3, "short_conv_kernel_size": 4,
            "no_kda_lora": True, "kda_safe_gate": True, "kda_lower_bound": -5.0, "q_lora_rank": None,
            "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
            "rope_interleave": True, "gated_attention_proj_granularity_type": "head_wise", "use_qk_norm": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 6000000, "partial_rotary_factor": 0.5},
            "first_k_dense_replace": 2, "num_experts": 512, "num_experts_per_tok": 8,
            "num_shared_experts": 1, "moe_intermediate_size": 768, "moe_shared_expert_intermediate_size": 768,
            "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 1,
            "expert_swiglu_limit_list": [0, 0, 7.0, 7.0, 7.0, 7.0],
            "share_expert_swiglu_limit_list": [0, 0, 7.0, 7.0, 7.0, 7.0], "rms_norm_eps": 1e-6,
            "max_position_embeddings": 262144, "tie_word_embeddings": False}


def test_the_released_config_is_read():
    config = ModelConfig.from_dict(RELEASED)
    assert config.architecture == "BailingHybridForCausalLM"
    assert [config.layer_is_mamba(i) for i in range(6)] == [True, True, False] * 2
    assert config.mamba == KimiDeltaAttentionConfig(num_heads=32, head_dim=128, conv_kernel=4, full_rank_gates=True,
                                                    gate_lower_bound=-5.0)
    assert config.mla_head_gate and config.rope_interleave and config.rope_theta == 6000000
    assert (config.head_dim, config.rotary_dim, config.q_lora_rank) == (576, 64, 0)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_num_groups, config.moe_topk_groups) == (
        512, 8, 8, 4)
    assert config.shared_expert_intermediate_size == 768 and config.routed_scaling_factor == 2.5
    assert [config.layer_is_moe(i) for i in range(6)] == [False, False, True, True, True, True]
    assert config.swiglu_limits == (0, 0, 7.0, 7.0, 7.0, 7.0) == config.shared_swiglu_limits
    assert config.num_mtp_layers == 0  # (its MTP layer is not read)
    unsafe = ModelConfig.from_dict({**RELEASED, "kda_safe_gate": False})
    assert unsafe.mamba.gate_lower_bound is None
    for change, refusal in [({"no_kda_lora": False}, "full-rank"),
                            ({"gated_attention_proj_granularity_type": "element_wise"}, "head-wise"),
                            ({"moe_shared_expert_intermediate_size": 1024}, "not moe_shared_expert"),
                            ({"expert_swiglu_limit_list": [0, 7.0]}, "one limit per decoder layer")]:
        with pytest.raises(ValueError, match=refusal):
            ModelConfig.from_dict({**RELEASED, **change})
