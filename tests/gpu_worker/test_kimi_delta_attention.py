"""Kimi Delta Attention (Kimi-Linear's linear attention): the chunked delta rule with per-channel decay
against the token recurrence and transformers' references, and a mixer carrying each request's state
across passes."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.layers.kimi_delta_attention import KimiDeltaAttention, kda_chunk_scan
from gpu_worker.mamba_config import KimiDeltaAttentionConfig
from tests.gpu_worker.utils import check_chunk_scan_is_the_recurrence, check_random_delta_rule_mixer_carries_state


def _inputs(length: int, heads: int = 3, dk: int = 8, dv: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(length, heads, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(length, heads, dk, generator=g), dim=-1)
    v = torch.randn(length, heads, dv, generator=g)
    # (Some channels barely decay, some all but forget: the pairwise factors span many orders.)
    decay = -torch.rand(length, heads, dk, generator=g) * torch.logspace(-3, 1, dk)
    beta = torch.rand(length, heads, generator=g)
    state = torch.randn(heads, dk, dv, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("chunk_size", [1, 4, 16, 64])
def test_the_chunked_rule_is_the_recurrence(chunk_size):
    """37 tokens from a nonzero state: every output and the final state are the token recurrence's
    (delta_rule_step with a decay per key channel)."""
    check_chunk_scan_is_the_recurrence(kda_chunk_scan, _inputs(37), chunk_size)


def test_the_rule_is_transformers_reference():
    """transformers' token-by-token and chunked KDA references (their own L2 norm and query scale),
    from a nonzero state: the same outputs and final state."""
    from transformers.models.kimi_linear.modeling_kimi_linear import (
        chunk_kimi_delta_attention,
        recurrent_kimi_delta_attention,
    )

    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 21, 4, 8, generator=g), torch.randn(1, 21, 4, 8, generator=g)
    v, decay = torch.randn(1, 21, 4, 8, generator=g), -torch.rand(1, 21, 4, 8, generator=g)
    beta, state = torch.rand(1, 21, 4, generator=g), torch.randn(1, 4, 8, 8, generator=g)
    qn = q[0] / torch.sqrt(q[0].pow(2).sum(-1, keepdim=True) + 1e-6) * 8 ** -0.5
    kn = k[0] / torch.sqrt(k[0].pow(2).sum(-1, keepdim=True) + 1e-6)
    out, final = kda_chunk_scan(qn, kn, v[0], decay[0], beta[0], state[0].clone(), 8)
    for reference in (recurrent_kimi_delta_attention, chunk_kimi_delta_attention):
        ref, ref_state = reference(q, k, v, g=decay, beta=beta, initial_state=state.clone(),
                                   output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out, ref[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final, ref_state[0], atol=1e-5, rtol=1e-5)


def test_a_mixer_carries_each_requests_state_across_passes():
    """Two sequences whole, and in pieces over four passes in other rows (chunks, single tokens
    batched as decodes): the same outputs."""
    config = KimiDeltaAttentionConfig(num_heads=3, head_dim=8, conv_kernel=4, chunk_size=4)
    torch.manual_seed(1)
    mixer = KimiDeltaAttention(24, config, 1e-5)
    check_random_delta_rule_mixer_carries_state(mixer, 24)


# Kimi-Linear-48B-A3B-Instruct's config.json (its auto_map and dtype left out).
RELEASED = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "bos_token_id": 163584,
    "eos_token_id": 163586, "pad_token_id": 163839, "first_k_dense_replace": 1, "head_dim": 72, "hidden_act": "silu",
    "hidden_size": 2304, "initializer_range": 0.02, "intermediate_size": 9216, "kv_lora_rank": 512,
    "linear_attn_config": {"kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
                           "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "num_heads": 32, "head_dim": 128,
                           "short_conv_kernel_size": 4},
    "mla_use_nope": True, "model_max_length": 1048576, "moe_intermediate_size": 1024, "moe_layer_freq": 1,
    "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "num_attention_heads": 32,
    "num_expert_group": 1, "num_experts": 256, "num_experts_per_token": 8, "num_hidden_layers": 27,
    "num_key_value_heads": 32, "num_nextn_predict_layers": 0, "num_shared_experts": 1, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 10000.0, "routed_scaling_factor": 2.446, "tie_word_embeddings": False, "topk_group": 1,
    "use_cache": True, "use_grouped_topk": True, "v_head_dim": 128, "vocab_size": 163840}


def test_the_released_kimi_linear_config_is_read():
    """Its layers numbered from 1 in linear_attn_config (MLA in the 4th, 8th, ..., 24th and the last), its
    KDA geometry, MLA without positions (no query bottleneck, one latent row of 576 a token), the
    experts under Kimi's own key names; what it does not have is refused."""
    from gpu_worker.config import ModelConfig

    config = ModelConfig.from_dict(RELEASED)
    mla = [i for i in range(27) if not config.layer_is_mamba(i)]
    assert mla == [3, 7, 11, 15, 19, 23, 26] and config.num_attention_layers == 7
    assert config.mamba == KimiDeltaAttentionConfig(num_heads=32, head_dim=128, conv_kernel=4)
    assert config.mamba.state_bytes(torch.bfloat16) == 3 * 4096 * 3 * 2 + 32 * 128 * 128 * 4
    assert config.rope_layers == (False,) * 27 and not config.rope_interleave
    assert (config.num_key_value_heads, config.head_dim, config.q_lora_rank) == (1, 576, 0)
    assert config.attention_scale == pytest.approx(192 ** -0.5)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (256, 8, 1024)
    assert config.moe_scoring == "sigmoid" and config.moe_correction_bias and config.norm_topk_prob
    assert (config.moe_num_groups, config.moe_topk_groups, config.routed_scaling_factor) == (1, 1, 2.446)
    assert config.shared_expert_intermediate_size == 1024 and not config.shared_expert_gated
    assert not config.layer_is_moe(0) and config.layer_is_moe(1) and config.layer_is_moe(26)
    assert config.max_position_embeddings == 1048576 and not config.tie_word_embeddings
    assert config.eos_token_ids == (163586,) and config.num_mtp_layers == 0
    for change, refusal in [({"mla_use_nope": False}, "RoPE in its MLA"),
                            ({"moe_router_activation_func": "softmax"}, "sigmoid routing"),
                            ({"linear_attn_config": {**RELEASED["linear_attn_config"], "gate_lower_bound": -5.0}},
                             "gate lower bound"),
                            ({"linear_attn_config": {**RELEASED["linear_attn_config"], "full_attn_layers": [4, 28]}},
                             "numbers layers from 1 to 27"),
                            ({"linear_attn_config": {**RELEASED["linear_attn_config"], "full_attn_layers": [4]}},
                             "must name each of the 27 layers")]:
        with pytest.raises(ValueError, match=refusal):
            ModelConfig.from_dict({**RELEASED, **change})


def test_heads_that_do_not_divide_the_ranks_are_refused_before_workers_start(tmp_path):
    from engine_core.config import EngineConfig, SchedulerConfig
    from gpu_worker.executor import create_executor
    from tests.gpu_worker.utils import save_tiny_model
    from tests.tiny_model import build_tokenizer

    path = save_tiny_model(tmp_path, "kimi_linear", linear_num_heads=3, linear_head_dim=16)
    build_tokenizer().save_pretrained(path)
    with pytest.raises(ValueError, match="Kimi Delta Attention's 3 heads cannot be split evenly over "
                                         "tensor_parallel_size=2"):
        create_executor(EngineConfig(model=str(path), device="cpu", num_gpu_blocks=16, tensor_parallel_size=2,
                                     scheduler=SchedulerConfig(max_model_len=64)))


def test_kda_layers_tensors_are_read_as_the_recurrent_mixers_whatever_their_prefix():
    """A KDA layer's ``self_attn`` tensors, under the causal LM's ``model.`` or a bare decoder's names,
    are its recurrent mixer's; an MLA layer's stay attention's."""
    from gpu_worker.config import ModelConfig
    from gpu_worker.models.renamed_checkpoint import recurrent_mixer_name

    config = ModelConfig.from_dict(RELEASED)
    for prefix in ("model.", ""):
        assert recurrent_mixer_name(f"{prefix}layers.2.self_attn.q_proj.weight", config) == (
            f"{prefix}layers.2.mamba.q_proj.weight")
        assert recurrent_mixer_name(f"{prefix}layers.3.self_attn.q_proj.weight", config) == (
            f"{prefix}layers.3.self_attn.q_proj.weight")
        assert recurrent_mixer_name(f"{prefix}layers.12.self_attn.A_log", config) == f"{prefix}layers.12.mamba.A_log"
