"""Checkpoint loading: sharded safetensors, tied heads, converter-style iterators, TP slicing."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_worker.config import ModelConfig
from gpu_worker.models import build_model
from gpu_worker.weights import LazyTensor, iter_safetensors, load_safetensors, load_weights, safetensors_files
from tests.gpu_worker.utils import load_hf, make_runner, prefill_logits, save_tiny_model


def hf_state(path) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in load_hf(path).state_dict().items()}


def test_sharded_checkpoint_loads_every_shard(tmp_path):
    path = tmp_path / "m"
    save_tiny_model(path, tie_word_embeddings=False)
    hf = load_hf(path)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    (tmp_path / "sharded" / "config.json").write_text((path / "config.json").read_text())
    assert len(safetensors_files(tmp_path / "sharded")) == len(set(index["weight_map"].values()))
    runner = make_runner(tmp_path / "sharded")
    prompt = list(range(1, 20))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(prefill_logits(runner, prompt, [0, 1, 2, 3, 4]), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("sharded", [False, True])
def test_a_pytorch_bin_checkpoint_loads_as_its_safetensors_do(tmp_path, sharded):
    """Older checkpoints (and the EAGLE authors' heads) are pytorch_model.bin files, or shards named
    by pytorch_model.bin.index.json: read memory-mapped as plain tensors, the same weights."""
    from gpu_worker.model_resolver import resolve_model
    from tests.tiny_model import build_tokenizer

    path = save_tiny_model(tmp_path / "m", tie_word_embeddings=False)
    tensors = load_file(path / "model.safetensors")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((path / "config.json").read_text())
    if sharded:
        names = sorted(tensors)
        shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
        for file, part in shards.items():
            torch.save({name: tensors[name] for name in part}, tmp_path / "bin" / file)
        (tmp_path / "bin" / "pytorch_model.bin.index.json").write_text(json.dumps(
            {"weight_map": {name: file for file, part in shards.items() for name in part}}))
    else:
        torch.save(tensors, tmp_path / "bin" / "pytorch_model.bin")
    build_tokenizer().save_pretrained(tmp_path / "bin")
    assert resolve_model(str(tmp_path / "bin")).model_dir == tmp_path / "bin"
    tokens = list(range(3, 40))
    expected = prefill_logits(make_runner(path), tokens, list(range(10)))
    assert torch.equal(prefill_logits(make_runner(tmp_path / "bin"), tokens, list(range(10))), expected)


def test_tied_checkpoint_without_lm_head(tmp_path):
    path = save_tiny_model(tmp_path, tie_word_embeddings=True)
    names = set(load_file(path / "model.safetensors"))
    assert "lm_head.weight" not in names
    model = build_model(ModelConfig.from_pretrained(path))
    load_safetensors(model, path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head.weight, load_file(path / "model.safetensors")["model.embed_tokens.weight"])


def test_converter_iterator_of_plain_tensors(tmp_path):
    """A GGUF converter hands over HF-named torch tensors and a config dict: same loader."""
    path = save_tiny_model(tmp_path)
    state = hf_state(path)
    config = ModelConfig.from_dict(json.loads((path / "config.json").read_text()))
    model = build_model(config)
    load_weights(model, iter(state.items()))
    q, _, v = model.model.layers[1].self_attn.qkv_proj.weight.split([64, 32, 32])
    torch.testing.assert_close(q, state["model.layers.1.self_attn.q_proj.weight"])
    torch.testing.assert_close(v, state["model.layers.1.self_attn.v_proj.weight"])
    _, up = model.model.layers[0].mlp.gate_up_proj.weight.chunk(2)
    torch.testing.assert_close(up, state["model.layers.0.mlp.up_proj.weight"])


def test_missing_and_unknown_tensors_raise(tmp_path):
    path = save_tiny_model(tmp_path)
    state = hf_state(path)
    config = ModelConfig.from_pretrained(path)
    missing = {k: v for k, v in state.items() if k != "model.layers.0.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match="qkv_proj"):
        load_weights(build_model(config), missing.items())
    with pytest.raises(KeyError, match="bogus"):
        load_weights(build_model(config), [*state.items(), ("model.bogus.weight", torch.zeros(1))])
    wrong = dict(state)
    wrong["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        load_weights(build_model(config), wrong.items())


def test_lazy_tensor_reads_only_the_requested_slice(tmp_path):
    t = torch.arange(24, dtype=torch.float32).view(6, 4)
    save_file({"w": t}, str(tmp_path / "x.safetensors"))
    [(name, lazy)] = list(iter_safetensors(tmp_path))
    assert name == "w" and isinstance(lazy, LazyTensor) and lazy.shape == (6, 4)
    torch.testing.assert_close(lazy.narrow(0, 2, 3), t[2:5])
    torch.testing.assert_close(lazy.narrow(1, 1, 2), t[:, 1:3])


def _rank_one_of_two(path):
    """The model as TP rank 1 of 2 builds and loads it from ``path`` (collectives are not needed)."""
    from gpu_worker import distributed

    old = distributed._group
    try:
        distributed._group = distributed.TPGroup(rank=1, world_size=2)
        model = build_model(ModelConfig.from_pretrained(path))
    finally:
        distributed._group = old
    load_safetensors(model, path)
    return model


def test_rank_shapes_from_tp_slicing(tmp_path):
    """A rank built with tp_size=2 loads half of every split weight from the same checkpoint."""
    path = save_tiny_model(tmp_path)
    state = hf_state(path)
    model = _rank_one_of_two(path)
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.shape == (32 + 16 + 16, 64)
    torch.testing.assert_close(layer.mlp.down_proj.weight, state["model.layers.0.mlp.down_proj.weight"][:, 64:])
    torch.testing.assert_close(layer.self_attn.o_proj.weight, state["model.layers.0.self_attn.o_proj.weight"][:, 32:])
    torch.testing.assert_close(model.model.embed_tokens.weight, state["model.embed_tokens.weight"][128:])


def test_qwen3_head_norms_are_whole_on_every_rank(tmp_path):
    """Qwen3's q/k norms weigh each head's head_dim values: a TP rank holds fewer heads, not a part
    of the norm, so every rank loads the whole weight."""
    path = save_tiny_model(tmp_path, "qwen3", head_dim=32)
    state = hf_state(path)
    model = _rank_one_of_two(path)
    attention = model.model.layers[1].self_attn
    assert (attention.num_heads, attention.num_kv_heads, attention.head_dim) == (2, 1, 32)
    for name in ("q_norm", "k_norm"):
        torch.testing.assert_close(getattr(attention, name).weight, state[f"model.layers.1.self_attn.{name}.weight"])
    assert not torch.equal(attention.q_norm.weight, attention.k_norm.weight)


def test_phi3_fused_checkpoint_tensors_are_split_per_rank(tmp_path):
    """Phi-3 stores q/k/v (and gate/up) as one tensor: each TP rank gets its heads of each part."""
    path = save_tiny_model(tmp_path, "phi3")
    state = hf_state(path)
    assert "model.layers.0.self_attn.qkv_proj.weight" in state and "model.layers.0.mlp.gate_up_proj.weight" in state
    model = _rank_one_of_two(path)
    layer = model.model.layers[0]
    fused = state["model.layers.0.self_attn.qkv_proj.weight"]  # [q (4 heads x 16); k (2 x 16); v (2 x 16)]
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight,
                               torch.cat([fused[32:64], fused[64 + 16:96], fused[96 + 16:128]]))
    gate_up = state["model.layers.0.mlp.gate_up_proj.weight"]  # [gate (128); up (128)]
    torch.testing.assert_close(layer.mlp.gate_up_proj.weight, torch.cat([gate_up[64:128], gate_up[192:256]]))


def test_moe_experts_are_stacked_and_split_per_rank(tmp_path):
    """Each expert's gate/up/down land in the stacked parameters; a TP rank holds its half of every
    expert's intermediate dimension (and of the shared expert's); the routers are whole."""
    path = save_tiny_model(tmp_path, "qwen2_moe")
    state = load_file(str(path / "model.safetensors"))  # per-expert tensors, as checkpoints store them
    model = _rank_one_of_two(path)
    block = model.model.layers[1].mlp
    prefix = "model.layers.1.mlp"
    for e in (0, 5):
        torch.testing.assert_close(block.experts.w13_weight[e],
                                   torch.cat([state[f"{prefix}.experts.{e}.gate_proj.weight"][16:],
                                              state[f"{prefix}.experts.{e}.up_proj.weight"][16:]]))
        torch.testing.assert_close(block.experts.w2_weight[e], state[f"{prefix}.experts.{e}.down_proj.weight"][:, 16:])
    torch.testing.assert_close(block.shared_expert.down_proj.weight,
                               state[f"{prefix}.shared_expert.down_proj.weight"][:, 24:])
    torch.testing.assert_close(block.gate.weight, state[f"{prefix}.gate.weight"])
    torch.testing.assert_close(block.shared_expert_gate.weight, state[f"{prefix}.shared_expert_gate.weight"])


def test_a_missing_or_extra_expert_is_refused(tmp_path):
    path = save_tiny_model(tmp_path, "qwen3_moe")
    state = load_file(str(path / "model.safetensors"))
    config = ModelConfig.from_pretrained(path)
    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.experts.5.up_proj.weight"}
    with pytest.raises(ValueError, match=r"did not provide: \['model.layers.1.mlp.experts.w13_weight'\]"):
        load_weights(build_model(config), missing.items())
    extra = {**state, "model.layers.0.mlp.experts.8.down_proj.weight": torch.zeros(64, 32)}
    with pytest.raises(ValueError, match="expert 8 is out of range"):
        load_weights(build_model(config), extra.items())


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_a_checkpoint_with_stacked_experts_loads_as_the_per_expert_one(tmp_path, kind):
    """transformers 5 can also write every expert of a layer as one tensor (gate_up_proj
    [experts, 2 * intermediate, hidden], down_proj [experts, hidden, intermediate]): a TP rank
    reads its slice of those and ends up with exactly the parameters the per-expert files give."""
    from transformers import AutoModelForCausalLM

    per_expert = save_tiny_model(tmp_path / "per_expert", kind)
    stacked = tmp_path / "stacked"
    AutoModelForCausalLM.from_pretrained(per_expert, dtype=torch.float32).save_pretrained(
        stacked, save_original_format=False)
    names = set(load_file(str(stacked / "model.safetensors")))
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and not any(".experts.0." in n for n in names)
    ours, reference = _rank_one_of_two(stacked), _rank_one_of_two(per_expert)
    reference_params = dict(reference.named_parameters())
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param, reference_params[name], rtol=0, atol=0, msg=name)
    truncated = {n: t[:, :-2] if n.endswith("experts.gate_up_proj") else t
                 for n, t in load_file(str(stacked / "model.safetensors")).items()}
    with pytest.raises(ValueError, match="gate_up_proj: the checkpoint's dimension 1 is"):
        load_weights(build_model(ModelConfig.from_pretrained(stacked)), truncated.items())
