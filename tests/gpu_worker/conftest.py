from __future__ import annotations

from pathlib import Path

import pytest
from transformers import LlamaForCausalLM

from .tiny_gguf import tiny_llama, write_tiny_gguf


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Tests must never reach a hub or write into the real user cache.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("LLM_CLUSTER_CACHE_DIR", str(tmp_path / "default-cache"))


@pytest.fixture(scope="session")
def tiny_model() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, tiny_model: LlamaForCausalLM) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf", tiny_model)


@pytest.fixture(scope="module")
def tp_hosts(ray_cluster):
    """The module's pair of processes its two-rank tests start their ranks in (utils.WorkerHosts)."""
    from .utils import WorkerHosts

    hosts = WorkerHosts()
    yield hosts
    hosts.close()
