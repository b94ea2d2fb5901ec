"""Mamba, Falcon-Mamba (mamba) and Mamba-2 (mamba2) GGUF files converted back to checkpoints that give the
source model's logits, in transformers and in our runner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from gpu_worker.gguf_loader import ensure_converted

from .tiny_hybrid_gguf import tiny_mamba, write_tiny_mamba_gguf
from .utils import make_runner, prefill_logits

PROMPT_IDS = torch.tensor([[1, 120, 118, 263, 13, 107, 108, 261, 117, 104, 2, 13]])


# Per kind: the geometry the converted config must state.
_GEOMETRY = {"mamba": {"intermediate_size": 128, "state_size": 16, "conv_kernel": 4, "time_step_rank": 4},
             "falcon_mamba": {"intermediate_size": 128, "state_size": 16, "conv_kernel": 4, "time_step_rank": 4},
             "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 2, "state_size": 16, "conv_kernel": 4}}


@pytest.mark.parametrize("kind, tied", [("mamba", True), ("falcon_mamba", False), ("mamba2", False)],
                         ids=["mamba_tied", "falcon_mamba", "mamba2"])
def test_mamba_files_convert_to_the_source_model(tmp_path: Path, kind: str, tied: bool) -> None:
    """A from -exp(A_log), the squeezed convolution, dt's rank and Falcon-Mamba's dt/B/C norms come
    back from the file; the converted checkpoint states no length (the file's 2^20 is a placeholder);
    its logits are the source's, in transformers and in our runner (exactly transformers'). (F32: the
    quantised path is the other GGUF tests'; these tiny mixers' large random dt weights amplify
    Q8_0's rounding past any tolerance that would still mean something.)"""
    source = tiny_mamba(kind, seed=8, tied=tied)
    model_dir = ensure_converted(write_tiny_mamba_gguf(tmp_path / f"tiny-{kind}.gguf", source), tmp_path / "cache")
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == [type(source).__name__]
    expected = {**_GEOMETRY[kind], "use_conv_bias": True, "tie_word_embeddings": tied}
    assert {key: config[key] for key in expected} == expected
    assert "max_position_embeddings" not in config
    loaded = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert type(loaded) is type(source)
    with torch.no_grad():
        expected, logits = source(PROMPT_IDS).logits, loaded(PROMPT_IDS).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)
    runner = make_runner(model_dir, num_blocks=8, block_size=4)
    torch.testing.assert_close(prefill_logits(runner, PROMPT_IDS[0].tolist(), [3, 1, 0]), logits[0], rtol=1e-4,
                               atol=1e-4)
