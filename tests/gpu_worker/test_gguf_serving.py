"""Serving a GGUF: what an engine hands its workers, and the dtype it is converted at."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from engine_core.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from gpu_worker import worker
from gpu_worker.config import ModelConfig
from gpu_worker.executor import create_executor
from gpu_worker.gguf_loader import CACHE_ENV_VAR
from gpu_worker.model_resolver import local_model_dir, resolve_model

from .utils import prefill_logits

PROMPT = [1, 120, 118, 263, 13, 107, 108, 261, 117, 104, 2, 13]


class _WorkerStarted(Exception):
    def __init__(self, kwargs: dict[str, Any]) -> None:
        super().__init__("worker started")
        self.kwargs = kwargs


def engine_worker_kwargs(config: EngineConfig, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The arguments the engine's executor gives its (rank 0) worker, caught as the worker starts."""

    def catch(**kwargs: Any) -> None:
        raise _WorkerStarted(kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(worker, "Worker", catch)
        with pytest.raises(_WorkerStarted) as started:
            create_executor(config)
    kwargs = dict(started.value.kwargs)
    del kwargs["rank"], kwargs["world_size"]
    return kwargs


def _engine_config(model: Path, **kwargs: Any) -> EngineConfig:
    return EngineConfig(model=str(model), device="cpu", num_gpu_blocks=16,
                        scheduler=SchedulerConfig(max_model_len=None), **kwargs)


def test_a_worker_on_another_node_converts_the_gguf_itself(
    tiny_gguf: Path, tiny_model: LlamaForCausalLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TP rank on another node than the engine's cannot read the engine's conversion: it
    converts the GGUF (and the draft model's) into its own node's cache."""
    engine_node, other_node = tmp_path / "engine-node-cache", tmp_path / "other-node-cache"
    monkeypatch.setenv(CACHE_ENV_VAR, str(engine_node))
    spec = SpeculativeConfig(method="draft_model", model=str(tiny_gguf), num_speculative_tokens=2)
    kwargs = engine_worker_kwargs(_engine_config(tiny_gguf, speculative_config=spec), monkeypatch)
    assert any(engine_node.iterdir())  # (the engine converted it on its node)

    shutil.rmtree(engine_node)  # (the other node has none of the engine node's files)
    monkeypatch.setenv(CACHE_ENV_VAR, str(other_node))
    rank = worker.Worker(rank=0, world_size=1, **kwargs)
    rank.load_model()
    assert rank.model_dir.parent == other_node and rank.draft_model_dir.parent == other_node
    rank.initialize_cache(8, 4)
    with torch.no_grad():
        expected = tiny_model(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(prefill_logits(rank.runner, PROMPT, [3, 1, 0]), expected, rtol=1e-4, atol=1e-4)


def _converted(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if not p.name.startswith("."))


def _tensor_dtypes(model_dir: Path) -> set[torch.dtype]:
    return {tensor.dtype for shard in model_dir.glob("*.safetensors") for tensor in load_file(shard).values()}


def test_an_explicit_dtype_converts_the_gguf_at_that_dtype(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--dtype bfloat16: the cache holds the bfloat16 weights the workers serve (no float32 copy,
    halved at every load), converted once for the engine and its worker."""
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "cache"))
    executor = create_executor(_engine_config(tiny_gguf, dtype="bfloat16"))
    try:
        assert executor.worker.dtype == torch.bfloat16
        [model_dir] = _converted(tmp_path / "cache")
        assert executor.worker.model_dir == model_dir == executor.model_dir
        assert _tensor_dtypes(model_dir) == {torch.bfloat16}
        assert json.loads((model_dir / "config.json").read_text())["torch_dtype"] == "bfloat16"
    finally:
        executor.shutdown()


@pytest.mark.parametrize(("dtype", "device", "runner", "expected"), [
    ("auto", "cuda", "generate", torch.bfloat16),  # (a checkpoint stating no dtype: vLLM's bfloat16 on a GPU)
    ("auto", "cuda", "pooling", torch.float16),  # (and float16 for an embedding model)
    ("float16", "cpu", "generate", torch.float16),
])
def test_the_gguf_is_converted_at_the_dtype_the_workers_serve(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str, device: str, runner: str,
    expected: torch.dtype
) -> None:
    # (conftest keeps auto at float32 on a GPU for the other tests; the rule itself is tested here.)
    monkeypatch.setattr(worker, "resolve_dtype", getattr(worker.resolve_dtype, "__wrapped__", worker.resolve_dtype))
    rule = worker.gguf_dtype_rule(dtype, torch.device(device), embedding_only=runner == "pooling")
    model_dir = resolve_model(str(tiny_gguf), cache_dir=tmp_path, dtype=rule).model_dir
    assert _tensor_dtypes(model_dir) == {expected}
    # What a worker then resolves for the converted directory: the same dtype, from the same conversion.
    config = ModelConfig.from_pretrained(model_dir)
    assert worker.resolve_dtype(dtype, config, torch.device(device), pooling=runner == "pooling") == expected
    assert local_model_dir(str(tiny_gguf), cache_dir=tmp_path, dtype=rule) == model_dir
