"""Placing engines on a real local Ray (4 CPUs, no GPU): a demand the node can never meet is refused
up front, and a placement that waits says what it waits for and what is free."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ray.util.placement_group import placement_group, remove_placement_group

from cluster.config import ClusterConfig, EngineSpec
from cluster.launcher import InsufficientResourcesError, check_local_capacity, wait_until_placed


def _engines(num_engines: int, tensor_parallel_size: int, cpus: float, pipeline_parallel_size: int = 1):
    return ClusterConfig(num_engines=num_engines, defaults=EngineSpec(
        tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
        num_cpus_per_worker=cpus, device="cpu")).engine_configs()


def test_a_demand_beyond_the_local_node_is_refused_with_what_is_short(ray_cluster):
    check_local_capacity(_engines(2, 2, 1.0))  # 4 of the 4 CPUs: fits
    with pytest.raises(InsufficientResourcesError) as error:
        check_local_capacity(_engines(3, 2, 1.0))
    assert "need 6 CPU (this Ray has 4)" in str(error.value)
    assert "--num-cpus-per-worker" in str(error.value)


def test_pipeline_stages_multiply_an_engines_bundles(ray_cluster):
    """One bundle per worker: a tensor-parallel rank of each pipeline stage (TP x PP)."""
    check_local_capacity(_engines(1, 2, 1.0, pipeline_parallel_size=2))  # 4 of the 4 CPUs: fits
    with pytest.raises(InsufficientResourcesError) as error:
        check_local_capacity(_engines(1, 2, 1.0, pipeline_parallel_size=3))
    assert "need 6 CPU (this Ray has 4)" in str(error.value)
    assert "--pipeline-parallel-size" in str(error.value)


def test_an_engine_with_several_workers_runs_them_as_ray_actors():
    from cluster.launcher import resolve_backend

    [single] = _engines(1, 1, 1.0)
    [staged] = _engines(1, 1, 1.0, pipeline_parallel_size=2)
    assert (resolve_backend(single), resolve_backend(staged)) == ("uni", "ray")


def test_the_kv_offloading_tier_reserves_its_host_memory_per_rank(ray_cluster):
    from cluster.launcher import engine_bundle

    [config] = ClusterConfig(defaults=EngineSpec(tensor_parallel_size=2, kv_offloading_size=3, device="cpu",
                                                  num_cpus_per_worker=0.5)).engine_configs()
    assert engine_bundle(config, use_gpu=False)["memory"] == 1.5 * 2**30  # (the size is all ranks' together)
    check_local_capacity([config])
    [greedy] = ClusterConfig(defaults=EngineSpec(kv_offloading_size=100_000, device="cpu",
                                                 num_cpus_per_worker=0.5)).engine_configs()
    with pytest.raises(InsufficientResourcesError, match=r"need 1e\+05 GiB of host memory .* --kv-offloading-size"):
        check_local_capacity([greedy])


def test_a_waiting_placement_warns_with_the_free_resources_then_times_out(ray_cluster, caplog):
    pg = placement_group([{"CPU": 64}], strategy="PACK", name="test-unplaceable")
    try:
        with caplog.at_level(logging.WARNING, logger="cluster.launcher"), pytest.raises(TimeoutError) as error:
            wait_until_placed(pg, "engine 9: 1 worker bundle(s) {'CPU': 64}", timeout_s=2.5, first_warning_s=0.5)
    finally:
        remove_placement_group(pg)
    warnings = [r.getMessage() for r in caplog.records]
    # At 0.5 s and 1.5 s (the interval doubles; the wait after that ends in the timeout), each
    # naming the bundles and the free CPUs.
    assert len(warnings) == 2, warnings
    assert all("engine 9: 1 worker bundle(s) {'CPU': 64}: not placed after" in w for w in warnings)
    assert all("free now: " in w and " CPU" in w and "_group_" not in w for w in warnings)
    assert "not placed after 2.5 s" in str(error.value)


def test_a_placement_that_fits_returns_without_warning(ray_cluster, caplog):
    pg = placement_group([{"CPU": 0.5}], strategy="PACK", name="test-placeable")
    try:
        with caplog.at_level(logging.WARNING, logger="cluster.launcher"):
            wait_until_placed(pg, "engine 0", timeout_s=30)
    finally:
        remove_placement_group(pg)
    assert not caplog.records


@pytest.mark.slow
@pytest.mark.parametrize("engines", [["--num-engines", "3"], ["--engine-autoscaling", '{"max_engines": 3}']],
                         ids=["num-engines", "autoscaled"])
def test_the_cli_refuses_more_engines_than_its_local_ray_can_hold(tiny_model_dir, engines):
    """`llm-cluster serve` on its own local Ray exits at once with status 2 and one line (it used to
    wait 15 minutes for the placement); with engine autoscaling, every engine it may start counts."""
    result = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "serve", "--model", str(tiny_model_dir), *engines, "--num-cpus", "2"],
        capture_output=True, text=True, timeout=240, cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "RAY_ADDRESS": ""})
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("llm-cluster: ")]
    assert lines == ["llm-cluster: the 3 engine(s) need 3 CPU (this Ray has 2): each engine reserves one bundle "
                     "per worker (tensor-parallel rank of each pipeline stage); lower --num-engines (or engine "
                     "autoscaling's max_engines), --tensor-parallel-size, --pipeline-parallel-size or "
                     "--num-cpus-per-worker, or give Ray more (--num-cpus)"]
