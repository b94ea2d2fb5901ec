"""Gemma 2 and 3 never run in float16 (vLLM's _FLOAT16_NOT_SUPPORTED_MODELS): "auto" picks another
dtype for them and an explicit float16 is refused, before any worker starts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_core.config import EngineConfig, SchedulerConfig
from gpu_worker import worker
from gpu_worker.config import ModelConfig
from gpu_worker.executor import create_executor
from tests.gpu_worker.utils import make_config
from tests.tiny_model import build_tiny_gemma2

# (conftest wraps resolve_dtype on a GPU so that tests keep float32: the rule itself is tested here.)
resolve_dtype = getattr(worker.resolve_dtype, "__wrapped__", worker.resolve_dtype)
CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def _config(kind: str, dtype: torch.dtype | None, **overrides) -> ModelConfig:
    architecture = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "llama": "LlamaForCausalLM"}[kind]
    raw = {**make_config(kind).to_dict(), "architectures": [architecture], **overrides}
    return dataclasses.replace(ModelConfig.from_dict(raw), dtype=dtype)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
@pytest.mark.parametrize("checkpoint", [torch.float32, None, torch.float16])
def test_auto_never_picks_float16_for_gemma_2_and_3(kind: str, checkpoint: torch.dtype | None) -> None:
    model = _config(kind, checkpoint)
    assert resolve_dtype("auto", model, CUDA) == torch.bfloat16
    assert resolve_dtype("auto", model, CUDA, pooling=True) == torch.bfloat16
    assert resolve_dtype("auto", model, CPU) == torch.float32


def test_an_fp32_embedding_gemma_runs_in_bfloat16_on_a_gpu() -> None:
    """EmbeddingGemma (Gemma 3 attending both ways, served for embeddings): vLLM's pooling
    preference for float16 does not apply to it."""
    embedder = _config("gemma3", torch.float32, architectures=["Gemma3TextModel"], use_bidirectional_attention=True)
    assert embedder.encoder_only
    assert resolve_dtype("auto", embedder, CUDA, pooling=True) == torch.bfloat16
    # (Other embedding models keep vLLM's float16.)
    assert resolve_dtype("auto", _config("llama", torch.float32), CUDA, pooling=True) == torch.float16


def test_without_bfloat16_gemma_2_falls_back_to_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    assert resolve_dtype("auto", _config("gemma2", torch.float32), CUDA) == torch.float32
    assert resolve_dtype("auto", _config("gemma2", torch.float16), CUDA) == torch.float32
    assert resolve_dtype("auto", _config("llama", torch.float32), CUDA) == torch.float16


@pytest.mark.parametrize("name", ["float16", "half", "fp16", torch.float16])
def test_explicit_float16_is_refused_for_gemma_2_and_3(name: str | torch.dtype) -> None:
    for kind in ("gemma2", "gemma3"):
        with pytest.raises(ValueError, match=r"does not support float16. Reason: Numerical instability"):
            resolve_dtype(name, _config(kind, torch.bfloat16), CPU)
    assert resolve_dtype(name, _config("llama", torch.bfloat16), CPU) == torch.float16
    assert resolve_dtype("bfloat16", _config("gemma2", torch.float32), CPU) == torch.bfloat16


def test_explicit_float16_gemma_2_is_refused_before_workers_start(tmp_path, monkeypatch) -> None:
    path = build_tiny_gemma2(tmp_path)

    def no_worker(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(worker, "Worker", no_worker)
    with pytest.raises(ValueError, match=r"engine 0: The model type 'gemma2' does not support float16"):
        create_executor(EngineConfig(model=str(path), dtype="float16", device="cpu", num_gpu_blocks=16,
                                     scheduler=SchedulerConfig(max_model_len=None)))
