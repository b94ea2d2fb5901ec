"""The image panels of the dashboard against a real Prometheus: a LLaVA engine's encoder series and
the router's processed-image cache, with data from chats that show the same image again."""

from __future__ import annotations

import base64
import io
import time

import httpx
import numpy as np
import pytest

from cluster.config import ClusterConfig, EngineSpec
from tests.e2e.prometheus import assert_query_has_data, require_prometheus, scraping
from tests.e2e.test_observability import dashboard_queries
from tests.serve_cluster import serve_cluster
from tests.tiny_model import build_tiny_llava

pytestmark = pytest.mark.slow


def _data_url(seed: int) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray((np.random.RandomState(seed).rand(40, 50, 3) * 255).astype("uint8")).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def observed(ray_cluster, tmp_path_factory):
    require_prometheus()
    model_dir = build_tiny_llava(tmp_path_factory.mktemp("llava"))
    config = ClusterConfig(model=str(model_dir), served_model_name="llava",
                           defaults=EngineSpec(num_gpu_blocks=64, max_model_len=256, block_size=4))
    with serve_cluster(config) as served:
        httpx.get(f"{served.base}/metrics", timeout=60)
        with scraping(served.base) as prom:
            # Two waves; in each, three images, each asked about after two different questions (the
            # second time: not decoded again by the router, not encoded again by the engine).
            for wave in range(2):
                for question in ("What is this?", "Describe it."):
                    for seed in range(3 * wave, 3 * wave + 3):
                        r = httpx.post(f"{served.base}/v1/chat/completions", timeout=60, json={
                            "model": "llava", "max_tokens": 2, "messages": [{"role": "user", "content": [
                                {"type": "text", "text": question},
                                {"type": "image_url", "image_url": {"url": _data_url(seed)}}]}]})
                        assert r.status_code == 200, r.text
                time.sleep(5)
            yield served, prom


def test_the_engine_counts_images_encoded_and_found_encoded(observed):
    served, _ = observed
    [stats] = served.stats()
    assert (stats.num_images_encoded, stats.num_images_found_encoded) == (6, 6)


@pytest.mark.parametrize("expr", dashboard_queries("images"))
def test_every_image_panel_query_returns_data(observed, expr):
    assert_query_has_data(observed[1], expr)
