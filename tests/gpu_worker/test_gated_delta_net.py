"""Gated DeltaNet layers (Qwen3-Next's linear attention): the chunked delta rule against the token
recurrence and transformers' reference, and a mixer carrying each request's state across passes."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.layers.gated_delta_net import GatedDeltaNet, delta_rule_chunk_scan
from gpu_worker.mamba_config import GatedDeltaNetConfig
from tests.gpu_worker.utils import check_chunk_scan_is_the_recurrence, check_random_delta_rule_mixer_carries_state


def _inputs(length: int, heads: int = 4, dk: int = 8, dv: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(length, heads, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(length, heads, dk, generator=g), dim=-1)
    v = torch.randn(length, heads, dv, generator=g)
    decay = -torch.rand(length, heads, generator=g) * 2
    beta = torch.rand(length, heads, generator=g)
    state = torch.randn(heads, dk, dv, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("chunk_size", [1, 4, 16, 64])
def test_the_chunked_delta_rule_is_the_recurrence(chunk_size):
    """37 tokens from a nonzero state: every output and the final state are the recurrence's."""
    check_chunk_scan_is_the_recurrence(delta_rule_chunk_scan, _inputs(37), chunk_size)


def test_the_delta_rule_is_transformers_reference():
    """transformers' token-by-token reference (its own L2 norm and query scale) from zero."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 21, 4, 8, generator=g), torch.randn(1, 21, 4, 8, generator=g)
    v, decay = torch.randn(1, 21, 4, 6, generator=g), -torch.rand(1, 21, 4, generator=g)
    beta = torch.rand(1, 21, 4, generator=g)
    ref, ref_state = torch_recurrent_gated_delta_rule(q, k, v, decay, beta, output_final_state=True,
                                                      use_qk_l2norm_in_kernel=True)
    qn = q[0] * torch.rsqrt(q[0].pow(2).sum(-1, keepdim=True) + 1e-6) * 8 ** -0.5
    kn = k[0] * torch.rsqrt(k[0].pow(2).sum(-1, keepdim=True) + 1e-6)
    out, state = delta_rule_chunk_scan(qn, kn, v[0], decay[0], beta[0], torch.zeros(4, 8, 6), 8)
    torch.testing.assert_close(out, ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, ref_state[0], atol=1e-5, rtol=1e-5)


def test_a_mixer_carries_each_requests_state_across_passes():
    """Two sequences whole, and in pieces over four passes in other rows (chunks, single tokens
    batched as decodes): the same outputs."""
    config = GatedDeltaNetConfig(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6, conv_kernel=4, chunk_size=4)
    torch.manual_seed(1)
    mixer = GatedDeltaNet(24, config, 1e-6)
    check_random_delta_rule_mixer_carries_state(mixer, 24)


def test_key_heads_that_do_not_divide_the_ranks_are_refused_before_workers_start(tmp_path):
    from engine_core.config import EngineConfig, SchedulerConfig
    from gpu_worker.executor import create_executor
    from tests.gpu_worker.utils import save_tiny_model
    from tests.tiny_model import build_tokenizer

    path = save_tiny_model(tmp_path, "qwen3_next")
    build_tokenizer().save_pretrained(path)
    with pytest.raises(ValueError, match="Gated DeltaNet's 2 key heads cannot be split evenly over "
                                         "tensor_parallel_size=4"):
        create_executor(EngineConfig(model=str(path), device="cpu", num_gpu_blocks=16, tensor_parallel_size=4,
                                     scheduler=SchedulerConfig(max_model_len=64)))


def test_a_released_qwen3_next_config_is_read():
    """Qwen3-Next-80B-A3B's config.json keys: full attention every fourth layer (full_attention_interval,
    no layer_types), RoPE over a quarter of 256-dim heads, its linear-attention and expert geometry."""
    from gpu_worker.config import ModelConfig

    config = ModelConfig.from_dict({
        "architectures": ["Qwen3NextForCausalLM"], "hidden_size": 2048, "intermediate_size": 5120,
        "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "vocab_size": 151936, "rope_theta": 10000000, "partial_rotary_factor": 0.25, "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_experts": 512, "num_experts_per_tok": 10,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6, "max_position_embeddings": 262144})
    assert config.mamba_layers == (True, True, True, False) * 2 and config.num_attention_layers == 2
    assert config.mamba == GatedDeltaNetConfig(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128,
                                               conv_kernel=4)
    assert config.rotary_dim == 64 and config.head_dim == 256 and config.rope_theta == 10000000
    assert (config.num_experts, config.num_experts_per_tok, config.shared_expert_intermediate_size) == (512, 10, 512)
    assert config.shared_expert_gated and config.norm_topk_prob and config.layer_is_moe(0)
    with pytest.raises(ValueError, match="multiple of linear_num_key_heads"):
        ModelConfig.from_dict({**config.raw, "linear_num_value_heads": 24})


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_qwen3_5_vision_language_checkpoint_serves_its_language_model(tmp_path, moe):
    """Qwen3.5 as released (Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration: its
    language model under model.language_model, a vision tower, M-RoPE in its rope parameters): its
    language model is served on text, the tower not read, with transformers' logits for a text prompt."""
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig

    from gpu_worker.config import ModelConfig
    from tests.gpu_worker.utils import make_runner, prefill_logits

    text = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=256, initializer_range=0.1,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [1, 1, 0], "mrope_interleaved": True})
    if moe:
        text = {**{k: v for k, v in text.items() if k != "intermediate_size"}, "num_experts": 8,
                "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}
    torch.manual_seed(0)
    hf = AutoModelForImageTextToText.from_config((Qwen3_5MoeConfig if moe else Qwen3_5Config)(
        text_config=text, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                             out_hidden_size=64, patch_size=8))).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(("layernorm.weight", "norm.weight", "linear_attn.dt_bias")):
                param.normal_(0.0, 0.5)
    hf.save_pretrained(tmp_path)
    config = ModelConfig.from_pretrained(tmp_path)
    expected = "Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"
    assert config.architecture == expected and config.vision is None and config.num_experts == (8 if moe else 0)
    assert config.language_model_of == hf.config.architectures[0] and config.rotary_dim == 4
    assert config.mamba.split_projections and config.mamba_layers == (True, True, True, False)
    runner = make_runner(tmp_path, num_blocks=16, block_size=4)
    prompt = [(7 * i + 3) % 256 for i in range(45)]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([prompt]), use_cache=False).logits[0]
    torch.testing.assert_close(prefill_logits(runner, prompt, [5, 2, 9, 0, 11, 3, 7, 8, 1, 4, 6, 10]), ref,
                               atol=1e-4, rtol=1e-4)
