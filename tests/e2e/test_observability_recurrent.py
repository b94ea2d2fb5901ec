"""The recurrent-layer prefix cache's panel of the dashboard against a real Prometheus: a Granite
4.0-H engine under --mamba-cache-mode align with few slots, fed prompts seen again (their states
restored) and bursts of new ones (kept states evicted)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from cluster.config import ClusterConfig, EngineSpec
from tests.e2e.prometheus import assert_query_has_data, require_prometheus, scraping
from tests.e2e.test_observability import dashboard_queries
from tests.gpu_worker.utils import save_tiny_model
from tests.serve_cluster import serve_cluster
from tests.tiny_model import build_tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def observed(ray_cluster, tmp_path_factory):
    require_prometheus()
    tokenizer = build_tokenizer()
    model_dir = save_tiny_model(tmp_path_factory.mktemp("granite_hybrid"), "granitemoehybrid",
                                vocab_size=len(tokenizer))
    tokenizer.save_pretrained(model_dir)
    config = ClusterConfig(model=str(model_dir), served_model_name="hybrid",
                           defaults=EngineSpec(num_gpu_blocks=64, max_model_len=256, block_size=4,
                                               mamba_cache_mode="align", mamba_prefix_cache_slots=6))
    body = {"model": "hybrid", "max_tokens": 2, "temperature": 0, "ignore_eos": True}

    def send(prompts: list[str]) -> None:
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda p: httpx.post(f"{served.base}/v1/completions", timeout=60,
                                                       json=body | {"prompt": p}).status_code, prompts))
        assert set(codes) == {200}

    with serve_cluster(config) as served:
        httpx.get(f"{served.base}/metrics", timeout=60)
        with scraping(served.base) as prom:
            # Two waves, scrapes in between: in each, four prompts sent twice in a row (the second
            # time from the state the first kept), then a burst of eight new ones (more states than
            # the six slots hold: the older ones are evicted).
            for wave in range(2):
                for k in range(4):
                    prompt = f"Question {wave}-{k}: " + "how long is a piece of string " * 2
                    send([prompt])
                    send([prompt])
                send([f"Burst {wave}-{k}: " + "words that nobody has sent before " * 2 for k in range(8)])
                time.sleep(5)
            yield served, prom


def test_the_engine_counts_states_kept_restored_and_evicted(observed):
    served, _ = observed
    [stats] = served.stats()
    assert stats.num_recurrent_state_slots == 6 and stats.recurrent_states_held == 6
    assert stats.recurrent_states_restored >= 8  # (each prompt's second time, at least)
    assert stats.recurrent_states_saved > 6 and stats.recurrent_states_evicted > 0


@pytest.mark.parametrize("expr", dashboard_queries("recurrent"))
def test_every_recurrent_state_panel_query_returns_data(observed, expr):
    assert_query_has_data(observed[1], expr)


def test_the_states_held_gauge_reads_the_cache_as_it_is_when_scraped(observed):
    """(Last: it empties the cache.) A prefix-cache reset between passes empties the kept states: the
    next scrape says so, with no pass in between to report it."""
    import ray

    served, _ = observed

    def held() -> float:
        text = httpx.get(f"{served.base}/metrics", timeout=60).text
        return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith("llm_cluster:recurrent_states_held{"))

    assert held() == 6
    assert ray.get(served.engines[0].actor.reset_prefix_cache.remote())
    deadline = time.monotonic() + 20  # (the router's scrape of the engines may be a moment old)
    while held() != 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert held() == 0
