"""IBM Granite GGUF files (granite, granitemoe, granitehybrid) converted back to checkpoints that give
the source model's logits, in transformers and in our runner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import AutoModelForCausalLM

from gpu_worker.gguf_loader import ensure_converted, load_gguf

from .tiny_hybrid_gguf import GRANITE_KINDS, tiny_granite, write_tiny_granite_gguf
from .utils import make_runner, prefill_logits

PROMPT_IDS = torch.tensor([[1, 120, 118, 263, 13, 107, 108, 261, 117, 104, 2, 13]])
# Per kind: the converted config's architecture and the keys it must hold (beside the multipliers).
_EXPECTED = {
    "granite": ("GraniteForCausalLM", {"tie_word_embeddings": False}),
    "granitemoeshared": ("GraniteMoeSharedForCausalLM", {"num_local_experts": 8, "num_experts_per_tok": 2,
                                                         "intermediate_size": 32, "shared_intermediate_size": 64}),
    "granitehybrid": ("GraniteMoeHybridForCausalLM", {
        "layer_types": ["mamba", "attention", "mamba"], "position_embedding_type": "nope", "num_local_experts": 8,
        "shared_intermediate_size": 64, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 2,
        "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_conv_bias": True,
        "tie_word_embeddings": True}),
    "granitehybrid_dense": ("GraniteMoeHybridForCausalLM", {"num_local_experts": 0, "shared_intermediate_size": 64}),
    # (granite-4.0-micro: its file says "granite"; the shared MLP's width from its tensors, not the
    # feed_forward_length of 32 the file states)
    "granite4_micro": ("GraniteForCausalLM", {"intermediate_size": 64, "head_dim": 16}),
}


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(PROMPT_IDS).logits


@pytest.mark.parametrize("kind", GRANITE_KINDS)
def test_granite_files_convert_to_the_source_model(tmp_path: Path, kind: str) -> None:
    """llama.cpp's Granite converters write the multipliers as *_scale keys, split the merged
    gate-and-up tensors, and (Granite 4.0-H) reshape the Mamba-2 tensors and mark the layer kinds by
    their KV heads: undone, every tensor is the source's again. Q8_0 weights: the source's logits
    within quantisation, in transformers, and exactly transformers' in our runner."""
    source = tiny_granite(kind, seed=3)
    model_dir = ensure_converted(write_tiny_granite_gguf(tmp_path / f"tiny-{kind}.Q8_0.gguf", source, kind,
                                                         GGMLQuantizationType.Q8_0), tmp_path / "cache")
    config = json.loads((model_dir / "config.json").read_text())
    architecture, expected = _EXPECTED[kind]
    assert config["architectures"] == [architecture]
    assert {key: config[key] for key in expected} == expected
    assert "num_experts" not in config  # (Granite's experts are num_local_experts alone)
    assert (config["embedding_multiplier"], config["attention_multiplier"], config["residual_multiplier"],
            config["logits_scaling"]) == (3.0, pytest.approx(0.2), 0.5, 2.0)
    loaded = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert type(loaded).__name__ == architecture
    if kind != "granite4_micro":  # (served as plain Granite: its shared MLP is Granite's MLP)
        ours, theirs = loaded.state_dict(), source.state_dict()
        assert ours.keys() == theirs.keys()
        for name, tensor in theirs.items():  # (quantised matrices within Q8_0's rounding; the F32 ones exact)
            torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=0.02, msg=name)
    torch.testing.assert_close(_logits(loaded), _logits(source), rtol=0, atol=0.05)
    runner = make_runner(model_dir, num_blocks=8, block_size=4)
    torch.testing.assert_close(prefill_logits(runner, PROMPT_IDS[0].tolist(), [3, 1, 0]), _logits(loaded)[0],
                               rtol=1e-4, atol=1e-4)


def test_granite_f32_ssm_tensors_come_back_exactly(tmp_path: Path) -> None:
    """A_log (written as -exp(A_log)), D, dt_bias, the convolution and the grouped norm keep F32 in
    llama.cpp's files: back to the source's values, in shape and to float rounding."""
    source = tiny_granite("granitehybrid", seed=4)
    _, tensors = load_gguf(write_tiny_granite_gguf(tmp_path / "tiny.gguf", source, "granitehybrid"))
    converted = dict(tensors)
    for suffix in ("A_log", "D", "dt_bias", "conv1d.weight", "conv1d.bias", "norm.weight"):
        name = f"model.layers.2.mamba.{suffix}"
        torch.testing.assert_close(converted[name], source.state_dict()[name], rtol=1e-6, atol=1e-6, msg=name)


def test_bamba_files_are_refused(tmp_path: Path) -> None:
    """A granitehybrid file whose attention rotates (Bamba's) is not converted: said, with the way out."""
    source = tiny_granite("granitehybrid_dense", seed=5)
    path = write_tiny_granite_gguf(tmp_path / "bamba.gguf", source, "granitehybrid_dense", rope=True)
    with pytest.raises(ValueError, match=r"Bamba files .*Hugging Face checkpoint"):
        load_gguf(path)
