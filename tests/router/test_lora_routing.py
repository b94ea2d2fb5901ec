"""LoRA affinity with real engines: the router's serving core in this process (build_serving) sends
requests under two adapters to two engines that each take one adapter per batch (max_loras=1)."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.app import router_deployment, start_cluster, stop_cluster
from cluster.config import ClusterConfig, EngineSpec
from engine_core.outputs import EngineCoreRequest, LoRARequest
from engine_core.sampling_params import SamplingParams
from router.deployment import build_serving
from tests.lora_adapters import save_adapter

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def lora_cluster(ray_cluster, tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-routing")
    paths = [save_adapter(tiny_model_dir, root / name, seed=seed) for name, seed in (("a", 1), ("b", 2))]
    config = ClusterConfig(model=str(tiny_model_dir), served_model_name="tiny", num_engines=2,
                           namespace="lora-routing-test", routing_policy="least_loaded", enable_lora=True,
                           max_loras=1, lora_modules=[f"a={paths[0]}", f"b={paths[1]}"],
                           defaults=EngineSpec(num_gpu_blocks=128, max_model_len=256, num_cpus_per_worker=0.5))
    engines = start_cluster(config)
    try:
        yield config, [LoRARequest("a", 1, str(paths[0])), LoRARequest("b", 2, str(paths[1]))]
    finally:
        stop_cluster(config, engines)


async def _open(serving, client, lora: LoRARequest, number: int):
    """Route and open one long request under ``lora`` (left in flight): (its engine, its stream)."""
    tokens = [3 + (number * 11 + j) % 300 for j in range(8)]
    engine = serving.choose_engine(tokens, None, lora=lora)
    return engine, await client.open(engine, EngineCoreRequest(
        request_id=f"affinity-{number}", prompt_token_ids=tokens, sampling_params=PARAMS,
        client_index=client.client_index, lora_request=lora))


def test_each_adapter_keeps_to_the_engine_running_it(lora_cluster):
    """Requests alternating between two adapters, in flight together: each adapter's go to one
    engine, the two adapters to different engines (power of two choices on load alone mixes them,
    and each engine then holds one adapter's requests back while the other's run)."""
    config, loras = lora_cluster

    async def route() -> list[tuple[str, int]]:
        serving, client = await build_serving(router_deployment(config)._bound_deployment.init_args[0])
        await client.wait_connected()
        placed, streams = [], []
        try:
            for i in range(8):
                engine, stream = await _open(serving, client, loras[i % 2], i)
                streams.append(stream)
                placed.append((loras[i % 2].lora_name, engine))
            a, b = loras[0].cache_key, loras[1].cache_key
            assert [{k: n for k, n in counts.items() if n} for counts in client.active_adapters()] in (
                [{a: 4}, {b: 4}], [{b: 4}, {a: 4}])
        finally:
            for stream in streams:
                await stream.close()
            await client.close()
        return placed

    placed = asyncio.run(route())
    engines_of = {name: {engine for n, engine in placed if n == name} for name in ("a", "b")}
    assert len(engines_of["a"]) == len(engines_of["b"]) == 1 and engines_of["a"] != engines_of["b"], placed


def test_a_router_learns_from_the_engines_which_adapters_another_router_runs(lora_cluster):
    """Two router replicas: one sends requests under "a"; the engines tell every router which adapters
    their requests are under, so the other sends "b" to the other engine (on its own counts alone,
    it saw both engines free)."""
    config, loras = lora_cluster
    router_config = router_deployment(config)._bound_deployment.init_args[0]

    async def wait_until(condition, what: str) -> None:
        deadline = time.monotonic() + 30
        while not condition():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.01)

    async def route() -> list[tuple[int, int]]:
        (first, first_client), (second, second_client) = [await build_serving(router_config) for _ in range(2)]
        await first_client.wait_connected()
        await second_client.wait_connected()
        placed = []
        try:
            for attempt in range(4):  # (on load alone, each "b" would find both engines free: a coin toss)
                await wait_until(lambda: second_client.active_adapters() == [{}, {}], "adapters still in use")
                engine_a, stream_a = await _open(first, first_client, loras[0], 2 * attempt)
                await wait_until(lambda engine=engine_a: loras[0].cache_key in second_client.active_adapters()[engine],
                                 "the engine never said it runs adapter a")
                engine_b, stream_b = await _open(second, second_client, loras[1], 2 * attempt + 1)
                placed.append((engine_a, engine_b))
                await stream_a.close()
                await stream_b.close()
        finally:
            await first_client.close()
            await second_client.close()
        return placed

    assert all(engine_a != engine_b for engine_a, engine_b in asyncio.run(route()))
