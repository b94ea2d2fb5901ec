"""Lightning attention (MiniMax-Text-01's and MiniMax-M1's linear attention): the chunked form against
the token recurrence, the mixer against transformers' layer, and a mixer carrying each request's state
across passes."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.layers.lightning_attention import (
    LightningAttention,
    lightning_chunk_scan,
    lightning_slopes,
    lightning_step,
)
from gpu_worker.mamba_config import LightningAttentionConfig
from tests.gpu_worker.utils import check_mixer_carries_state, run_mixer_pass


@pytest.mark.parametrize("chunk_size", [1, 4, 16, 64])
def test_the_chunked_form_is_the_recurrence(chunk_size):
    """37 tokens from a nonzero state, rates from nearly none to forgetting most of the state a token:
    every output and the final state are the recurrence's."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(37, 4, 8, generator=g) for _ in range(3))
    slopes, state = torch.tensor([1e-4, 0.05, 0.5, 2.0]), torch.randn(4, 8, 8, generator=g)
    out, final = lightning_chunk_scan(q, k, v, slopes, state, chunk_size)
    s, outs = state[None].clone(), []
    for t in range(37):
        o, s = lightning_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], slopes, s)
        outs.append(o[0])
    torch.testing.assert_close(out, torch.stack(outs), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(final, s[0], atol=1e-4, rtol=1e-5)


def _hf_layer(layer: int, num_layers: int = 6):
    from transformers import MiniMaxConfig
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    config = MiniMaxConfig(hidden_size=24, num_attention_heads=3, head_dim=8, num_hidden_layers=num_layers,
                           block_size=8)
    torch.manual_seed(2)
    hf = MiniMaxLightningAttention(config, layer).eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.copy_(torch.randn(param.shape) * (0.3 if param.dim() > 1 else 0.5) + (param.dim() == 1))
    return hf


@pytest.mark.parametrize("layer", [0, 3, 5])
def test_the_decay_rates_are_transformers(layer):
    hf = _hf_layer(layer)
    torch.testing.assert_close(lightning_slopes(3, layer, 6), hf.slope_rate.view(-1))


def test_the_mixer_is_transformers_layer_over_a_prefill_and_decodes():
    """21 tokens through transformers' blocks of 8, then 4 decodes from its cached state: our mixer's
    outputs, a prefill of 21 tokens in chunks of 4 and the decodes batched one by one, are the same."""
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    hf = _hf_layer(2)
    mixer = LightningAttention(24, LightningAttentionConfig(num_heads=3, head_dim=8, chunk_size=4), 1e-6)
    weights = {k.replace("qkv_proj", "in_proj_qkv"): v for k, v in hf.state_dict().items()
               if "decay" not in k and "slope" not in k}
    assert not mixer.load_state_dict(weights, strict=False).unexpected_keys
    mixer.set_layer(2, 6)
    x = torch.randn(25, 24)
    cache = MiniMaxCache()
    with torch.no_grad():
        ref = [hf(x[None, :21], None, None, cache=cache)[0][0]]
        for t in range(21, 25):
            ref.append(hf(x[None, t:t + 1], None, None, cache=cache)[0][0])
        from gpu_worker.layers.mamba import MambaState

        mixer.state = MambaState.allocate(mixer.config, 2, torch.float32, torch.device("cpu"))
        ours = run_mixer_pass(mixer, [(1, x[:21])]) + [run_mixer_pass(mixer, [(1, x[t:t + 1])])[0]
                                                       for t in range(21, 25)]
    torch.testing.assert_close(torch.cat(ours), torch.cat(ref), atol=1e-5, rtol=1e-4)


def test_a_mixer_carries_each_requests_state_across_passes():
    """Two sequences whole, and in pieces over five passes in other rows (chunks, single tokens
    batched as decodes): the same outputs."""
    torch.manual_seed(1)
    mixer = LightningAttention(24, LightningAttentionConfig(num_heads=3, head_dim=8, chunk_size=4), 1e-6)
    with torch.no_grad():
        for param in mixer.parameters():
            param.copy_(torch.randn(param.shape) * 0.3)
    mixer.set_layer(1, 4)
    check_mixer_carries_state(mixer, [torch.randn(13, 24), torch.randn(11, 24)])


def _as_released(config: dict) -> dict:
    """A transformers MiniMax config.json in the released remote code's keys (MiniMaxText01ForCausalLM)."""
    scales = {"layernorm_linear_attention_alpha": "linear_attn_alpha_factor",
              "layernorm_linear_attention_beta": "linear_attn_beta_factor",
              "layernorm_full_attention_alpha": "full_attn_alpha_factor",
              "layernorm_full_attention_beta": "full_attn_beta_factor",
              "layernorm_mlp_alpha": "mlp_alpha_factor", "layernorm_mlp_beta": "mlp_beta_factor"}
    released = {k: v for k, v in config.items() if k not in (*scales.values(), "layer_types", "rope_parameters")}
    return {**released, **{ours: config[theirs] for ours, theirs in scales.items()},
            "architectures": ["MiniMaxText01ForCausalLM"], "model_type": "minimax_text_01",
            "attn_type_list": [0 if kind == "linear_attention" else 1 for kind in config["layer_types"]],
            "rope_theta": config["rope_parameters"]["rope_theta"], "rotary_dim": config["head_dim"],
            "postnorm": True, "shared_intermediate_size": 0, "block": 256}


def test_a_checkpoint_in_the_released_layout_is_transformers_model(tmp_path):
    """The released remote code's config keys (attn_type_list, layernorm_*_alpha / _beta, rotary_dim,
    postnorm) read as transformers' MiniMax: its logits, over chunked prefills."""
    import json

    from tests.gpu_worker.utils import load_hf, make_runner, prefill_logits, save_tiny_model

    path = save_tiny_model(tmp_path, "minimax")
    hf = load_hf(path)
    config_file = path / "config.json"
    config_file.write_text(json.dumps(_as_released(json.loads(config_file.read_text()))))
    runner = make_runner(path, num_blocks=16, block_size=4)
    assert runner.config.architecture == "MiniMaxText01ForCausalLM"
    assert runner.config.minimax_residual_scales == (0.7, 1.2, 1.5, 0.9, 1.3, 1.1)
    prompt = [(7 * i + 3) % 256 for i in range(45)]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(prefill_logits(runner, prompt, [5, 2, 9, 0, 11, 3, 7, 8, 1, 4, 6, 10]), ref,
                               atol=1e-4, rtol=1e-4)


def test_the_released_layouts_rope_and_refusals():
    """MiniMax-Text-01's own config turns the first rotary_dim values of each head (vLLM's reading; 64 of
    128), and so does transformers' layout where it states a partial RoPE (transformers 5.25 turns whole
    heads whatever it states, the bug its MiniMax-M2 had: transformers#48241); the residual taken
    before the norms (postnorm false), shared experts and a window are refused."""
    from gpu_worker.config import ModelConfig

    layers = [0] * 7 + [1]
    text01 = {"architectures": ["MiniMaxText01ForCausalLM"], "hidden_size": 6144, "intermediate_size": 9216,
              "num_hidden_layers": 8, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
              "rotary_dim": 64, "rope_theta": 10000000, "vocab_size": 200064, "attn_type_list": layers,
              "num_local_experts": 32, "num_experts_per_tok": 2, "postnorm": True, "shared_intermediate_size": 0,
              "layernorm_full_attention_alpha": 3.5565588200778455, "layernorm_full_attention_beta": 1.0,
              "layernorm_linear_attention_alpha": 3.5565588200778455, "layernorm_linear_attention_beta": 1.0,
              "layernorm_mlp_alpha": 3.5565588200778455, "layernorm_mlp_beta": 1.0, "max_position_embeddings": 10240000}
    config = ModelConfig.from_dict(text01)
    assert config.rotary_dim == 64 and config.head_dim == 128 and config.rope_theta == 10000000
    assert config.mamba_layers == (True,) * 7 + (False,) and config.mamba == LightningAttentionConfig(64, 128)
    assert config.minimax_residual_scales == (3.5565588200778455, 1.0) * 3
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (32, 2, 9216)
    hf_layout = ModelConfig.from_dict({
        "architectures": ["MiniMaxForCausalLM"], "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}})
    assert hf_layout.rotary_dim == 8 and hf_layout.mamba_layers == (False, True)
    assert ModelConfig.from_dict({**hf_layout.raw, "rope_parameters": None, "rotary_dim": 4}).rotary_dim == 4
    # (transformers' defaults: a base of 1e6 where the rope parameters give none; a null KV head count is
    # the heads' count.)
    defaults = ModelConfig.from_dict({**hf_layout.raw, "num_key_value_heads": None,
                                      "rope_parameters": {"rope_type": "default"}})
    assert defaults.rope_theta == 1000000.0 and defaults.num_key_value_heads == 4 and defaults.rotary_dim == 16
    unstated = {k: v for k, v in text01.items() if k != "postnorm"}  # (the remote code's default: false)
    for released, refusal in [({**text01, "postnorm": False}, "postnorm false or unstated"),
                              (unstated, "postnorm false or unstated"),
                              ({**text01, "shared_intermediate_size": 512}, "shared experts"),
                              ({**text01, "sliding_window": 4096}, "sliding_window"),
                              ({**text01, "attn_type_list": [0] * 7 + [2]}, "0 .lightning. or 1"),
                              ({**text01, "attn_type_list": layers[:-1]}, "must name each of the 8 layers")]:
        with pytest.raises(ValueError, match=refusal):
            ModelConfig.from_dict(released)
