"""Starting (or joining) Ray and placing engines: one placement group and one engine actor per engine.

Each engine's workers (TP x PP ranks) live in one placement group (one bundle per rank, PACK by
default); the engine actor sits in bundle 0 beside rank 0. Engines are named actors, so router
replicas find them by name and a restarted engine is found again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.experimental import internal_kv
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine_core.config import EngineConfig
from engine_core.engine_actor import (
    EngineCoreActor,
    EngineDescription,
    named_actor,
    pause_record_key,
    wait_until_name_released,
)
from engine_core.log_setup import logging_runtime_env

logger = logging.getLogger(__name__)

# The engine actor restarts (re-running its constructor: model load, fresh KV pool) if its process dies.
ENGINE_MAX_RESTARTS = 3


def ensure_ray(address: str | None = None, namespace: str = "llm-cluster", num_cpus: int | None = None) -> bool:
    """Join the given cluster, or, with no address, the one Ray finds (RAY_ADDRESS, or a `ray start`
    on this machine), else start a local one. True when this call started a new local Ray: one node
    and no autoscaler, so nothing will ever add resources to it."""
    if ray.is_initialized():
        return False
    started_local = not address and _no_cluster_to_join()
    # Engines must import our packages wherever they run; local Ray inherits this checkout's path.
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    kwargs: dict[str, Any] = {"namespace": namespace, "ignore_reinit_error": True, "log_to_driver": True}
    if address:
        kwargs["address"] = address
    else:
        kwargs["include_dashboard"] = False
        if num_cpus is not None:
            kwargs["num_cpus"] = num_cpus
    ray.init(**kwargs)
    return started_local


def _no_cluster_to_join() -> bool:
    """What ray.init() without an address will do: start a new local Ray (True) or join one."""
    try:
        from ray._private.services import canonicalize_bootstrap_address

        return canonicalize_bootstrap_address(None) is None
    except Exception:  # (a private helper: if it moved, do not claim the Ray is ours)
        return False


_ENGINE_NAME_PREFIX = "llm-cluster-engine-"


def engine_actor_name(engine_index: int) -> str:
    return f"{_ENGINE_NAME_PREFIX}{engine_index}"


def running_engine_indexes(namespace: str) -> list[int]:
    """The indexes of the engines running in ``namespace`` (with autoscaling, slots may be empty
    between them)."""
    indexes = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if entry["namespace"] == namespace and name.startswith(_ENGINE_NAME_PREFIX):
            suffix = name.removeprefix(_ENGINE_NAME_PREFIX)
            if suffix.isdigit():
                indexes.append(int(suffix))
    return sorted(indexes)


def engine_placement_group_name(name: str, namespace: str) -> str:
    """The name of an engine's worker bundles. Placement group names are cluster-wide (not per
    namespace, unlike actor names), so it carries the namespace: stopping one application's engine
    must not free the bundles of another application's engine with the same index."""
    return f"{namespace}/{name}-workers"


def _use_gpu(config: EngineConfig) -> bool:
    if config.device == "cuda":
        return True
    if config.device == "cpu":
        return False
    return ray.cluster_resources().get("GPU", 0) >= 1


def resolve_backend(config: EngineConfig) -> str:
    if config.executor_backend != "auto":
        return config.executor_backend
    return "uni" if config.world_size == 1 else "ray"


def engine_bundle(config: EngineConfig, use_gpu: bool) -> dict[str, float]:
    """What one worker of this engine reserves (one bundle per rank: TP x PP of them)."""
    bundle: dict[str, float] = {"CPU": config.num_cpus_per_worker, **dict(config.resources_per_worker)}
    if use_gpu:
        bundle["GPU"] = 1
    if config.kv_offloading_size:
        # The KV offloading tier pins this much host memory per rank: reserved with Ray, so engines
        # placed on one node cannot together pin more than it has.
        bundle["memory"] = config.kv_offloading_bytes_per_rank()
    return bundle


class InsufficientResourcesError(ValueError):
    """The engines ask for more than the (local, fixed-size) Ray cluster has at all."""


def check_local_capacity(configs: list[EngineConfig]) -> None:
    """On a local Ray (one node, no autoscaler) a placement that exceeds the node's resources can
    never happen: say what is short now, instead of after the placement timeout."""
    total = ray.cluster_resources()
    need: dict[str, float] = {}
    for config in configs:
        for resource, amount in engine_bundle(config, _use_gpu(config)).items():
            need[resource] = need.get(resource, 0.0) + amount * config.world_size
    short = {r: (amount, total.get(r, 0.0)) for r, amount in need.items() if amount > total.get(r, 0.0) + 1e-9}
    if short:
        parts = ", ".join(_amount(r, amount, have) for r, (amount, have) in short.items())
        raise InsufficientResourcesError(
            f"the {len(configs)} engine(s) need {parts}: each engine reserves one bundle per worker (tensor-parallel "
            f"rank of each pipeline stage); lower --num-engines (or engine autoscaling's max_engines), "
            f"--tensor-parallel-size, --pipeline-parallel-size"
            f"{', --kv-offloading-size' if 'memory' in short else ''} or --num-cpus-per-worker, or give Ray "
            f"more (--num-cpus)")


def _amount(resource: str, amount: float, have: float) -> str:
    if resource == "memory":  # (bytes: the KV offloading tiers)
        return f"{amount / 2**30:.3g} GiB of host memory (this Ray has {have / 2**30:.3g} GiB)"
    return f"{amount:g} {resource} (this Ray has {have:g})"


def wait_until_placed(pg: PlacementGroup, what: str, timeout_s: float, first_warning_s: float = 10.0) -> None:
    """Wait for a placement group, saying what it waits for and what the cluster has free after 10 s,
    30 s, 70 s, ... (on an autoscaling cluster the wait can be long and legitimate)."""
    ready = pg.ready()
    start = time.monotonic()
    interval = first_warning_s
    while True:
        remaining = timeout_s - (time.monotonic() - start)
        final = remaining <= interval  # the last wait: it ends in the timeout error, not a warning
        done, _ = ray.wait([ready], timeout=max(0.0, remaining if final else interval))
        if done:
            ray.get(ready)
            return
        if final:
            raise TimeoutError(f"not placed after {timeout_s:g} s; free now: {_free_resources()} (see `ray status`)")
        logger.warning("%s: not placed after %.0f s; free now: %s. Waiting up to %.0f s in all "
                       "(an autoscaler may add nodes; see `ray status`).", what, time.monotonic() - start,
                       _free_resources(), timeout_s)
        interval *= 2


def _free_resources() -> str:
    # (Without Ray's bookkeeping resources: per-node markers, memory, and placement groups' own.)
    free = {r: v for r, v in sorted(ray.available_resources().items())
            if not r.startswith(("node:", "memory", "object_store_memory")) and "_group_" not in r}
    return ", ".join(f"{v:g} {r}" for r, v in free.items()) or "nothing"


@dataclass
class EngineHandle:
    index: int
    name: str
    actor: Any
    placement_group: PlacementGroup
    description: EngineDescription | None = None


def start_engine(config: EngineConfig, namespace: str, detached: bool = False,
                 ready_timeout_s: float = 900.0) -> EngineHandle:
    from gpu_worker.executor import create_executor

    use_gpu = _use_gpu(config)
    bundle = engine_bundle(config, use_gpu)
    # One bundle per worker: each pipeline stage's tensor-parallel ranks (the strategy decides whether
    # stages may land on different nodes).
    workers = config.world_size
    name = engine_actor_name(config.engine_index)
    pg = placement_group([dict(bundle) for _ in range(workers)], strategy=config.placement_strategy,
                         name=engine_placement_group_name(name, namespace), lifetime="detached" if detached else None,
                         bundle_label_selector=[dict(config.node_labels)] * workers if config.node_labels else None)
    try:
        wait_until_placed(pg, f"engine {config.engine_index}: {workers} worker bundle(s) {bundle} "
                              f"({config.placement_strategy})", ready_timeout_s)
    except BaseException as e:
        remove_placement_group(pg)
        if not isinstance(e, Exception):
            raise  # (Ctrl-C while waiting stays a KeyboardInterrupt)
        raise RuntimeError(f"engine {config.engine_index}: cannot place {workers} worker bundle(s) {bundle}: "
                           f"{e}") from e
    uni = resolve_backend(config) == "uni"
    options: dict[str, Any] = {
        "name": name, "namespace": namespace, "max_restarts": ENGINE_MAX_RESTARTS,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True),
        # In-process execution: the engine process runs the model and holds the bundle's resources.
        "num_cpus": config.num_cpus_per_worker if uni else 0,
        "num_gpus": (1 if use_gpu else 0) if uni else 0,
        "resources": dict(config.resources_per_worker) if uni else {},
    }
    if detached:
        options["lifetime"] = "detached"
    if runtime_env := logging_runtime_env():  # (its workers inherit it)
        options["runtime_env"] = runtime_env
    # A new engine starts unpaused, whatever a stopped one of the same name recorded.
    internal_kv._internal_kv_del(pause_record_key(namespace, name))
    actor = ray.remote(EngineCoreActor).options(**options).remote(config, create_executor)
    return EngineHandle(config.engine_index, name, actor, pg)


def start_engines(configs: list[EngineConfig], namespace: str, detached: bool = False,
                  ready_timeout_s: float = 900.0) -> list[EngineHandle]:
    """Start every engine, then wait until each has loaded its model and sized its KV pool."""
    handles: list[EngineHandle] = []
    try:
        for config in configs:
            handles.append(start_engine(config, namespace, detached, ready_timeout_s))
        deadline = time.monotonic() + ready_timeout_s
        for h in handles:
            h.description = ray.get(h.actor.describe.remote(), timeout=max(1.0, deadline - time.monotonic()))
            logger.info("engine %d ready: %d KV blocks of %d tokens", h.index, h.description.num_blocks,
                        h.description.block_size)
    except BaseException:  # (Ctrl-C too: the engines started so far stop with the rest)
        stop_engines(handles)
        raise
    return handles


def stop_named_engine(name: str, namespace: str, graceful: bool = True) -> None:
    """Stop a (detached) engine found by name and free its placement group; also frees the group of
    an engine whose actor is already gone. Not ``graceful``: killed at once (one still loading its
    model, which would answer a shutdown only once loaded)."""
    actor = named_actor(name, namespace)
    if actor is not None:
        try:
            if graceful:
                ray.get(actor.shutdown.remote(), timeout=30)
        except Exception as e:
            logger.warning("%s did not shut down cleanly: %s", name, e)
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
        if not wait_until_name_released(name, namespace):
            logger.warning("%s is still registered after being killed", name)
    for group in placement_groups_named(engine_placement_group_name(name, namespace)):
        with contextlib.suppress(Exception):
            remove_placement_group(group)


def placement_groups_named(name: str) -> list[PlacementGroup]:
    """Live placement groups with this name, whichever job (namespace) created them: a Serve deploy
    builds its engines inside Serve's own job, `llm-cluster stop` runs in another."""
    from ray._raylet import PlacementGroupID

    return [PlacementGroup(PlacementGroupID(bytes.fromhex(group_id)))
            for group_id, info in ray.util.placement_group_table().items()
            if info.get("name") == name and info.get("state") != "REMOVED"]


def stop_engines(handles: list[EngineHandle]) -> None:
    for h in handles:
        try:
            ray.get(h.actor.shutdown.remote(), timeout=30)
        except Exception as e:
            logger.warning("engine %d did not shut down cleanly: %s", h.index, e)
        with contextlib.suppress(Exception):
            ray.kill(h.actor, no_restart=True)
        with contextlib.suppress(Exception):
            remove_placement_group(h.placement_group)
