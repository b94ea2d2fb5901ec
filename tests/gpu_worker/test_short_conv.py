"""LFM2's gated short convolution: a mixer carrying each request's convolution state across passes,
its tensor-parallel share, released configs read, and the states' memory counted."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.config import ModelConfig
from gpu_worker.layers.mamba import MambaState
from gpu_worker.layers.short_conv import ShortConv
from gpu_worker.mamba_config import ShortConvConfig
from gpu_worker.worker import Worker
from tests.gpu_worker.utils import check_mixer_carries_state, run_mixer_pass, save_tiny_model


def _random_mixer(config: ShortConvConfig, hidden: int = 24) -> ShortConv:
    torch.manual_seed(1)
    mixer = ShortConv(hidden, config)
    with torch.no_grad():
        for param in mixer.parameters():
            param.copy_(torch.randn(param.shape) * 0.5)
    return mixer


@pytest.mark.parametrize("kernel", [2, 3, 5])
def test_a_mixer_carries_each_requests_state_across_passes(kernel):
    """Two sequences whole, and in pieces over five passes in other rows (chunks shorter and longer
    than the convolution's window, single tokens batched as decodes): the same outputs."""
    config = ShortConvConfig(channels=12, conv_kernel=kernel, bias=True)
    mixer = _random_mixer(config)
    torch.manual_seed(2)
    seqs = [torch.randn(13, 24), torch.randn(11, 24)]
    check_mixer_carries_state(mixer, seqs)
    # Each row ends with its sequence's last kernel - 1 inputs to the convolution (B * x).
    b, _, x = mixer.in_proj.forward(seqs[0][-(kernel - 1):]).chunk(3, dim=-1)
    torch.testing.assert_close(mixer.state.conv[3], (b * x).t())


def test_a_short_conv_is_transformers_lfm2_short_conv():
    """The mixer's prefill and decodes against transformers' Lfm2ShortConv on the same weights (its
    conv state: the last conv_L_cache - 1 inputs, read back after every step)."""
    from transformers import Lfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

    hf_config = Lfm2Config(hidden_size=24, conv_L_cache=3, conv_bias=True, num_hidden_layers=1, full_attn_idxs=[])
    torch.manual_seed(3)
    reference = Lfm2ShortConv(hf_config, 0).eval()
    with torch.no_grad():
        for param in reference.parameters():
            param.normal_(0.0, 0.5)
    mixer = ShortConv(24, ShortConvConfig(24, 3, bias=True))
    state = reference.state_dict()
    for name, param in mixer.named_parameters():
        loader = getattr(param, "weight_loader", None)
        if loader is not None:
            loader(param, state[name])
        else:
            param.data.copy_(state[name])
    mixer.state = MambaState.allocate(mixer.config, 1, torch.float32, torch.device("cpu"))
    tokens = torch.randn(9, 24)
    with torch.no_grad():
        expected = reference(tokens[None])[0]
    got = torch.cat([run_mixer_pass(mixer, [(0, tokens[:6])])[0]]
                    + [run_mixer_pass(mixer, [(0, tokens[i:i + 1])])[0] for i in range(6, 9)])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_ranks_share_of_the_channels():
    config = ShortConvConfig(channels=2048, conv_kernel=3)
    assert config.per_rank(4) == ShortConvConfig(512, 3) and config.state_shapes() == ((2048, 2), (0,))
    assert config.state_bytes(torch.bfloat16) == 2048 * 2 * 2
    with pytest.raises(ValueError, match="2048 channels cannot be split evenly over tensor_parallel_size=3"):
        config.per_rank(3)


# LFM2-1.2B's config.json as released (the keys this reader takes; the block_* ones Liquid's trainer
# wrote besides are not read).
LFM2_1_2B = {"architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "hidden_size": 2048,
             "intermediate_size": 12288, "block_ff_dim": 12288, "block_auto_adjust_ff_dim": True,
             "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 256, "num_hidden_layers": 16,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 65536,
             "max_position_embeddings": 128000, "rope_theta": 1000000.0, "conv_L_cache": 3, "conv_bias": False,
             "norm_eps": 1e-05, "tie_embedding": True, "torch_dtype": "bfloat16", "bos_token_id": 1,
             "eos_token_id": 7, "pad_token_id": 0,
             "layer_types": ["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv",
                             "full_attention", "conv", "full_attention", "conv", "full_attention", "conv",
                             "full_attention", "conv"]}


def test_released_lfm2_configs_are_read():
    """LFM2-1.2B: its MLP 8192 wide (2/3 of 12288), six attention layers of sixteen with q/k norms,
    tied embeddings; LFM2-350M (1024 wide, its attention layers as full_attn_idxs): 4608."""
    config = ModelConfig.from_dict(LFM2_1_2B)
    assert config.intermediate_size == 8192 and config.tie_word_embeddings and config.qk_norm
    assert config.mamba == ShortConvConfig(2048, 3, False) and config.num_attention_layers == 6
    assert config.rms_norm_eps == 1e-5 and config.rope_theta == 1e6 and config.eos_token_ids == (7,)
    small = {k: v for k, v in LFM2_1_2B.items() if k not in ("layer_types", "block_ff_dim")}
    config = ModelConfig.from_dict({**small, "hidden_size": 1024, "intermediate_size": 6656, "num_attention_heads": 16,
                                    "full_attn_idxs": [2, 5, 8, 10, 12, 14]})
    assert config.intermediate_size == 4608 and config.head_dim == 64
    assert config.mamba_layers == tuple(i not in (2, 5, 8, 10, 12, 14) for i in range(16))
    with pytest.raises(ValueError, match="LFM2's layers are 'conv' or 'full_attention', got \\['mamba'\\]"):
        ModelConfig.from_dict({**LFM2_1_2B, "layer_types": ["mamba"] * 16})


def test_the_cache_budget_leaves_room_for_the_convolution_states(tmp_path):
    """Each conv layer keeps conv_L_cache - 1 inputs of every channel for max_num_seqs requests: the
    budget loses them before it is cut into blocks of the attention layers alone."""
    path = save_tiny_model(tmp_path, "lfm2")
    worker = Worker(0, 1, str(path), device="cpu", dtype="float32", max_model_len=64, max_num_seqs=6)
    worker.load_model()
    states = worker.mamba_state_bytes()
    assert states == 3 * 6 * 64 * 2 * 4  # (three conv layers, six requests, 64 channels of 2 inputs, fp32)
    per_block = worker.bytes_per_block(4)
    assert worker.determine_num_blocks(4, None, states + 10 * per_block) == 10
