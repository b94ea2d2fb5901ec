"""LoRA affinity with real engines: the router's serving core in this process (build_serving) sends
requests under two adapters to two engines that each take one adapter per batch (max_loras=1)."""

from __future__ import annotations

import asyncio

import pytest

from cluster.app import router_deployment, start_cluster, stop_cluster
from cluster.config import ClusterConfig, EngineSpec
from engine_core.outputs import EngineCoreRequest, LoRARequest
from engine_core.sampling_params import SamplingParams
from router.deployment import build_serving
from tests.lora_adapters import save_adapter

pytestmark = pytest.mark.slow


def test_each_adapter_keeps_to_the_engine_running_it(ray_cluster, tiny_model_dir, tmp_path):
    """Requests alternating between two adapters, in flight together: each adapter's go to one
    engine, the two adapters to different engines (power of two choices on load alone mixes them,
    and each engine then holds one adapter's requests back while the other's run)."""
    paths = [save_adapter(tiny_model_dir, tmp_path / name, seed=seed) for name, seed in (("a", 1), ("b", 2))]
    config = ClusterConfig(model=str(tiny_model_dir), served_model_name="tiny", num_engines=2,
                           namespace="lora-routing-test", routing_policy="least_loaded", enable_lora=True,
                           max_loras=1, lora_modules=[f"a={paths[0]}", f"b={paths[1]}"],
                           defaults=EngineSpec(num_gpu_blocks=128, max_model_len=256, num_cpus_per_worker=0.5))
    loras = [LoRARequest("a", 1, str(paths[0])), LoRARequest("b", 2, str(paths[1]))]
    engines = start_cluster(config)
    try:
        async def route() -> list[tuple[str, int]]:
            serving, client = await build_serving(router_deployment(config)._bound_deployment.init_args[0])
            await client.wait_connected()
            params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            placed, streams = [], []
            try:
                for i in range(8):
                    lora = loras[i % 2]
                    tokens = [3 + (i * 11 + j) % 300 for j in range(8)]
                    engine = serving.choose_engine(tokens, None, lora=lora)
                    streams.append(await client.open(engine, EngineCoreRequest(
                        request_id=f"affinity-{i}", prompt_token_ids=tokens, sampling_params=params,
                        client_index=client.client_index, lora_request=lora)))
                    placed.append((lora.lora_name, engine))
                a, b = loras[0].cache_key, loras[1].cache_key
                assert client.active_adapters() in ([{a: 4}, {b: 4}], [{b: 4}, {a: 4}])
            finally:
                for stream in streams:
                    await stream.close()
                await client.close()
            return placed

        placed = asyncio.run(route())
    finally:
        stop_cluster(config, engines)
    engines_of = {name: {engine for n, engine in placed if n == name} for name in ("a", "b")}
    assert len(engines_of["a"]) == len(engines_of["b"]) == 1 and engines_of["a"] != engines_of["b"], placed
