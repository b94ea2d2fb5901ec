"""Building the Serve application: engines (named Ray actors) plus the router ingress deployment.

``build_app`` is a Serve application builder, so the same application starts from the CLI and from
a Serve config (``serve run deploy/serve_config.yaml``; ``import_path: cluster.app:build_app``).
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray import serve

from cluster.config import ClusterConfig
from cluster.launcher import EngineHandle, engine_actor_name, ensure_ray, start_engines
from router.deployment import OpenAIRouter, RouterConfig

logger = logging.getLogger(__name__)

# The Serve application's name (the CLI's; a Serve config names its own).
APP_NAME = "llm-cluster"


def existing_engines(config: ClusterConfig) -> list[Any] | None:
    """The engines of a previous deploy, if all of them are still alive (a redeploy reuses them)."""
    handles = []
    for i in range(len(config.resolved_specs())):
        try:
            handles.append(ray.get_actor(engine_actor_name(i), namespace=config.namespace))
        except ValueError:
            return None
    return handles


def router_deployment(config: ClusterConfig):
    router_config = RouterConfig(
        engine_actor_names=[engine_actor_name(i) for i in range(len(config.resolved_specs()))],
        namespace=config.namespace, routing_policy=config.routing_policy,
        prefix_load_margin=config.prefix_load_margin, request_timeout_s=config.request_timeout_s,
        served_model_name=config.served_model_name)
    deployment = serve.deployment(
        OpenAIRouter, name="OpenAIRouter", num_replicas=config.num_router_replicas,
        ray_actor_options={"num_cpus": 0},
        # Streaming requests stay open for a long time: let each replica hold many.
        max_ongoing_requests=1024,
        logging_config={"enable_access_log": config.enable_access_log})
    return deployment.bind(router_config)


def build_app(args: dict[str, Any]):
    """Serve application builder: ``args`` is a ClusterConfig mapping (engines and their flags)."""
    config = ClusterConfig(**args)
    config.engine_configs()  # validate every engine's flags before anything starts
    ensure_ray(config.address, namespace=config.namespace)
    if existing_engines(config) is None:
        # Detached: the engines belong to the Serve application, not to the process that built it.
        start_engines(config.engine_configs(), config.namespace, detached=True)
    return router_deployment(config)


def start_cluster(config: ClusterConfig) -> list[EngineHandle]:
    """Start engines owned by this process (CLI, tests); they stop when it stops."""
    ensure_ray(config.address, namespace=config.namespace)
    return start_engines(config.engine_configs(), config.namespace)


def run_router(config: ClusterConfig, blocking: bool = False) -> None:
    serve.start(http_options={"host": config.host, "port": config.port})
    serve.run(router_deployment(config), name=APP_NAME, route_prefix="/", blocking=blocking)
