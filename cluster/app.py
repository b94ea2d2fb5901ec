"""Building the Serve application: engines (named Ray actors) plus the router ingress deployment.

``build_app`` is a Serve application builder, so the same application starts from the CLI and from
a Serve config (``serve run deploy/serve_config.yaml``; ``import_path: cluster.app:build_app``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

import ray
from ray import serve

from cluster.autoscaler import start_autoscaler, stop_autoscaler
from cluster.config import ClusterConfig, default_api_keys, read_chat_template_files
from cluster.launcher import (
    EngineHandle,
    engine_actor_name,
    ensure_ray,
    named_actor,
    running_engine_indexes,
    start_engines,
    stop_engines,
    stop_named_engine,
)
from engine_core.config import EngineConfig
from engine_core.log_setup import logging_runtime_env
from router.deployment import METRICS_HUB_NAME, OpenAIRouter, RouterConfig
from router.response_store import EARLIER_RESPONSE_STORE_NAMES, RESPONSE_STORE_NAME
from router.serving import CORSSettings

logger = logging.getLogger(__name__)

# The Serve application's name (the CLI's; a Serve config names its own).
APP_NAME = "llm-cluster"


def reconcile_engines(config: ClusterConfig) -> list[int]:
    """Make the running (detached) engines match ``config``: an engine whose flags or model are
    unchanged is kept, one that differs (or died) is replaced, one beyond the wanted count is
    stopped. Returns the indexes started now. (A redeploy with new ``args`` must not keep serving
    the old flags, and a dead engine's placement group must not stay reserved.) Each model's engines
    keep their indexes (``ClusterConfig.place_engines``): a change to one model's engine count does
    not move another's, which would restart them. An autoscaled model's first num_engines slots are
    made to run; an engine the autoscaler started in a further slot is kept if its flags are
    unchanged, and the autoscaler (restarted with the new config) goes on from there."""
    stop_autoscaler(config.namespace)  # (it must not start engines of the old config meanwhile)
    running = _running_configs(running_engine_indexes(config.namespace), config.namespace)
    config.place_engines({index: engine for index, (engine, _) in running.items() if engine is not None})
    wanted = config.engine_configs()
    slots = config.engine_slot_configs()
    wanted_indexes = {engine.engine_index for engine in wanted}
    for engine in (e for e in slots if e.engine_index not in wanted_indexes):  # (autoscaled slots: kept, or stopped)
        if running.get(engine.engine_index, (None, False))[0] != engine:  # (not running: frees leftover bundles)
            stop_named_engine(engine_actor_name(engine.engine_index), config.namespace)
    to_start = []
    for engine in wanted:
        name = engine_actor_name(engine.engine_index)
        if engine.engine_index in running:
            current, draining = running[engine.engine_index]
            if current == engine and not draining:
                continue
            if current == engine:  # (its routers send it nothing: a new one serves in its place)
                logger.info("engine %d was being scaled away; replacing it", engine.engine_index)
            elif current is None:
                logger.warning("engine %d does not answer; replacing it", engine.engine_index)
            elif current.model != engine.model:
                # Either a redeploy with a new model, or a second application deployed into this
                # one's namespace, which would take its engines over.
                logger.warning("engine %d in namespace %r serves %s; replacing it with one serving %s. "
                               "Applications sharing a Ray cluster need their own `namespace` arg.",
                               engine.engine_index, config.namespace, current.model, engine.model)
            else:
                logger.info("engine %d: its configuration changed; replacing it", engine.engine_index)
        stop_named_engine(name, config.namespace)  # also a dead engine's leftover placement group
        to_start.append(engine)
    slot_indexes = {engine.engine_index for engine in slots}
    for extra in running:
        if extra not in slot_indexes:
            logger.info("engine %d is not one of the configured engines; stopping it", extra)
            stop_named_engine(engine_actor_name(extra), config.namespace)
    if to_start:
        # Detached: the engines belong to the Serve application, not to the process that built it.
        start_engines(to_start, config.namespace, detached=True)
    if scaled := config.scaled_models():
        start_autoscaler(slots, config.namespace, scaled, detached=True)
    return [engine.engine_index for engine in to_start]


def _running_configs(indexes: list[int], namespace: str, timeout_s: float = 60.0
                     ) -> dict[int, tuple[EngineConfig | None, bool]]:
    """The configuration each engine at ``indexes`` runs and whether it drains ((None, False): it
    does not answer within ``timeout_s``, all asked at once, or is gone)."""
    asked = {}
    for index in indexes:
        actor = named_actor(engine_actor_name(index), namespace)
        if actor is not None:
            asked[index] = (actor.engine_config.remote(), actor.drain_status.remote())
    refs = [ref for pair in asked.values() for ref in pair]
    ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    out: dict[int, tuple[EngineConfig | None, bool]] = {index: (None, False) for index in indexes}
    for index, (config_ref, drain_ref) in asked.items():
        try:
            out[index] = ray.get(config_ref, timeout=0), ray.get(drain_ref, timeout=0)[0]
        except Exception as e:
            logger.warning("engine %d does not answer (%s)", index, e)
    return out


def stop_app(namespace: str = "llm-cluster", app_name: str = APP_NAME) -> list[str]:
    """`llm-cluster stop`: delete the Serve application and stop the detached engines, metrics hub
    and responses store a Serve deploy left running (``serve shutdown`` / ``serve delete`` do not
    know about them)."""
    with contextlib.suppress(Exception):
        serve.delete(app_name)
    stop_autoscaler(namespace)
    stopped = []
    for index in running_engine_indexes(namespace):
        stop_named_engine(engine_actor_name(index), namespace)
        stopped.append(engine_actor_name(index))
    return stopped + stop_router_helpers(namespace)


def stop_router_helpers(namespace: str) -> list[str]:
    """Stop the detached actors the router replicas share (the metrics hub, the responses store):
    they outlive the replicas, on purpose, until the application stops."""
    stopped = []
    for name in (METRICS_HUB_NAME, RESPONSE_STORE_NAME, *EARLIER_RESPONSE_STORE_NAMES):
        actor = named_actor(name, namespace)
        if actor is not None:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            stopped.append(name)
    return stopped


def _router_names(served_model_name: str | list[str] | None) -> dict[str, Any]:
    """RouterConfig's served_model_name (the first name; None: the model's own) and its aliases."""
    names = [served_model_name] if isinstance(served_model_name, str) else served_model_name or [None]
    return {"served_model_name": names[0], "served_model_aliases": tuple(names[1:])}


def router_deployment(config: ClusterConfig):
    (_, first_engines), *others = config.model_engines()
    kv_roles = {engine.engine_index: engine.kv_transfer_config.kv_role if engine.kv_transfer_config else None
                for engine in config.engine_slot_configs()}
    router_config = RouterConfig(
        engine_actor_names=[engine_actor_name(i) for i in first_engines], engine_indexes=tuple(first_engines),
        engine_kv_roles=tuple(kv_roles[i] for i in first_engines), namespace=config.namespace,
        routing_policy=config.routing_policy,
        prefix_load_margin=config.prefix_load_margin, pd_prefill_threshold=config.pd_prefill_threshold,
        request_timeout_s=config.request_timeout_s,
        **_router_names(config.served_model_name), model=config.model, chat_template=config.chat_template,
        default_chat_template_kwargs=config.default_chat_template_kwargs or {},
        enable_log_requests=config.enable_log_requests, max_log_len=config.max_log_len,
        enable_log_outputs=config.enable_log_outputs,
        tool_call_parser=config.tool_call_parser if config.enable_auto_tool_choice else None,
        reasoning_parser=config.reasoning_parser, api_keys=tuple(config.api_keys),
        enable_lora=config.enable_lora,
        allow_runtime_lora_updating=config.allow_runtime_lora_updating and config.enable_lora,
        server_dev_mode=config.server_dev_mode, trust_request_chat_template=config.trust_request_chat_template,
        enable_responses_store=config.enable_responses_store,
        enable_prompt_tokens_details=config.enable_prompt_tokens_details,
        stream_interval=config.stream_interval,
        responses_store_max_entries=config.responses_store_max_entries,
        enable_server_load_tracking=config.enable_server_load_tracking,
        enable_tokenizer_info_endpoint=config.enable_tokenizer_info_endpoint,
        cors=CORSSettings(tuple(config.allowed_origins), tuple(config.allowed_methods),
                          tuple(config.allowed_headers), config.allow_credentials),
        enable_force_include_usage=config.enable_force_include_usage,
        structured_outputs_disable_any_whitespace=config.structured_outputs_disable_any_whitespace,
        return_tokens_as_token_ids=config.return_tokens_as_token_ids,
        exclude_tools_when_tool_choice_none=config.exclude_tools_when_tool_choice_none,
        disable_fastapi_docs=config.disable_fastapi_docs, response_role=config.response_role,
        chat_template_content_format=config.chat_template_content_format,
        limit_mm_per_prompt=dict(config.limit_mm_per_prompt),
        allowed_local_media_path=config.allowed_local_media_path,
        mm_processor_cache_gb=config.mm_processor_cache_gb,
        allowed_media_domains=tuple(d.lower().strip("[]") for d in config.allowed_media_domains),
        media_io_kwargs=dict(config.media_io_kwargs))
    # Further models: the same router settings, their own engines, names, template, parsers and
    # adapters.
    more_models = [dataclasses.replace(
        router_config, engine_actor_names=[engine_actor_name(i) for i in indexes], engine_indexes=tuple(indexes),
        engine_kv_roles=tuple(kv_roles[i] for i in indexes), **_router_names(served.served_model_name),
        model=served.model, chat_template=served.chat_template,
        default_chat_template_kwargs=served.default_chat_template_kwargs or {},
        limit_mm_per_prompt=dict(served.limit_mm_per_prompt),
        tool_call_parser=served.tool_call_parser if served.enable_auto_tool_choice else None,
        reasoning_parser=served.reasoning_parser, enable_lora=served.enable_lora,
        allow_runtime_lora_updating=config.allow_runtime_lora_updating and served.enable_lora)
        for served, indexes in others]
    if config.router_autoscaling is None:
        replicas: dict[str, Any] = {"num_replicas": config.num_router_replicas}
    else:  # (Serve scales the replicas; each is a client of every engine under a client index of its own)
        replicas = {"autoscaling_config": config.router_autoscaling.serve_config(config.router_initial_replicas()),
                    "graceful_shutdown_timeout_s": config.router_autoscaling.graceful_shutdown_timeout_s}
    deployment = serve.deployment(
        OpenAIRouter, name="OpenAIRouter", **replicas,
        ray_actor_options={"num_cpus": 0, **({"runtime_env": env} if (env := logging_runtime_env()) else {})},
        # Streaming requests stay open for a long time: let each replica hold many.
        max_ongoing_requests=1024,
        logging_config={"enable_access_log": config.enable_access_log})
    return deployment.bind(router_config, more_models) if more_models else deployment.bind(router_config)


def build_app(args: dict[str, Any]):
    """Serve application builder: ``args`` is a ClusterConfig mapping (engines and their flags)."""
    if misplaced := sorted({"host", "port"} & set(args)):
        # (The CLI's: under Serve the proxy listens where the config's http_options say.)
        raise ValueError(f"{', '.join(misplaced)}: set the address Serve listens on in the Serve config's "
                         "http_options, not in the application's args")
    config = ClusterConfig(**({"api_keys": default_api_keys()} | read_chat_template_files(args)))
    config.engine_configs()  # validate every engine's flags before anything starts
    ensure_ray(config.address, namespace=config.namespace)
    reconcile_engines(config)
    return router_deployment(config)


def start_cluster(config: ClusterConfig) -> list[EngineHandle]:
    """Start engines owned by this process (CLI, tests); they stop when it stops (with engine
    autoscaling, so does the autoscaler, and the engines it started with it). ``stop_cluster``
    stops them cleanly."""
    ensure_ray(config.address, namespace=config.namespace)
    engines = start_engines(config.engine_configs(), config.namespace)
    if scaled := config.scaled_models():
        start_autoscaler(config.engine_slot_configs(), config.namespace, scaled)
    return engines


def stop_cluster(config: ClusterConfig, engines: list[EngineHandle]) -> None:
    """Stop what ``start_cluster`` started: the autoscaler first, with the engines it started (none
    may start while they stop), then ``engines``."""
    if config.scaled_models():
        stop_autoscaler(config.namespace, stop_engines=True)
    stop_engines(engines)


def run_router(config: ClusterConfig, blocking: bool = False) -> None:
    serve.start(http_options={"host": config.host, "port": config.port})
    serve.run(router_deployment(config), name=APP_NAME, route_prefix="/", blocking=blocking)
