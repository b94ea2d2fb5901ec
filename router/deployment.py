"""The Ray Serve ingress deployment: one replica = one EngineClient + the FastAPI app."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import random
import tempfile
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray import serve

from engine_core.engine_actor import named_actor
from engine_core.log_setup import configure_actor_logging
from engine_core.outputs import LoRARequest
from engine_core.tokenizer_files import write_tokenizer_files
from engine_core.tokenizer_loader import load_tokenizer
from router.app import create_app
from router.detached import SharedRun, detached_task
from router.disaggregation import EngineRoles
from router.engine_client import EngineClient
from router.metrics import RouterMetrics, merge_expositions
from router.multimodal import IMAGE_PROCESSOR_FILE, load_image_processor
from router.response_store import ActorResponseStore
from router.routing import create_routing_policy
from router.serving import CORSSettings, OpenAIServing, ServingSettings

if TYPE_CHECKING:
    from engine_core.engine_actor import EngineDescription

logger = logging.getLogger(__name__)


@dataclass
class RouterConfig:
    """What a router replica needs to find and use the engines (all picklable)."""

    engine_actor_names: list[str]
    namespace: str
    # The engines' cluster-wide indexes, in engine_actor_names' order (their own ``engine`` metric
    # label; empty: 0, 1, ...): a model's engines need not be numbered from 0, nor one after another.
    engine_indexes: tuple[int, ...] = ()
    # Prefill/decode disaggregation: each engine's kv_role, in engine_actor_names' order (None: no KV
    # transfer; empty: read from the running engines).
    engine_kv_roles: tuple[str | None, ...] = ()
    routing_policy: str = "least_loaded"
    prefix_load_margin: int = 8
    # Prefill/decode disaggregation: prompts with at most this many tokens (or a block) outside their
    # decode engine's prefix cache are computed where they are decoded.
    pd_prefill_threshold: int = 0
    request_timeout_s: float | None = None
    served_model_name: str | None = None
    # Further names clients may use for the model (vLLM's --served-model-name with several names).
    served_model_aliases: tuple[str, ...] = ()
    # The model as the user gave it (--model): /v1/models' cards show it as their root, as vLLM's do.
    model: str | None = None
    chat_template: str | None = None  # replaces the model's own
    # --default-chat-template-kwargs: under each request's own chat_template_kwargs.
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # --enable-log-requests and --max-log-len: each engine request logged (its prompt only at DEBUG).
    enable_log_requests: bool = False
    max_log_len: int | None = None
    enable_log_outputs: bool = False
    tool_call_parser: str | None = None  # set: tool_choice "auto" is enabled, read with this parser
    reasoning_parser: str | None = None
    api_keys: tuple[str, ...] = ()
    enable_lora: bool = False
    allow_runtime_lora_updating: bool = False
    # POST /pause, /resume, /reset_prefix_cache, GET /is_paused (vLLM's VLLM_SERVER_DEV_MODE endpoints).
    server_dev_mode: bool = False
    # A request's own chat_template is run (vLLM's --trust-request-chat-template).
    trust_request_chat_template: bool = False
    # The Responses API's store (a named actor shared by the replicas); off: responses are not kept.
    enable_responses_store: bool = False
    # usage.prompt_tokens_details.cached_tokens in completions and chat.
    enable_prompt_tokens_details: bool = False
    # Tokens a streamed choice gathers between chunks after its first (vLLM's --stream-interval).
    stream_interval: int = 1
    responses_store_max_entries: int = 10_000
    # GET /load counts this replica's requests in progress; GET /tokenizer_info exists (vLLM's flags).
    enable_server_load_tracking: bool = False
    enable_tokenizer_info_endpoint: bool = False
    # CORS (--allowed-origins, ...): the app's, taken from the first model.
    cors: CORSSettings = field(default_factory=CORSSettings)
    enable_force_include_usage: bool = False
    structured_outputs_disable_any_whitespace: bool = False
    return_tokens_as_token_ids: bool = False
    exclude_tools_when_tool_choice_none: bool = False
    disable_fastapi_docs: bool = False
    response_role: str = "assistant"
    chat_template_content_format: str = "auto"
    # vLLM's --limit-mm-per-prompt (images per prompt, by modality) and --allowed-local-media-path.
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    allowed_local_media_path: str = ""
    mm_processor_cache_gb: float = 0.0
    allowed_media_domains: tuple[str, ...] = ()
    # vLLM's --media-io-kwargs (videos' frame sampling).
    media_io_kwargs: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


async def load_tokenizer_from_engine(handle: Any) -> tuple[Any, str]:
    """Fetch the tokenizer files from an engine, so this replica needs no copy of the model: the
    tokenizer, and the directory of the files (a vision-language model's image processor's too)."""
    files: dict[str, bytes] = await handle.get_tokenizer_files.remote()
    directory = tempfile.mkdtemp(prefix="llm-cluster-tokenizer-")
    write_tokenizer_files(directory, files)
    return load_tokenizer(directory), directory


def serving_settings(config: RouterConfig, descriptions: list[EngineDescription]) -> ServingSettings:
    """What the serving core needs to know: the router's flags, and the model as its engines describe
    it (the first engine's model facts; the engines' smallest context; a policy all of them share)."""
    first = descriptions[0]
    return ServingSettings(
        served_model_name=config.served_model_name or first.model_info.served_model_name,
        served_model_aliases=config.served_model_aliases,
        model_root=config.model or first.model_info.model_dir,
        max_model_len=min(d.scheduler_config["max_model_len"] for d in descriptions),
        block_size=first.block_size,
        scheduling_policy=first.scheduler_config["policy"]
        if all(d.scheduler_config["policy"] == first.scheduler_config["policy"] for d in descriptions) else "fcfs",
        request_timeout_s=config.request_timeout_s,
        eos_token_ids=first.model_info.eos_token_ids,
        default_sampling_params=first.model_info.default_sampling_params,
        max_logprobs=first.model_info.max_logprobs, vocab_size=first.model_info.vocab_size,
        hidden_size=first.model_info.hidden_size, input_embedding_size=first.model_info.input_embedding_size,
        pooling=first.model_info.pooling,
        tool_call_parser=config.tool_call_parser,
        reasoning_parser=config.reasoning_parser,
        api_keys=tuple(config.api_keys),
        allow_runtime_lora_updating=config.allow_runtime_lora_updating, server_dev_mode=config.server_dev_mode,
        trust_request_chat_template=config.trust_request_chat_template,
        enable_prompt_tokens_details=config.enable_prompt_tokens_details,
        stream_interval=config.stream_interval,
        enable_sleep_mode=all(d.enable_sleep_mode for d in descriptions),
        enable_prompt_embeds=all(d.enable_prompt_embeds for d in descriptions),
        enable_server_load_tracking=config.enable_server_load_tracking,
        enable_tokenizer_info_endpoint=config.enable_tokenizer_info_endpoint,
        cors=config.cors,
        enable_force_include_usage=config.enable_force_include_usage,
        structured_outputs_disable_any_whitespace=config.structured_outputs_disable_any_whitespace,
        return_tokens_as_token_ids=config.return_tokens_as_token_ids,
        exclude_tools_when_tool_choice_none=config.exclude_tools_when_tool_choice_none,
        disable_fastapi_docs=config.disable_fastapi_docs, response_role=config.response_role,
        chat_template_content_format=config.chat_template_content_format,
        default_chat_template_kwargs=dict(config.default_chat_template_kwargs),
        enable_log_requests=config.enable_log_requests, max_log_len=config.max_log_len,
        enable_log_outputs=config.enable_log_outputs,
        image_token_id=first.model_info.image_token_id, image_geometry=first.model_info.image_geometry,
        video_token_id=first.model_info.video_token_id,
        limit_mm_per_prompt=dict(config.limit_mm_per_prompt),
        allowed_local_media_path=config.allowed_local_media_path,
        mm_processor_cache_gb=config.mm_processor_cache_gb,
        allowed_media_domains=tuple(config.allowed_media_domains),
        media_io_kwargs=dict(config.media_io_kwargs),
    )


async def build_serving(config: RouterConfig, client_index: int | None = None) -> tuple[OpenAIServing, EngineClient]:
    """Connect to the engines by name and build the serving core (used by Serve and by plain uvicorn)."""
    names, namespace = config.engine_actor_names, config.namespace
    # (With engine autoscaling, slots beyond the engines running now are empty: None, found by name
    # once the autoscaler starts an engine there.)
    handles = [await asyncio.to_thread(named_actor, name, namespace) for name in names]
    running = [h for h in handles if h is not None]
    if not running:
        raise RuntimeError(f"none of the engines {names} runs in namespace {namespace!r}")
    descriptions = [await h.describe.remote() for h in running]
    first = descriptions[0]
    tokenizer, files_dir = await load_tokenizer_from_engine(running[0])
    if config.chat_template is not None:
        tokenizer.chat_template = config.chat_template
    # Each replica is a distinct client of every engine.
    client_index = random.getrandbits(31) if client_index is None else client_index
    client = EngineClient(handles, client_index,
                          resolve_handle=lambda i: named_actor(names[i], namespace))
    settings = serving_settings(config, descriptions)
    policy = create_routing_policy(config.routing_policy, len(handles), block_size=first.block_size,
                                   load_margin=config.prefix_load_margin,
                                   long_rope_after=first.model_info.long_rope_after,
                                   max_loras=max(d.max_loras for d in descriptions))
    if hasattr(policy, "forget_engine"):
        client.on_engine_restart = policy.forget_engine
    if hasattr(policy, "apply_kv_events"):  # each engine reports what its prefix cache holds
        client.on_kv_events = policy.apply_kv_events
    metrics = RouterMetrics(settings.served_model_name, replica=str(client_index),
                            engine_indexes=config.engine_indexes or tuple(range(len(config.engine_actor_names))))
    # Structured-output requests are checked with xgrammar: import it now (seconds), not on the event
    # loop under the first such request.
    with contextlib.suppress(ImportError):
        await asyncio.to_thread(importlib.import_module, "xgrammar")
    image_processor = None
    if settings.image_token_id is not None:  # (a vision-language model: its images are processed here)
        image_processor = await asyncio.to_thread(load_image_processor, files_dir)
        if image_processor is None:
            logger.warning("%s takes images, but its directory has no %s: requests with images are refused",
                           settings.served_model_name, IMAGE_PROCESSOR_FILE)
    await client.wait_connected()
    serving = OpenAIServing(settings, client, tokenizer, policy, metrics, image_processor=image_processor)
    by_slot = iter(descriptions)
    roles = config.engine_kv_roles or tuple(None if h is None else next(by_slot).kv_role for h in handles)
    serving.engine_roles = EngineRoles.from_kv_roles(roles)
    serving.pd_prefill_threshold = config.pd_prefill_threshold
    serving.kv_block_size = first.block_size
    if config.enable_lora:
        serving.list_loras = lambda: engine_loras(client)
        await serving.refresh_loras()
    return serving, client


async def engine_loras(client: EngineClient, timeout_s: float = 5.0) -> list[LoRARequest]:
    """The adapters loaded on any healthy engine (an engine restarted since a runtime load lacks it,
    and is given it again when a request needs it there)."""
    async def ask(engine: int) -> list[LoRARequest]:
        try:
            return await asyncio.wait_for(client.handle(engine).list_loras.remote(), timeout_s)
        except Exception as e:  # an engine that does not answer must not fail the lookup
            logger.warning("adapters of engine %d unavailable: %s", engine, e)
            return []

    # (All at once: one engine that does not answer costs the listing its timeout once, not per engine.)
    answers = await asyncio.gather(*(ask(engine) for engine, ok in enumerate(client.healthy()) if ok))
    found: dict[str, LoRARequest] = {}
    for loras in answers:
        for lora in loras:
            found.setdefault(lora.lora_name, lora)
    return list(found.values())


class RouterMetricsHub:
    """A named actor holding each router replica's latest exposition, so any replica can serve all."""

    def __init__(self) -> None:
        configure_actor_logging()
        self._texts: dict[str, tuple[bytes, float]] = {}

    def push(self, replica: str, text: bytes) -> None:
        self._texts[replica] = (text, time.time())

    def get_all(self, max_age_s: float = 120.0) -> list[bytes]:
        now = time.time()
        # A replica that stopped pushing (gone) drops out after max_age_s.
        self._texts = {r: v for r, v in self._texts.items() if now - v[1] <= max_age_s}
        return [text for text, _ in self._texts.values()]


METRICS_PUSH_INTERVAL_S = 1.0


METRICS_HUB_NAME = "llm-cluster-router-metrics"


def metrics_hub(namespace: str) -> Any:
    return ray.remote(RouterMetricsHub).options(
        name=METRICS_HUB_NAME, namespace=namespace, get_if_exists=True, lifetime="detached",
        num_cpus=0).remote()


# A scrape waits this long at most for one engine's series (or the hub's): Prometheus gives a whole
# scrape its interval (5 s in deploy/prometheus), and one slow or dying engine must not lose it all.
METRICS_CALL_TIMEOUT_S = 2.0


async def engine_metrics_texts(client: EngineClient) -> list[bytes]:
    """Every engine's exposition text, fetched from the engines themselves (same on every replica),
    all at once; an engine that fails or does not answer within METRICS_CALL_TIMEOUT_S is left out
    of this scrape."""
    engines = client.answering()
    results = await asyncio.gather(*(asyncio.wait_for(client.handle(engine).get_metrics_text.remote(),
                                                      METRICS_CALL_TIMEOUT_S) for engine in engines),
                                   return_exceptions=True)
    parts = []
    for engine, result in zip(engines, results, strict=True):
        if isinstance(result, BaseException):  # an engine dying mid-scrape must not fail the whole scrape
            logger.warning("metrics of engine %d unavailable: %s", engine,
                           "no answer in time" if isinstance(result, TimeoutError) else result)
        else:
            parts.append(result)
    return parts


@serve.ingress()
class OpenAIRouter:
    """``config``: the first (default) model's routing; ``more_models``: each further served model's,
    on its own engines (one EngineClient and serving per model in every replica)."""

    async def __init__(self, config: RouterConfig, more_models: list[RouterConfig] | None = None) -> None:
        configure_actor_logging()
        self.config = config
        client_index = random.getrandbits(31)  # one client of every engine, whichever model it serves
        built = [await build_serving(c, client_index) for c in [config, *(more_models or [])]]
        self.servings = [serving for serving, _ in built]
        self.clients = [client for _, client in built]
        self.serving, self.client = built[0]
        self.metrics = self.serving.metrics
        self.hub = metrics_hub(config.namespace)
        self.response_store = (ActorResponseStore(config.namespace, config.responses_store_max_entries)
                               if config.enable_responses_store else None)
        # Wait for the hub actor (started by the first replica) before reporting ready: its start
        # costs seconds of CPU, better spent before traffic than under it.
        await self.hub.push.remote(self.metrics.replica, self._render_own())
        self._push_task = detached_task(self._push_metrics())
        self._shared_render = SharedRun(self._render_metrics)

    def _render_own(self) -> bytes:
        if len(self.servings) == 1:
            return self.metrics.render()
        return merge_expositions(serving.metrics.render() for serving in self.servings)

    async def _push_metrics(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.hub.push.remote(self.metrics.replica, self._render_own())
            await asyncio.sleep(METRICS_PUSH_INTERVAL_S)

    async def render_metrics(self) -> bytes:
        """Every replica's router series (via the hub) and every engine's series, as one exposition.
        Scrapes that come while one is being rendered share it (one round of actor calls)."""
        return await self._shared_render()

    async def _render_metrics(self) -> bytes:
        own = self._render_own()
        try:
            await asyncio.wait_for(self.hub.push.remote(self.metrics.replica, own), METRICS_CALL_TIMEOUT_S)
            router_texts = await asyncio.wait_for(self.hub.get_all.remote(), METRICS_CALL_TIMEOUT_S)
        except Exception as e:
            logger.warning("router metrics hub unavailable: %s", e)
            router_texts = [own]
        engine_texts = [text for client in self.clients for text in await engine_metrics_texts(client)]
        return merge_expositions([*router_texts, *engine_texts])

    def __serve_build_asgi_app__(self):
        return create_app(self.servings, render_metrics=self.render_metrics, response_store=self.response_store)
