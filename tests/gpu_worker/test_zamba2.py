"""Zamba2: its shared blocks, per-use adapters and caches, the checkpoint layouts it reads, its config."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_worker.config import ModelConfig
from gpu_worker.models.zamba2 import Zamba2HybridLayer
from tests.gpu_worker.utils import load_hf, make_runner, prefill_logits, save_tiny_model

PROMPT = [(5 * i + 2) % 256 for i in range(30)]


def test_hybrid_layers_take_the_shared_blocks_in_turn_each_with_its_own_cache_and_adapters(tmp_path):
    """Layers 1, 3 and 4 are hybrid with two blocks: 1 and 4 run block 0, 3 runs block 1; each keeps
    its own KV cache and adapters, every layer a Mamba-2 state."""
    runner = make_runner(save_tiny_model(tmp_path, "zamba2"), num_blocks=16)
    model, config = runner.model, runner.model.config
    assert config.shared_attention_layers == (1, 3, 4) and config.num_attention_layers == 3
    assert config.head_dim == 32 and config.num_key_value_heads == 4 and config.attention_scale == 16 ** -0.5
    layers, blocks = model.model.layers, model.model.blocks
    assert len(blocks) == 2
    assert [layers[i]._block[0] for i in (1, 3, 4)] == [blocks[0], blocks[1], blocks[0]]
    assert len(model.attention_layers()) == 3 and len(model.mamba_layers()) == 5
    assert len({id(layer.attn) for layer in layers if isinstance(layer, Zamba2HybridLayer)}) == 3
    # Uses 0 and 2 of block 0 read different adapters.
    assert not torch.equal(layers[1].q_adapter.a.weight, layers[4].q_adapter.a.weight)
    # The blocks' weights are counted once.
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    assert sum(".qkv_proj." in name for name in names) == 2


def test_a_checkpoint_storing_a_block_under_each_of_its_layers_loads_as_one_storing_it_once(tmp_path):
    """transformers saves a tied block under the first layer that runs it; a checkpoint may hold a copy
    under every layer (block and adapters): equal copies load as the single one does, a copy that
    differs (here one use's adapter) is refused."""
    path = save_tiny_model(tmp_path, "zamba2")
    tensors = load_file(path / "model.safetensors")
    assert not any(name.startswith("model.layers.4.shared_transformer.") for name in tensors)
    expected = prefill_logits(make_runner(path, num_blocks=16), PROMPT, list(range(8)))
    for name in [n for n in tensors if n.startswith("model.layers.1.shared_transformer.")]:
        tensors[name.replace("layers.1.", "layers.4.")] = tensors[name].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    torch.testing.assert_close(prefill_logits(make_runner(path, num_blocks=16), PROMPT, list(range(8))), expected)
    tensors["model.layers.4.shared_transformer.self_attn.linear_v_adapter_list.2.1.weight"] += 0.01
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"under layers 1 and 4 \(self_attn.linear_v_adapter_list.2.1.weight\)"):
        make_runner(path, num_blocks=16)


def test_a_bare_decoders_checkpoint_and_spare_blocks(tmp_path):
    """Names saved without "model." (a bare Zamba2Model) load; more blocks than hybrid layers build
    only the blocks some layer runs (transformers builds no others), as transformers computes."""
    path = save_tiny_model(tmp_path, "zamba2", num_mem_blocks=4)
    runner = make_runner(path, num_blocks=16)
    assert len(runner.model.model.blocks) == 3
    logits = prefill_logits(runner, PROMPT, list(range(8)))
    with torch.no_grad():
        torch.testing.assert_close(logits, load_hf(path)(torch.tensor([PROMPT])).logits[0], atol=1e-4, rtol=1e-4)
    tensors = load_file(path / "model.safetensors")
    save_file({name.removeprefix("model."): tensor for name, tensor in tensors.items()}, path / "model.safetensors",
              metadata={"format": "pt"})
    torch.testing.assert_close(prefill_logits(make_runner(path, num_blocks=16), PROMPT, list(range(8))), logits)


def test_a_checkpoint_whose_copies_of_a_block_differ_is_refused(tmp_path):
    """With tie_word_embeddings false transformers neither ties nor shares the blocks (each hybrid layer
    runs its own): such a checkpoint is refused by name, not served with one copy."""
    path = save_tiny_model(tmp_path, "zamba2", tie_word_embeddings=False)
    hf = load_hf(path)
    assert not torch.equal(hf.model.layers[1].shared_transformer.self_attn.q_proj.weight,
                           hf.model.layers[4].shared_transformer.self_attn.q_proj.weight)
    with pytest.raises(ValueError, match="different weights for a shared block under layers 1 and 4"):
        make_runner(path, num_blocks=16)


BASE = {"architectures": ["Zamba2ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 256,
        "layers_block_type": ["mamba", "hybrid", "mamba"], "n_mamba_heads": 8}


def test_the_config_is_read_as_transformers_derives_it():
    """The attention's width and heads from hidden_size whatever the file says, the MLP's width 4 x
    hidden where null, the mixers' head width, transformers' defaults, use_long_context's length;
    legacy and transformers 5 layer kinds alike."""
    config = ModelConfig.from_dict({**BASE, "attention_head_dim": 7, "mamba_headdim": 3, "intermediate_size": None})
    assert config.head_dim == 32 and config.intermediate_size == 256 and config.num_hidden_layers == 3
    assert config.mamba.head_dim == 16 and config.mamba.num_heads == 8 and config.mamba.state_size == 64
    assert config.mamba_layers == (True,) * 3 and config.shared_attention_layers == (1,)
    assert config.tie_word_embeddings and config.max_position_embeddings == 4096 and config.hidden_act == "gelu"
    assert config.rope_layers == (False,) * 3
    # (The convolution's bias whatever use_conv_bias says, as transformers' mixer has it.)
    assert ModelConfig.from_dict({**BASE, "use_conv_bias": False}).mamba.conv_bias
    renamed = ModelConfig.from_dict({**BASE, "layers_block_type": ["linear_attention", "hybrid", "linear_attention"],
                                     "use_mem_rope": True, "use_long_context": True})
    assert renamed.shared_attention_layers == (1,) and renamed.rope_layers == (True,) * 3
    assert renamed.max_position_embeddings == 16384


@pytest.mark.parametrize("change, refusal", [
    ({"num_key_value_heads": 2}, "multi-head"),
    ({"layers_block_type": ["mamba", "attention", "mamba"]}, "'mamba' or 'hybrid'"),
    ({"num_attention_heads": 5}, "must split into num_attention_heads"),
    ({"n_mamba_heads": 7}, "must divide"),
])
def test_configs_it_cannot_serve_are_refused(change, refusal):
    with pytest.raises(ValueError, match=refusal):
        ModelConfig.from_dict({**BASE, **change})
