"""NVIDIA Nemotron-H GGUF files (nemotron_h) converted back to checkpoints that give the source
model's logits, in transformers and in our runner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import AutoModelForCausalLM

from gpu_worker.gguf_loader import ensure_converted

from .tiny_hybrid_gguf import tiny_nemotron_h, write_tiny_nemotron_h_gguf
from .utils import make_runner, prefill_logits

PROMPT_IDS = torch.tensor([[1, 120, 118, 263, 13, 107, 108, 261, 117, 104, 2, 13]])


@pytest.mark.parametrize("quant", [GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0], ids=["f32", "q8_0"])
def test_nemotron_h_files_convert_to_the_source_model(tmp_path: Path, quant: GGMLQuantizationType) -> None:
    """The block pattern comes back from the per-layer KV heads and MLP widths, the Mamba-2 tensors
    from llama.cpp's reshapes, the attention's q/k rows un-permuted: every tensor is the source's
    (exactly in F32, within Q8_0's rounding), and so are the logits, in transformers and in our
    runner (exactly transformers')."""
    source = tiny_nemotron_h(seed=6)
    model_dir = ensure_converted(write_tiny_nemotron_h_gguf(tmp_path / "tiny-nemotron-h.gguf", source, quant),
                                 tmp_path / "cache")
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["NemotronHForCausalLM"]
    assert {key: config[key] for key in ("hybrid_override_pattern", "intermediate_size", "head_dim",
                                         "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size",
                                         "use_conv_bias")} == {
        "hybrid_override_pattern": "M-*M-M", "intermediate_size": 32, "head_dim": 24, "mamba_num_heads": 8,
        "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16, "use_conv_bias": True}
    loaded = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert type(loaded) is type(source)
    ours, theirs = loaded.state_dict(), source.state_dict()
    assert ours.keys() == theirs.keys()
    exact = quant == GGMLQuantizationType.F32
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-6 if exact else 1e-5, atol=1e-6 if exact else 0.02,
                                   msg=name)
    with torch.no_grad():
        expected, logits = source(PROMPT_IDS).logits, loaded(PROMPT_IDS).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4 if exact else 0.05)
    runner = make_runner(model_dir, num_blocks=8, block_size=4)
    torch.testing.assert_close(prefill_logits(runner, PROMPT_IDS[0].tolist(), [3, 1, 0]), logits[0], rtol=1e-4,
                               atol=1e-4)
