"""TII Falcon-H1 GGUF files (falcon-h1) converted back to checkpoints that give the source model's
logits, in transformers and in our runner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import AutoModelForCausalLM

from gpu_worker.gguf_loader import ensure_converted

from .tiny_hybrid_gguf import tiny_falcon_h1, write_tiny_falcon_h1_gguf
from .utils import make_runner, prefill_logits

PROMPT_IDS = torch.tensor([[1, 120, 118, 263, 13, 107, 108, 261, 117, 104, 2, 13]])


@pytest.mark.parametrize("rms_norm, quant", [(False, GGMLQuantizationType.Q8_0), (True, GGMLQuantizationType.F32)],
                         ids=["q8_0", "gated_norm_f32"])
def test_falcon_h1_files_convert_to_the_source_model(tmp_path: Path, rms_norm: bool,
                                                     quant: GGMLQuantizationType) -> None:
    """llama.cpp folds Falcon-H1's muP multipliers into the weights: the converted checkpoint states
    them as 1 and gives the source's logits (the multipliers applied), in transformers and in our
    runner (exactly transformers'); its Mamba-2 geometry and gated norm come back from the file."""
    source = tiny_falcon_h1(seed=7, rms_norm=rms_norm)
    model_dir = ensure_converted(write_tiny_falcon_h1_gguf(tmp_path / "tiny-falcon-h1.gguf", source, quant),
                                 tmp_path / "cache")
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["FalconH1ForCausalLM"]
    assert {key: config[key] for key in ("mamba_d_ssm", "mamba_n_heads", "mamba_d_head", "mamba_n_groups",
                                         "mamba_d_state", "mamba_rms_norm", "head_dim", "embedding_multiplier",
                                         "ssm_multipliers")} == {
        "mamba_d_ssm": 64, "mamba_n_heads": 8, "mamba_d_head": 8, "mamba_n_groups": 2, "mamba_d_state": 16,
        "mamba_rms_norm": rms_norm, "head_dim": 16, "embedding_multiplier": 1.0, "ssm_multipliers": [1.0] * 5}
    loaded = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert type(loaded) is type(source)
    with torch.no_grad():
        expected, logits = source(PROMPT_IDS).logits, loaded(PROMPT_IDS).logits
    exact = quant == GGMLQuantizationType.F32
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4 if exact else 0.05)
    runner = make_runner(model_dir, num_blocks=8, block_size=4)
    torch.testing.assert_close(prefill_logits(runner, PROMPT_IDS[0].tolist(), [3, 1, 0]), logits[0], rtol=1e-4,
                               atol=1e-4)
