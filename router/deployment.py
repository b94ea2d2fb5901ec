"""The Ray Serve ingress deployment: one replica = one EngineClient + the FastAPI app."""

from __future__ import annotations

import logging
import os
import random
import tempfile
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import serve
from transformers import AutoTokenizer

from router.app import create_app
from router.engine_client import EngineClient
from router.metrics import RouterMetrics
from router.routing import create_routing_policy
from router.serving import OpenAIServing, ServingSettings

logger = logging.getLogger(__name__)


@dataclass
class RouterConfig:
    """What a router replica needs to find and use the engines (all picklable)."""

    engine_actor_names: list[str]
    namespace: str
    routing_policy: str = "least_loaded"
    prefix_load_margin: int = 8
    request_timeout_s: float | None = None
    served_model_name: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


async def load_tokenizer_from_engine(handle: Any) -> Any:
    """Fetch the tokenizer files from an engine, so this replica needs no copy of the model."""
    files: dict[str, bytes] = await handle.get_tokenizer_files.remote()
    directory = tempfile.mkdtemp(prefix="llm-cluster-tokenizer-")
    for name, data in files.items():
        with open(os.path.join(directory, name), "wb") as f:
            f.write(data)
    return AutoTokenizer.from_pretrained(directory)


async def build_serving(config: RouterConfig, client_index: int | None = None) -> tuple[OpenAIServing, EngineClient]:
    """Connect to the engines by name and build the serving core (used by Serve and by plain uvicorn)."""
    names, namespace = config.engine_actor_names, config.namespace
    handles = [ray.get_actor(name, namespace=namespace) for name in names]
    descriptions = [await h.describe.remote() for h in handles]
    first = descriptions[0]
    tokenizer = await load_tokenizer_from_engine(handles[0])
    # Each replica is a distinct client of every engine.
    client_index = random.getrandbits(31) if client_index is None else client_index
    client = EngineClient(handles, client_index,
                          resolve_handle=lambda i: ray.get_actor(names[i], namespace=namespace))
    settings = ServingSettings(
        served_model_name=config.served_model_name or first.model_info.served_model_name,
        max_model_len=min(d.scheduler_config["max_model_len"] for d in descriptions),
        block_size=first.block_size,
        scheduling_policy=first.scheduler_config["policy"]
        if all(d.scheduler_config["policy"] == first.scheduler_config["policy"] for d in descriptions) else "fcfs",
        request_timeout_s=config.request_timeout_s,
        eos_token_ids=first.model_info.eos_token_ids,
    )
    policy = create_routing_policy(config.routing_policy, len(handles), block_size=first.block_size,
                                   load_margin=config.prefix_load_margin)
    if hasattr(policy, "forget_engine"):
        client.on_engine_restart = policy.forget_engine
    metrics = RouterMetrics(settings.served_model_name, replica=str(client_index))
    client.start()
    return OpenAIServing(settings, client, tokenizer, policy, metrics), client


async def engine_metrics_text(client: EngineClient) -> bytes:
    """Every engine's exposition text, fetched from the engines themselves (same on every replica)."""
    parts = []
    for engine in range(client.num_engines):
        if not client.healthy()[engine]:
            continue
        try:
            parts.append(await client.handle(engine).get_metrics_text.remote())
        except Exception as e:  # an engine dying mid-scrape must not fail the whole scrape
            logger.warning("metrics of engine %d unavailable: %s", engine, e)
    return b"".join(parts)


@serve.ingress()
class OpenAIRouter:
    async def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.serving, self.client = await build_serving(config)

    def __serve_build_asgi_app__(self):
        return create_app(self.serving, extra_metrics=lambda: engine_metrics_text(self.client))
