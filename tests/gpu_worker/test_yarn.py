"""YaRN rope scaling (Qwen2.5 / Qwen3 long context): the same logits as transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_worker.config import ModelConfig
from tests.gpu_worker.utils import load_hf, make_config, make_runner, prefill_logits, save_tiny_model

# A pretrained length of 64 stretched 4 times: a 200-token prompt runs far past it.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize(("kind", "rope"), [
    ("qwen2", YARN),
    ("llama", YARN),
    ("qwen3", {**YARN, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False}),
    ("llama", {**YARN, "attention_factor": 0.8}),
    ("llama", {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0}),  # (DeepSeek's attention factor)
])
def test_yarn_logits_match_transformers(tmp_path: Path, kind: str, rope: dict) -> None:
    path = save_tiny_model(tmp_path / kind, kind, max_position_embeddings=256, rope_parameters=rope)
    config = ModelConfig.from_pretrained(path)
    assert config.rope_scaling["rope_type"] == "yarn" and config.max_context_len == 256
    prompt = torch.randint(3, 256, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        expected = load_hf(path)(torch.tensor([prompt])).logits[0]
    ours = prefill_logits(make_runner(path, num_blocks=64, block_size=4), prompt, list(range(50)))
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)


def test_qwen_long_context_configs_serve_the_extended_length() -> None:
    """Qwen2.5's documented YaRN block (transformers 4 layout): 32768 positions stretched 4 times,
    the length vLLM derives (original_max_position_embeddings * factor)."""
    qwen = {**make_config("qwen2", max_position_embeddings=32768).to_dict(), "architectures": ["Qwen2ForCausalLM"]}
    qwen.pop("rope_parameters", None)
    qwen["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    config = ModelConfig.from_dict(qwen)
    assert config.max_context_len == 131072
    assert config.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    # (A factor left out is max_position_embeddings over the pretrained length, as transformers reads it.)
    qwen3 = {**qwen, "max_position_embeddings": 131072, "rope_scaling": {"rope_type": "yarn",
                                                                          "original_max_position_embeddings": 32768}}
    assert ModelConfig.from_dict(qwen3).rope_scaling["factor"] == 4.0
    with pytest.raises(ValueError, match="rope_type 'yarn' needs original_max_position_embeddings"):
        ModelConfig.from_dict({**qwen, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
