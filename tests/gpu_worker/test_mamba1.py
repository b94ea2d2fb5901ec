"""Mamba (selective SSM, "Mamba-1") layers: the chunked scan against the token recurrence, a mixer
carrying each request's state across passes, its tensor-parallel share, and a released config."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.config import ModelConfig
from gpu_worker.layers.mamba1 import MambaMixer, _scan_pieces, selective_chunk_scan, selective_step
from gpu_worker.mamba_config import Mamba1Config
from tests.gpu_worker.utils import check_mixer_carries_state


@pytest.mark.parametrize("steep", [0.0, 4.0, 150.0], ids=["one_piece", "pieces", "steeper_than_fp32_alone"])
def test_the_vectorised_scan_is_the_recurrence(steep):
    """40 tokens from a nonzero state: in one piece; in several (decays that sum past the bound within
    the sequence); and with tokens whose own decay, exp(-150), is below fp32's range (each its own
    piece, nothing overflows). Every output and the final state are the recurrence's."""
    g = torch.Generator().manual_seed(0)
    length, channels, size = 40, 6, 5
    x, b, c = torch.randn(length, channels, generator=g), torch.randn(length, size, generator=g), \
        torch.randn(length, size, generator=g)
    dt = torch.rand(length, channels, generator=g) * 0.2 + 0.01
    dt[::7] += steep / 3
    a, h0 = -torch.rand(channels, size, generator=g) * 3, torch.randn(channels, size, generator=g)
    y, state = selective_chunk_scan(x, dt, a, b, c, h0)
    h, ys = h0[None].clone(), []
    for t in range(length):
        out, h = selective_step(x[t:t + 1], dt[t:t + 1], a, b[t:t + 1], c[t:t + 1], h)
        ys.append(out[0])
    # (fp32's rounding, of the recurrence's order, at the outputs' scale: up to ~450 where dt is 50)
    scale = max(1.0, torch.stack(ys).abs().max().item())
    torch.testing.assert_close(y, torch.stack(ys), atol=1e-6 * scale, rtol=1e-5)
    torch.testing.assert_close(state, h[0], atol=1e-6 * scale, rtol=1e-5)


def test_scan_pieces_bound_the_decay_after_their_first_token_and_their_length():
    assert _scan_pieces([1.0] * 10, 100) == [(0, 10)]
    assert _scan_pieces([20.0, 20.0, 5.0, 6.0, 100.0, 1.0], 100) == [(0, 3), (3, 4), (4, 6)]
    assert _scan_pieces([0.1] * 7, 3) == [(0, 3), (3, 6), (6, 7)]


@pytest.mark.parametrize("dt_bc_norm", [None, "weightless", "weighted"])
def test_a_mixer_carries_each_requests_state_across_passes(dt_bc_norm):
    config = Mamba1Config(intermediate_size=12, state_size=5, conv_kernel=4, dt_rank=3, proj_bias=True,
                          dt_bc_norm=dt_bc_norm)
    torch.manual_seed(1)
    mixer = MambaMixer(24, config)
    with torch.no_grad():
        for param in mixer.parameters():
            param.copy_(torch.randn(param.shape) * (0.3 if param.dim() > 1 else 0.5))
    torch.manual_seed(2)
    check_mixer_carries_state(mixer, [torch.randn(13, 24), torch.randn(11, 24)])


def test_a_ranks_share_of_the_channels():
    config = Mamba1Config(intermediate_size=8192, state_size=16, conv_kernel=4, dt_rank=256)
    assert config.per_rank(4).intermediate_size == 2048 and config.per_rank(4).dt_rank == 256
    assert config.state_shapes() == ((8192, 3), (8192, 16))
    assert config.state_bytes(torch.bfloat16) == 8192 * 3 * 2 + 8192 * 16 * 4
    with pytest.raises(ValueError, match="Mamba's 8192 channels cannot be split evenly over tensor_parallel_size=3"):
        config.per_rank(3)


def test_released_mamba_configs_are_read():
    """state-spaces/mamba-130m-hf's (dt's rank 48, tied embeddings by default) and Falcon-Mamba-7B's
    (dt's rank "auto": 256; its intermediate_size, 8192, over expand x hidden = 65536, as transformers
    reads it; weightless dt / B / C norms; untied embeddings)."""
    mamba = ModelConfig.from_dict({"architectures": ["MambaForCausalLM"], "hidden_size": 768, "state_size": 16,
                                   "num_hidden_layers": 24, "vocab_size": 50280, "expand": 2, "conv_kernel": 4,
                                   "time_step_rank": 48, "use_bias": False, "use_conv_bias": True,
                                   "layer_norm_epsilon": 1e-5})
    assert mamba.mamba == Mamba1Config(1536, 16, 4, 48) and mamba.tie_word_embeddings
    assert mamba.num_attention_layers == 0 and mamba.rms_norm_eps == 1e-5
    falcon = ModelConfig.from_dict({"architectures": ["FalconMambaForCausalLM"], "hidden_size": 4096,
                                    "state_size": 16, "num_hidden_layers": 64, "vocab_size": 65024, "expand": 16,
                                    "intermediate_size": 8192,
                                    "conv_kernel": 4, "time_step_rank": "auto", "tie_word_embeddings": False,
                                    "mixer_rms_eps": 1e-6, "layer_norm_epsilon": 1e-5})
    assert falcon.mamba == Mamba1Config(8192, 16, 4, 256, dt_bc_norm="weightless")
    assert not falcon.tie_word_embeddings and falcon.num_hidden_layers == 64
