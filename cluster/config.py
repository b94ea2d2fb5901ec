"""User-facing cluster configuration (pydantic): defaults plus per-engine overrides.

A cluster is a list of engines that may differ in flags. ``engine_configs()`` turns it into the
engine's frozen ``EngineConfig``s, raising ``ValueError`` that names the flag and the engine before
anything starts. One endpoint may serve several models (``models``): each has engines of its own,
numbered after the first model's.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from engine_core.config import (
    EngineConfig,
    KVCacheDType,
    LogprobsMode,
    LoRAConfig,
    MambaCacheDType,
    MambaCacheMode,
    SchedulerConfig,
    SpeculativeConfig,
    layer_partition_from_env,
)
from engine_core.kv_transfer import KVTransferConfig
from engine_core.lora import LoRAModule, parse_lora_module, static_lora_requests
from router.multimodal import DEFAULT_LIMIT_PER_PROMPT, DEFAULT_PROCESSOR_CACHE_GB, MODALITIES
from router.reasoning_parsers import REASONING_PARSERS
from router.routing import ROUTING_POLICIES
from router.tool_parsers import TOOL_CALL_PARSERS
from router.video import video_sampling_from

SCHEDULER_FLAGS = ("max_num_seqs", "max_num_batched_tokens", "max_num_scheduled_tokens", "max_model_len",
                   "enable_chunked_prefill", "long_prefill_token_threshold", "max_num_partial_prefills",
                   "max_long_partial_prefills")

logger = logging.getLogger(__name__)


class EngineSpec(BaseModel):
    """Flags of one engine. Unset fields inherit the cluster's defaults."""

    model_config = ConfigDict(extra="forbid")

    max_num_seqs: int | None = Field(None, description="Admission cap on running requests (--max-num-seqs).")
    max_num_batched_tokens: int | None = Field(None, description="Token budget per pass.")
    max_num_scheduled_tokens: int | None = Field(None, description="Outranks max_num_batched_tokens when set.")
    max_model_len: int | None = Field(None, description="Context length (prompt + output); None: the model's.")
    enable_chunked_prefill: bool | None = None
    long_prefill_token_threshold: int | None = Field(None, description="Per-request clamp per pass (0: off).")
    max_num_partial_prefills: int | None = None
    max_long_partial_prefills: int | None = None
    disable_chunked_mm_input: bool | None = Field(
        None, description="A prefill chunk never ends inside an image's placeholders (--disable-chunked-mm-input).")
    scheduling_policy: Literal["fcfs", "priority"] | None = None
    block_size: int | None = None
    enable_prefix_caching: bool | None = None
    num_gpu_blocks: int | None = Field(None, description="Explicit KV pool size in blocks.")
    kv_cache_memory_bytes: int | None = Field(None, description="KV budget in bytes (CPU).")
    gpu_memory_utilization: float | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = Field(
        None, ge=1, description="vLLM's --pipeline-parallel-size: the model's layers split into this many stages, "
                                "each stage a tensor-parallel group (workers per engine = TP x PP).")
    device: Literal["auto", "cpu", "cuda"] | None = None
    dtype: str | None = None
    kv_cache_dtype: KVCacheDType | None = Field(
        None, description="KV cache storage dtype (--kv-cache-dtype): auto is the model's; fp8 stores one byte "
                          "per element, for 2x (bf16 models) or 4x (fp32) the blocks in the same memory.")
    mamba_cache_dtype: MambaCacheDType | None = Field(
        None, description="Models with recurrent layers (Mamba, Mamba-2, Gated DeltaNet, Kimi Delta "
                          "Attention, lightning attention, short convolutions): the storage dtype of their "
                          "per-request conv and recurrent states (--mamba-cache-dtype); auto: the conv state in "
                          "the model's dtype, the recurrent state in float32.")
    mamba_ssm_cache_dtype: MambaCacheDType | None = Field(
        None, description="The recurrent (SSM) state's storage dtype alone (--mamba-ssm-cache-dtype); auto: as "
                          "mamba_cache_dtype says. bfloat16 halves the states' memory.")
    mamba_cache_mode: MambaCacheMode | None = Field(
        None, description="What the prefix cache keeps of recurrent layers (--mamba-cache-mode): none (prefix "
                          "caching off for such models) or align (their states at the block boundaries worth "
                          "keeping that the passes cross).")
    mamba_prefix_cache_slots: int | None = Field(
        None, ge=1, description="Under mamba_cache_mode align: how many recurrent states the prefix cache keeps "
                                "(--mamba-prefix-cache-slots); default max_num_seqs.")
    enable_expert_parallel: bool | None = Field(
        None, description="Mixture-of-experts models: each TP rank holds num_experts / tp whole experts "
                          "(--enable-expert-parallel) instead of a slice of every expert.")
    runner: Literal["auto", "generate", "pooling"] | None = Field(
        None, description="pooling: embeddings only, no LM head (--runner); auto: pooling for a bare-decoder "
                          "checkpoint such as e5-mistral's MistralModel, generate otherwise.")
    pooler_config: dict[str, Any] | None = Field(
        None, description='How embeddings pool (--pooler-config): {"pooling_type": "LAST" | "MEAN" | "CLS" | "ALL" | '
                          '"STEP", "normalize": bool, "step_tag_id": int, "returned_token_ids": [int]}, over the '
                          'checkpoint\'s sentence-transformers files.')
    hf_overrides: dict[str, Any] | None = Field(
        None, description="Keys set over the model's config.json (--hf-overrides), e.g. "
                          '{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": '
                          '["no", "yes"]} to serve Qwen3-Reranker as a cross-encoder.')
    mm_processor_kwargs: dict[str, Any] | None = Field(
        None, description="Settings over the model's image processor config (--mm-processor-kwargs): Qwen2-VL's "
                          '{"min_pixels": int, "max_pixels": int}, the range each image is resized into (its '
                          "tokens are its pixels / 784).")
    generation_config: str | None = Field(
        None, description="Where requests' default sampling parameters come from (--generation-config): auto (the "
                          "model's generation_config.json, as vLLM), vllm (none: neutral defaults), or a folder "
                          "holding a generation_config.json.")
    override_generation_config: dict[str, Any] | None = Field(
        None, description='Default sampling parameters set over the generation config\'s '
                          '(--override-generation-config), e.g. {"temperature": 0.5, "max_new_tokens": 512}.')
    disable_log_stats: bool | None = Field(
        None, description="No engine metrics (vllm:*) and no periodic stats line in the engine's log "
                          "(--disable-log-stats, as vLLM's).")
    max_logprobs: int | None = Field(
        None, ge=-1, description="The most logprobs (and prompt logprobs) a request may ask for per token "
                                 "(--max-logprobs, default 20; -1: the whole vocabulary).")
    logprobs_mode: LogprobsMode | None = Field(
        None, description="What the sampled tokens' logprobs are (--logprobs-mode, as vLLM's): raw_logprobs (the "
                          "default: the model's own distribution), raw_logits (its logits), processed_logprobs or "
                          "processed_logits (those the token is drawn from: after penalties, logit_bias, "
                          "temperature, min_p, top_k and top_p). Prompt logprobs are always raw.")
    kv_offloading_size: float | None = Field(
        None, gt=0, description="KV offloading (--kv-offloading-size, GiB for all TP ranks together): prefix-cache "
                                "blocks evicted from the KV cache are kept in host memory and copied back when a "
                                "prompt needs them (vLLM's native CPU backend).")
    kv_transfer_config: dict[str, Any] | None = Field(
        None, description='Prefill/decode disaggregation (--kv-transfer-config, vLLM\'s JSON): {"kv_connector": '
                          '"RayKVConnector" (NixlConnector is taken as it), "kv_role": "kv_producer" | "kv_consumer" | '
                          '"kv_both", "kv_load_failure_policy": "recompute" | "fail", "kv_connector_extra_config": '
                          '{"abort_request_timeout": seconds, "load_timeout": seconds}}. With producers and consumers '
                          'among a model\'s engines, '
                          'the router computes each prompt on a producer and decodes it on a consumer.')
    kv_offloading_backend: Literal["native"] | None = Field(
        None, description="The offloading backend (--kv-offloading-backend): native (host memory), the only one built.")
    logits_processors: list[str] | None = Field(
        None, description="Custom logits processors (--logits-processors): qualified names of "
                          "engine_core.logits_processor.LogitsProcessor subclasses (package.module:Class), run at "
                          "every step; requests pass them arguments in vllm_xargs.")
    placement_strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] | None = None
    num_cpus_per_worker: float | None = None
    resources: dict[str, float] | None = Field(None, description="Extra Ray resources per worker (pinning).")
    node_labels: dict[str, str] | None = Field(None, description="Ray node labels the workers must run on.")
    executor_backend: Literal["auto", "uni", "ray"] | None = None
    max_waiting_requests: int | None = Field(None, description="Queue limit before requests get HTTP 429.")
    engine_niceness: int | None = Field(None, description="Niceness added to the engine's compute threads "
                                        "(default: 4 on CPU engines, 0 on GPU engines).")
    kv_cache_metrics: bool | None = Field(
        None, description="Follow a sample of KV blocks from allocation to eviction: the vllm:kv_block_* "
                          "residency histograms (--kv-cache-metrics).")
    kv_cache_metrics_sample: float | None = Field(
        None, gt=0, le=1, description="The share of blocks followed (--kv-cache-metrics-sample, default 0.01).")
    disable_hybrid_kv_cache_manager: bool | None = Field(
        None, description="A model mixing full-attention and windowed layers keeps every block of a request in its "
                          "windowed layers too, as in its full ones (--disable-hybrid-kv-cache-manager; by default "
                          "the windowed layers' blocks behind the window are released).")
    enable_sleep_mode: bool | None = Field(
        None, description="Allow sleep (release the KV cache, and offload or discard the weights) and wake_up "
                          "(--enable-sleep-mode; the operators' endpoints need server_dev_mode).")
    enable_prompt_embeds: bool | None = Field(
        None, description="Completions may give their prompts as embeddings (prompt_embeds: base64 of a torch.save-d "
                          "[tokens, hidden_size] tensor) instead of text or token ids (--enable-prompt-embeds).")
    speculative_config: dict[str, Any] | None = Field(
        None, description='Speculative decoding, as vLLM: {"method": "ngram", "num_speculative_tokens": 3, '
                          '"prompt_lookup_max": 4, "prompt_lookup_min": 2}.')


_DEFAULTS = EngineSpec(
    max_num_seqs=256, max_num_batched_tokens=None, max_model_len=None, enable_chunked_prefill=True,
    long_prefill_token_threshold=0, max_num_partial_prefills=1, max_long_partial_prefills=1,
    disable_chunked_mm_input=False, scheduling_policy="fcfs", block_size=16, enable_prefix_caching=True,
    gpu_memory_utilization=0.9,
    tensor_parallel_size=1, pipeline_parallel_size=1, device="auto", dtype="auto", kv_cache_dtype="auto",
    mamba_cache_dtype="auto", mamba_ssm_cache_dtype="auto", mamba_cache_mode="none", enable_expert_parallel=False,
    runner="auto", generation_config="auto", max_logprobs=20, logprobs_mode="raw_logprobs", disable_log_stats=False,
    placement_strategy="PACK", num_cpus_per_worker=1.0, kv_cache_metrics=False,
    kv_cache_metrics_sample=0.01, disable_hybrid_kv_cache_manager=False, enable_sleep_mode=False,
    enable_prompt_embeds=False,
    executor_backend="auto", max_waiting_requests=0)


# Where the API key comes from when the CLI's --api-key or the Serve config's api_keys is not given
# (a key in the environment stays out of `ps` and of config files).
API_KEY_ENV = "LLM_CLUSTER_API_KEY"
# vLLM's variable, read when ours is not set: a server moved from vLLM keeps its key.
VLLM_API_KEY_ENV = "VLLM_API_KEY"


def env_switch(name: str) -> bool:
    """A vLLM environment switch that sets a default ("1" or "true")."""
    return os.environ.get(name, "").lower() in ("1", "true")


def _resolve_specs(defaults: dict[str, Any], num_engines: int, engines: list[EngineSpec]) -> list[EngineSpec]:
    """Each engine's flags: ``defaults`` under its own overrides (the list may set the count)."""
    return [EngineSpec(**(defaults | (engines[i].model_dump(exclude_none=True) if i < len(engines) else {})))
            for i in range(max(num_engines, len(engines)))]


def _check_engines(settings: ClusterConfig | ServedModel, where: str) -> None:
    """A model's engine count against its per-engine entries and, with engine autoscaling, its bounds
    (num_engines, how many start, defaults to min_engines)."""
    scaling, engines = settings.engine_autoscaling, settings.engines
    if scaling is None:
        # Without num_engines the override list sets the count; with it, extra entries are an error
        # (they would start engines nobody asked for).
        if "num_engines" in settings.model_fields_set and len(engines) > settings.num_engines:
            raise ValueError(f"{where}engines has {len(engines)} per-engine entries but num_engines is "
                             f"{settings.num_engines}")
        return
    if "num_engines" not in settings.model_fields_set:
        object.__setattr__(settings, "num_engines", scaling.min_engines)
    if not scaling.min_engines <= settings.num_engines <= scaling.max_engines:
        raise ValueError(f"{where}num_engines ({settings.num_engines}) must be between engine_autoscaling's "
                         f"min_engines ({scaling.min_engines}) and max_engines ({scaling.max_engines})")
    if len(engines) > scaling.max_engines:
        raise ValueError(f"{where}engines has {len(engines)} per-engine entries but engine_autoscaling's "
                         f"max_engines is {scaling.max_engines}")


def _slot_count(settings: ClusterConfig | ServedModel) -> int:
    """A model's engine slots: its engines (num_engines, or more per-engine entries), or with engine
    autoscaling, max_engines (per-engine entries never exceed it)."""
    scaling = settings.engine_autoscaling
    return max(settings.num_engines if scaling is None else scaling.max_engines, len(settings.engines))


def _check_uniform_slots(specs: list[EngineSpec], where: str) -> None:
    """An autoscaled model's slots must agree on what its routers read from the engines running when
    they start: an engine started later in another slot must not differ, or the router would accept
    what that engine refuses."""
    for field in ("max_model_len", "scheduling_policy", "enable_sleep_mode"):
        values = {getattr(spec, field) for spec in specs}
        if len(values) > 1:
            raise ValueError(f"{where}with engine_autoscaling, {field} must be the same on every engine (the "
                             f"engines have {sorted(map(str, values))}); set it for all of them, not per engine")


@dataclass(frozen=True)
class ScaledModel:
    """One model's autoscaled engines, as the autoscaler (cluster.autoscaler) scales them."""

    name: str
    # Its engine slots (engine indexes), the lowest first.
    indexes: tuple[int, ...]
    policy: EngineAutoscaling


def _check_output_parsers(tool_call_parser: str | None, reasoning_parser: str | None,
                          enable_auto_tool_choice: bool, where: str = "") -> None:
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"{where}tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"{where}reasoning_parser must be one of {', '.join(REASONING_PARSERS)}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError(f"{where}enable_auto_tool_choice needs tool_call_parser (the model's tool-call format)")


class LoRASettings(BaseModel):
    """The LoRA adapters one served model's engines hold (vLLM's flags), for the first model (top level
    of ``ClusterConfig``) and for each of ``models``."""

    model_config = ConfigDict(extra="forbid")

    enable_lora: bool = Field(False, description="Serve LoRA adapters (named by clients as the model).")
    lora_modules: list[str | dict[str, str]] = Field(
        default_factory=list, description='Adapters to load at start: "name=path" or {"name": ..., "path": ...}.')
    max_loras: int = Field(1, ge=1, description="Most different adapters in one batch.")
    max_lora_rank: int = Field(16, ge=1, description="Largest adapter rank served.")
    max_cpu_loras: int | None = Field(None, ge=1, description="Adapters kept in the workers' memory (>= "
                                      "max_loras; the least recently used are read again when needed). "
                                      "None: max_loras, as vLLM.")

    @model_validator(mode="after")
    def _lora_settings(self) -> LoRASettings:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras (--max-cpu-loras, {self.max_cpu_loras}) must be at least max_loras "
                             f"(--max-loras, {self.max_loras})")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules need enable_lora (--enable-lora, or the model's enable_lora)")
        static_lora_requests(self.lora_module_list())  # names must be unique
        return self

    def lora_module_list(self) -> list[LoRAModule]:
        return [parse_lora_module(m) if isinstance(m, str) else parse_lora_module(json.dumps(m))
                for m in self.lora_modules]

    def lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                          max_cpu_loras=self.max_cpu_loras, lora_modules=tuple(self.lora_module_list()))


def served_model_names(served_model_name: str | list[str] | None, model: str) -> list[str]:
    """The names clients may use for a model (vLLM's --served-model-name takes several): the first is
    the one responses, /v1/models' first card and the metrics carry; none given: the model's own."""
    if served_model_name is None:
        return [default_served_name(model)]
    return [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)


def default_served_name(model: str) -> str:
    """The name the engines serve a model under when none is given (gpu_worker.model_resolver): a
    GGUF file's stem, a directory's name, a known model's name as given. Read from ``model`` alone
    where it is an absolute path (the engines' disk need not be this machine's)."""
    model = model.strip()
    path = Path(model.rstrip("/")).expanduser()
    if path.suffix.lower() == ".gguf":
        return path.stem
    if path.is_absolute() or path.exists():
        return path.resolve().name
    return model


def _check_served_model_name(value: str | list[str] | None) -> str | list[str] | None:
    if value is None or value == "":  # (an empty name: the model's own, as before lists were taken)
        return None
    names = [value] if isinstance(value, str) else value
    if not names or any(not name.strip() for name in names):
        raise ValueError("served_model_name must be a name or a non-empty list of names, none of them empty")
    if len(set(names)) < len(names):
        raise ValueError(f"served_model_name lists a name twice: {names}")
    return names[0] if len(names) == 1 else list(names)


# Arguments the server passes to every chat template render itself (or that a request's own fields
# set): a default of one of them would clash with it on every request.
RENDER_ARGUMENTS = ("add_generation_prompt", "continue_final_message", "tokenize", "conversation", "chat_template",
                    "tools")


def _check_default_chat_template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    clashing = sorted(set(value or ()) & set(RENDER_ARGUMENTS))
    if clashing:
        raise ValueError(f"default_chat_template_kwargs may not set {', '.join(clashing)}: the server passes "
                         "it to every render (from the request's own fields)")
    return value


def _check_limit_mm_per_prompt(value: dict[str, int]) -> dict[str, int]:
    for modality, limit in value.items():
        if modality not in MODALITIES:
            raise ValueError(f"limit_mm_per_prompt: {modality!r} is not a modality ({', '.join(MODALITIES)})")
        if limit < 0:
            raise ValueError(f"limit_mm_per_prompt: the limit of {modality} must be >= 0, got {limit}")
    return value


SERVED_MODEL_NAME_HELP = ("Name clients use, or several (aliases: a request may name any; responses and metrics "
                          "carry the first); defaults to the model's.")


class ModelSettings(LoRASettings):
    """What each served model has of its own, the first (the top level of ``ClusterConfig``) and each
    of ``models``: its names, chat template and its defaults, tokenizer, and LoRA adapters (the
    ``LoRASettings`` fields). ``model`` is each subclass's."""

    model: str
    served_model_name: str | list[str] | None = Field(None, description=SERVED_MODEL_NAME_HELP)
    chat_template: str | None = Field(None, description="Jinja chat template replacing the model's own.")
    default_chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='Keyword arguments every chat template render gets unless the request sets them '
                          '(--default-chat-template-kwargs), e.g. {"enable_thinking": false} for Qwen3.')
    tokenizer: str | None = Field(
        None, description="A Hugging Face tokenizer directory used instead of the model's own (--tokenizer), e.g. "
                          "a GGUF model's original tokenizer and chat template; this model's alone.")
    limit_mm_per_prompt: dict[str, int] = Field(
        default_factory=dict, description=f"A vision-language model's most images (by modality) in one prompt "
                                          f'(--limit-mm-per-prompt), e.g. {{"image": 2}}; a modality not named: '
                                          f'{DEFAULT_LIMIT_PER_PROMPT}, as vLLM. {{"image": 0}}: its language model '
                                          f"alone (vLLM's text-only mode: the vision tower is not loaded).")

    @property
    def language_model_only(self) -> bool:
        """Whether no prompt may hold images: the engines load the language model alone (unless the
        model takes videos and videos are allowed: ``videos_refused``)."""
        return self.limit_mm_per_prompt.get("image") == 0

    @property
    def videos_refused(self) -> bool:
        return self.limit_mm_per_prompt.get("video") == 0

    _served_model_name = field_validator("served_model_name")(_check_served_model_name)
    _chat_template_kwargs = field_validator("default_chat_template_kwargs")(_check_default_chat_template_kwargs)
    _limit_mm_per_prompt = field_validator("limit_mm_per_prompt")(_check_limit_mm_per_prompt)

    @property
    def served_names(self) -> list[str]:
        """This model's names, the first the one answers carry."""
        return served_model_names(self.served_model_name, self.model)


class EngineAutoscaling(BaseModel):
    """Engine autoscaling (cluster.autoscaler): between ``min_engines`` and ``max_engines`` engines,
    as many as keep each at about ``target_ongoing_requests`` requests (running and waiting), as
    Ray Serve sizes a deployment by its replicas' ongoing requests."""

    model_config = ConfigDict(extra="forbid")

    min_engines: int = Field(1, ge=1, description="Engines kept however idle the cluster is.")
    max_engines: int = Field(..., ge=1, description="Engines at most (the slots routers watch for).")
    target_ongoing_requests: float = Field(
        8.0, gt=0, description="Requests (running and waiting) per engine the autoscaler aims at.")
    upscale_delay_s: float = Field(5.0, ge=0, description="How long more engines must be wanted before one starts.")
    downscale_delay_s: float = Field(60.0, ge=0,
                                     description="How long fewer engines must be wanted before one is drained.")
    drain_grace_s: float = Field(
        2.0, ge=0, description="A drained engine stops once it has held no request for this long (routers told "
                               "to send it nothing may still have sent one on its way).")
    interval_s: float = Field(1.0, gt=0, description="How often the engines' load is read (with several autoscaled "
                                                     "models: the shortest of theirs, for all).")
    look_back_period_s: float = Field(
        10.0, ge=0, description="The load the decision reads is the ongoing requests over this window, aggregated "
                                "(Serve's look_back_period_s): one round's spike or lull alone does not count. "
                                "0: each round's reading alone.")
    aggregation_function: Literal["mean", "max", "min"] = Field(
        "mean", description="How the window's readings aggregate (Serve's aggregation_function).")

    @model_validator(mode="after")
    def _bounds(self) -> EngineAutoscaling:
        _check_min_max("engine_autoscaling", "engines", self.min_engines, self.max_engines)
        return self


class ServedModel(ModelSettings):
    """Another model served through the same endpoint (``ClusterConfig.models``), on engines of its
    own; clients pick it by its name in ``model``. Engine flags: the cluster's ``defaults``, then
    this model's ``defaults``, then its per-engine entries. Its LoRA adapters are its own, named as a
    model by clients as the first model's are."""

    model: str = Field(..., description="Model name, HF directory or .gguf file.")
    num_engines: int = Field(1, ge=1, description="Engines (with engine_autoscaling: how many start).")
    defaults: EngineSpec = Field(default_factory=EngineSpec, description="Flags of this model's engines.")
    engines: list[EngineSpec] = Field(default_factory=list, description="Per-engine overrides, by position.")
    engine_autoscaling: EngineAutoscaling | None = Field(
        None, description="Scale this model's engines with its load, apart from the other models' engines.")
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    @model_validator(mode="after")
    def _checks(self) -> ServedModel:
        where = f"models[{self.served_names[0]}]."
        _check_output_parsers(self.tool_call_parser, self.reasoning_parser, self.enable_auto_tool_choice, where)
        _check_engines(self, where)
        return self


def _check_min_max(section: str, kind: str, low: int, high: int) -> None:
    if high < low:
        raise ValueError(f"{section}: max_{kind} ({high}) is below min_{kind} ({low})")


class RouterAutoscaling(BaseModel):
    """Router replica autoscaling, done by Ray Serve itself (its deployment ``autoscaling_config``):
    replicas between ``min_replicas`` and ``max_replicas``, as many as keep each at about
    ``target_ongoing_requests`` open requests (a streamed answer is open until its last chunk)."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=1, description="Replicas kept however idle (at least one: it is the ingress).")
    max_replicas: int = Field(..., ge=1, description="Replicas at most.")
    target_ongoing_requests: float = Field(
        128.0, gt=0, description="Open requests per replica Serve aims at (each replica takes up to 1024).")
    upscale_delay_s: float = Field(30.0, ge=0, description="How long more replicas must be wanted (Serve's).")
    downscale_delay_s: float = Field(600.0, ge=0, description="How long fewer replicas must be wanted (Serve's).")
    graceful_shutdown_timeout_s: float = Field(
        600.0, ge=0, description="How long a replica Serve scales away may finish its open requests (streams "
                                 "included) before it is stopped (Serve's default, 20 s, would cut long answers).")

    @model_validator(mode="after")
    def _bounds(self) -> RouterAutoscaling:
        _check_min_max("router_autoscaling", "replicas", self.min_replicas, self.max_replicas)
        return self

    def serve_config(self, initial_replicas: int | None) -> dict[str, Any]:
        """Ray Serve's ``autoscaling_config`` for the router deployment."""
        return (self.model_dump(exclude={"graceful_shutdown_timeout_s"})
                | ({} if initial_replicas is None else {"initial_replicas": initial_replicas}))


def default_api_keys() -> list[str]:
    key = os.environ.get(API_KEY_ENV) or os.environ.get(VLLM_API_KEY_ENV)
    return [key] if key else []


class ClusterConfig(ModelSettings):
    """The whole deployment: the first (default) model with its engines, router settings and LoRA
    adapters (the ``ModelSettings`` fields), and any further ``models``."""

    model: str = Field("SmolLM2-135M-Instruct", description="Model name, HF directory or .gguf file.")
    num_engines: int = Field(1, ge=1, description="Engines (each: one scheduler + one worker group).")
    defaults: EngineSpec = Field(default_factory=EngineSpec, description="Flags every engine starts from.")
    engines: list[EngineSpec] = Field(default_factory=list, description="Per-engine overrides, by position.")
    routing_policy: str = Field("least_loaded", description=f"One of {', '.join(ROUTING_POLICIES)}.")
    prefix_load_margin: int = Field(8, ge=0, description="prefix_aware: load gap that overrides a cache match.")
    pd_prefill_threshold: int = Field(
        0, ge=0, description="Prefill/decode disaggregation: a prompt goes to a prefill engine only when more than "
                             "this many of its tokens (and more than a block) are not in its decode engine's prefix "
                             "cache as the router knows it (prefix_aware); others are computed where they are "
                             "decoded (llm-d's selective P/D).")
    num_router_replicas: int = Field(1, ge=1, description="Router replicas (with router_autoscaling: how many start).")
    router_autoscaling: RouterAutoscaling | None = Field(
        None, description="Let Ray Serve scale the router replicas with the open requests.")
    engine_autoscaling: EngineAutoscaling | None = Field(
        None, description="Scale the first model's engines with its load: num_engines is how many start "
                          "(default min_engines); engines holds flags for up to max_engines slots. (Each of "
                          "models may have its own.)")
    request_timeout_s: float | None = Field(None, gt=0)
    trust_request_chat_template: bool = Field(
        False, description="Run a request's own chat_template (vLLM's --trust-request-chat-template); else a 400.")
    allowed_local_media_path: str = Field(
        "", description="Images given as file:// URLs are read from under this directory of the router replicas' "
                        "machines, and no other (vLLM's --allowed-local-media-path; default: none are).")
    media_io_kwargs: dict[str, Any] = Field(
        default_factory=dict, description='How videos\' frames are sampled (vLLM\'s --media-io-kwargs): '
                                          '{"video": {"num_frames": N}} (N evenly spaced) or {"video": {"fps": F}} '
                                          '(F a second; default 2, as Qwen2-VL\'s processor).')
    allowed_media_domains: list[str] = Field(
        default_factory=list, description="The hosts http(s) image URLs may name (vLLM's --allowed-media-domains; "
                                          "exact names; default: any). With a list, redirects are not followed.")
    mm_processor_cache_gb: float = Field(
        DEFAULT_PROCESSOR_CACHE_GB, ge=0,
        description="GiB of processed images each router replica keeps, so an image sent again is not decoded and "
                    "resized again (vLLM's --mm-processor-cache-gb; 0: none kept).")
    enable_log_requests: bool = Field(False, description="Log each request's prompt and parameters as it goes to an "
                                                         "engine (--enable-log-requests).")
    max_log_len: int | None = Field(None, ge=0, description="Characters of a logged prompt or output (and token "
                                                           "ids) kept (--max-log-len; default: all).")
    enable_log_outputs: bool = Field(False, description="Log each finished answer's text, token ids and finish "
                                                        "reason (--enable-log-outputs).")
    enable_auto_tool_choice: bool = Field(False, description='Allow tool_choice "auto" (needs tool_call_parser).')
    tool_call_parser: str | None = Field(
        None, description=f"The model's tool-call format: {', '.join(TOOL_CALL_PARSERS)}.")
    api_keys: list[str] = Field(default_factory=list, description="Bearer keys /v1 requests need (none: open).")
    reasoning_parser: str | None = Field(
        None, description=f"Chat answers' thinking to reasoning_content: {', '.join(REASONING_PARSERS)}.")
    enable_access_log: bool = Field(True, description="Router replicas log one line per request (Serve's access "
                                                       "log); 10-19% of a replica's CPU per streamed request.")
    allow_runtime_lora_updating: bool | None = Field(
        None, description="Enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (for every model "
                          "with enable_lora). Default: $VLLM_ALLOW_RUNTIME_LORA_UPDATING, as vLLM, where a "
                          "model has enable_lora (without one the variable is ignored, with a warning).")
    server_dev_mode: bool = Field(
        default_factory=lambda: env_switch("VLLM_SERVER_DEV_MODE"),
        description="Enable the operators' endpoints POST /pause, /resume, /reset_prefix_cache and GET "
                    "/is_paused, acting on every engine (default: $VLLM_SERVER_DEV_MODE, as vLLM). With "
                    "api_keys they need a key, as /v1 does.")
    enable_responses_store: bool = Field(
        default_factory=lambda: env_switch("VLLM_ENABLE_RESPONSES_API_STORE"),
        description="Keep Responses API responses (store: true) for GET/DELETE /v1/responses/{id} and "
                    "previous_response_id (default: $VLLM_ENABLE_RESPONSES_API_STORE, as vLLM).")
    enable_server_load_tracking: bool = Field(
        False, description="GET /load answers the requests each router replica is answering (vLLM's; "
                           "else 0).")
    enable_tokenizer_info_endpoint: bool = Field(
        False, description="Enable GET /tokenizer_info: the tokenizer's configuration and chat template (vLLM's).")
    # CORS, as vLLM's flags (open by default, as vLLM's): what browsers on other origins may call.
    allowed_origins: list[str] = Field(["*"], description="Origins browsers may call from (--allowed-origins).")
    allowed_methods: list[str] = Field(["*"], description="Methods allowed across origins (--allowed-methods).")
    allowed_headers: list[str] = Field(["*"], description="Request headers allowed across origins "
                                                          "(--allowed-headers).")
    allow_credentials: bool = Field(False, description="Allow credentials across origins (--allow-credentials).")
    enable_force_include_usage: bool = Field(
        False, description="Every streamed answer ends with a usage chunk, asked for or not "
                           "(--enable-force-include-usage).")
    structured_outputs_disable_any_whitespace: bool = Field(
        False, description="JSON constraints leave out optional whitespace, in every request (vLLM's "
                           "--structured-outputs-config disable_any_whitespace).")
    return_tokens_as_token_ids: bool = Field(
        False, description="Logprobs name tokens token_id:N for every request (--return-tokens-as-token-ids).")
    exclude_tools_when_tool_choice_none: bool = Field(
        False, description="tool_choice none: the chat template is not shown the tools "
                           "(--exclude-tools-when-tool-choice-none).")
    disable_fastapi_docs: bool = Field(False, description="No /docs, /redoc or /openapi.json (--disable-fastapi-docs).")
    response_role: str = Field("assistant", min_length=1, description="The role of chat answers to a prompt that "
                                                                      "opens the assistant's turn (--response-role).")
    chat_template_content_format: Literal["auto", "string", "openai"] = Field(
        "auto", description="Message content as the chat template wants it: text, or OpenAI's list of parts; auto "
                            "reads the template (--chat-template-content-format).")
    responses_store_max_entries: int = Field(10_000, ge=1, description="Most responses kept (least recently "
                                                                        "used forgotten first).")
    models: list[ServedModel] = Field(
        default_factory=list, description="More models served through the same endpoint, each on engines of "
                                          "its own, with LoRA adapters of its own.")
    enable_prompt_tokens_details: bool = Field(
        False, description="usage.prompt_tokens_details.cached_tokens: the prompt tokens found in the engines' "
                           "prefix caches (vLLM's --enable-prompt-tokens-details).")
    stream_interval: int = Field(
        1, ge=1, description="Streamed answers: the first tokens go at once, then a chunk per this many new "
                             "tokens (and the last); larger values cost less CPU per request (vLLM's "
                             "--stream-interval).")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    address: str | None = Field(None, description="Existing Ray cluster address; local Ray when unset.")
    namespace: str = "llm-cluster"
    seed: int = Field(0, description="Every engine's random state starts from it (vLLM's --seed).")

    @model_validator(mode="after")
    def _output_parsers(self) -> ClusterConfig:
        _check_output_parsers(self.tool_call_parser, self.reasoning_parser, self.enable_auto_tool_choice)
        for i, m in enumerate((self, *self.models)):
            # (A path is read before: by the CLI, or by build_app for a Serve config.)
            if m.chat_template is not None and not _is_jinja(m.chat_template):
                where = "chat_template" if i == 0 else f"models[{i - 1}].chat_template"
                raise ValueError(f"{where}: {m.chat_template!r} is no Jinja template (nor a file where it was read)")
        if any(not key for key in self.api_keys):
            raise ValueError("api_keys must not be empty strings (an empty key would let in an empty Bearer token)")
        video_sampling_from(self.media_io_kwargs)  # (refused here, not at the first video)
        return self

    def names_per_model(self) -> list[list[str]]:
        """Each served model's names (its first: the one responses carry), the first model's first (a
        name left to the model is only known once loaded: its path stands for it here, and the router
        checks those again)."""
        return [self.served_names, *(m.served_names for m in self.models)]

    @model_validator(mode="after")
    def _served_names(self) -> ClusterConfig:
        names = [name for model_names in self.names_per_model() for name in model_names]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"two served models are named {name!r}: give each a served_model_name of its own")
        return self

    @model_validator(mode="after")
    def _lora(self) -> ClusterConfig:
        any_lora = any(m.enable_lora for m in (self, *self.models))
        if self.allow_runtime_lora_updating is None:
            # vLLM's switch, often exported image-wide: without an adapter-enabled model it has nothing
            # to act on (a warning, not a refusal to start).
            from_env = env_switch("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
            if from_env and not any_lora:
                logger.warning("VLLM_ALLOW_RUNTIME_LORA_UPDATING is set but no model has enable_lora: the "
                               "adapter load and unload endpoints stay off")
            object.__setattr__(self, "allow_runtime_lora_updating", from_env and any_lora)
        elif self.allow_runtime_lora_updating and not any_lora:
            raise ValueError("allow_runtime_lora_updating needs enable_lora (--enable-lora) on a model")
        # A client names a model or an adapter alike: one name, one thing.
        per_model = self.names_per_model()
        names = [name for model_names in per_model for name in model_names]
        served = list(names)
        for owner, owner_names in zip((self, *self.models), per_model, strict=True):
            for module in owner.lora_module_list():
                # (vLLM reads base_model_name as the card's parent only, so any name passes, except
                # another model served here: the adapter would not run on that model's engines.)
                if module.base_model_name in served and module.base_model_name not in owner_names:
                    raise ValueError(f"the LoRA adapter {module.name!r} names base_model_name "
                                     f"{module.base_model_name!r} but is listed for {owner_names[0]!r}: list it in "
                                     "that model's own lora_modules")
                if module.name in names:
                    raise ValueError(f"the LoRA adapter name {module.name!r} is already a served model's or "
                                     "another adapter's")
                names.append(module.name)
        return self

    @model_validator(mode="after")
    def _router_count(self) -> ClusterConfig:
        scaling = self.router_autoscaling
        if (scaling is not None and "num_router_replicas" in self.model_fields_set
                and not scaling.min_replicas <= self.num_router_replicas <= scaling.max_replicas):
            raise ValueError(f"num_router_replicas ({self.num_router_replicas}) must be between router_autoscaling's "
                             f"min_replicas ({scaling.min_replicas}) and max_replicas ({scaling.max_replicas})")
        return self

    # Each model's engine indexes when ``place_engines`` set them (None: numbered in order from 0).
    _engine_layout: list[list[int]] | None = PrivateAttr(default=None)

    def router_initial_replicas(self) -> int | None:
        """With router autoscaling, how many replicas start (None: Serve's choice, min_replicas)."""
        return self.num_router_replicas if "num_router_replicas" in self.model_fields_set else None

    @model_validator(mode="after")
    def _engine_count(self) -> ClusterConfig:
        _check_engines(self, "")
        if self.engine_autoscaling is not None:
            _check_uniform_slots(self.resolved_specs(), "")
        for served in self.models:
            if served.engine_autoscaling is not None:
                _check_uniform_slots(self._served_specs(served), f"models[{served.served_names[0]}].")
        return self

    def _base_flags(self) -> dict[str, Any]:
        return _DEFAULTS.model_dump() | self.defaults.model_dump(exclude_none=True)

    def _inherited_flags(self) -> dict[str, Any]:
        """What a further model's engines start from: the cluster's flags, except the first model's
        own generation config (a folder, an override), whose sampling advice is that model's."""
        flags = self._base_flags()
        if flags["generation_config"] not in ("auto", "vllm"):
            flags["generation_config"] = "auto"
        flags.pop("override_generation_config", None)
        return flags

    def resolved_specs(self) -> list[EngineSpec]:
        """The first model's engines' flags (with engine autoscaling: every slot's, up to max_engines)."""
        return _resolve_specs(self._base_flags(), _slot_count(self), self.engines)

    def _served_specs(self, served: ServedModel) -> list[EngineSpec]:
        """A further model's engines' flags (with engine autoscaling: every slot's, up to max_engines)."""
        flags = self._inherited_flags() | served.defaults.model_dump(exclude_none=True)
        return _resolve_specs(flags, _slot_count(served), served.engines)

    def model_engines(self) -> list[tuple[ServedModel | None, list[int]]]:
        """Each served model (None: the first, described by the top-level fields) with the indexes
        of its engines (with engine autoscaling: of its slots, running or not): the first model's
        from 0, each further model's after the previous ones, unless ``place_engines`` kept running
        engines where they are."""
        owners: list[ServedModel | None] = [None, *self.models]
        layout = self._engine_layout or engine_layout([[None] * _slot_count(owner or self) for owner in owners], [])
        return list(zip(owners, layout, strict=True))

    def place_engines(self, running: dict[int, EngineConfig]) -> None:
        """Number each model's engine slots where its engines run now (``running``: the configuration
        of the engine at each index), so that a redeploy changing one model's engine count (or a
        model added or removed, or an engine dead) neither moves nor restarts another engine: each
        running engine keeps its index in the slot whose flags it runs (per-engine overrides go by
        slot), one whose flags changed keeps its index in a slot left; other slots take the lowest
        indexes left."""
        self._engine_layout = None
        slot_configs = {config.engine_index: config for config in self.engine_slot_configs()}
        slots, engines = [], []
        for settings, indexes in self._settings_engines():
            slots.append([dataclasses.replace(slot_configs[i], engine_index=0) for i in indexes])
            engines.append({i: dataclasses.replace(config, engine_index=0) for i, config in running.items()
                            if served_model_names(config.served_model_name, config.model)[0]
                            == settings.served_names[0]})
        self._engine_layout = engine_layout(slots, engines)

    def _settings_engines(self) -> list[tuple[ClusterConfig | ServedModel, list[int]]]:
        """``model_engines`` with the first model's settings (these top-level fields) in place of None."""
        return [(self if served is None else served, indexes) for served, indexes in self.model_engines()]

    def scaled_models(self) -> list[ScaledModel]:
        """The models whose engines are autoscaled, each with its slots."""
        return [ScaledModel(settings.served_names[0], tuple(indexes), settings.engine_autoscaling)
                for settings, indexes in self._settings_engines() if settings.engine_autoscaling is not None]

    def engine_configs(self) -> list[EngineConfig]:
        """The engines to start (an autoscaled model's: its first num_engines slots)."""
        configs = {config.engine_index: config for config in self.engine_slot_configs()}
        return [configs[i] for settings, indexes in self._settings_engines()
                for i in (indexes if settings.engine_autoscaling is None else indexes[:settings.num_engines])]

    def engine_slot_configs(self) -> list[EngineConfig]:
        """Every engine's configuration; an autoscaled model's, every slot's (max_engines), the
        autoscaler starting and stopping engines among them."""
        if self.routing_policy not in ROUTING_POLICIES:
            raise ValueError(f"routing_policy must be one of {', '.join(ROUTING_POLICIES)}, "
                             f"got {self.routing_policy!r}")
        (_, first_indexes), *further = self.model_engines()
        first_name = self.served_names[0] if self.served_model_name else None
        configs = [engine_config_from_spec(self.model, index, spec, self.seed, first_name, self.lora_config(),
                                           self.tokenizer, self.language_model_only, self.videos_refused)
                   for index, spec in zip(first_indexes, self.resolved_specs(), strict=True)]
        _check_one_runner(configs)
        groups = [configs]
        for served, indexes in further:
            assert served is not None
            name = served.served_names[0] if served.served_model_name else None
            group = [engine_config_from_spec(served.model, index, spec, self.seed, name,
                                             served.lora_config(), served.tokenizer, served.language_model_only,
                                             served.videos_refused)
                     for index, spec in zip(indexes, self._served_specs(served), strict=True)]
            _check_one_runner(group)
            groups.append(group)
            configs += group
        for group in groups:
            if self.routing_policy == "prefix_aware":
                _check_one_block_size(group)
            _check_kv_transfer_group(group)
        return configs

    @classmethod
    def from_yaml(cls, path: str) -> ClusterConfig:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
        return cls(**data)


def engine_layout(slots: list[list[Any]], running: list[dict[int, Any]]) -> list[list[int]]:
    """Each model's engine indexes, one per slot: ``slots[k][j]`` is what model k's slot j runs,
    ``running[k]`` what runs now at each index for model k. An engine running what a slot runs
    keeps its index there (the lowest such slot); one running something else keeps its index in the
    lowest slot left; the other slots take the lowest indexes no model keeps."""
    layout: list[list[int | None]] = []
    for k, wanted in enumerate(slots):
        placed: list[int | None] = [None] * len(wanted)
        engines = running[k] if k < len(running) else {}
        changed = []
        for index in sorted(engines):
            slot = next((j for j, want in enumerate(wanted) if placed[j] is None and want == engines[index]), None)
            if slot is None:
                changed.append(index)
            else:
                placed[slot] = index
        for index in changed:
            slot = next((j for j in range(len(wanted)) if placed[j] is None), None)
            if slot is not None:
                placed[slot] = index
        layout.append(placed)
    taken = {index for placed in layout for index in placed if index is not None}
    free = (index for index in itertools.count() if index not in taken)
    return [[index if index is not None else next(free) for index in placed] for placed in layout]


def _check_one_block_size(group: list[EngineConfig]) -> None:
    """prefix_aware hashes a prompt's blocks once, at its model's block size, to match them against
    what each engine caches: an engine of another block size would never match."""
    first = group[0]
    for config in group[1:]:
        if config.block_size != first.block_size:
            raise ValueError(f"engine {config.engine_index}: block_size {config.block_size} differs from engine "
                             f"{first.engine_index}'s {first.block_size}; prefix_aware routing needs one "
                             "block size for every engine of a model")


def _check_kv_transfer_group(group: list[EngineConfig]) -> None:
    """Prefill/decode disaggregation moves KV blocks as they lie in memory: the engines of a model
    that hand them on must lay them out alike."""
    transferring = [config for config in group if config.kv_transfer_config is not None]
    if not transferring:
        return
    first = transferring[0]
    for config in transferring[1:]:
        # (Each worker rank hands its own layers' KV to the same rank of the other engine: the
        # pipeline stages must split the layers alike too.)
        ours = (config.block_size, config.tensor_parallel_size, config.pipeline_parallel_size, config.dtype,
                config.kv_cache_dtype, config.device)
        theirs = (first.block_size, first.tensor_parallel_size, first.pipeline_parallel_size, first.dtype,
                  first.kv_cache_dtype, first.device)
        if ours != theirs:
            raise ValueError(f"engine {config.engine_index}: block_size, tensor_parallel_size, pipeline_parallel_size, "
                             f"dtype, kv_cache_dtype and device must be the same on every engine of a model with "
                             f"kv_transfer_config (engine {first.engine_index} has {theirs}, this one {ours}): KV "
                             "blocks move between them as they lie in memory")


def _check_one_runner(group: list[EngineConfig]) -> None:
    """The engines of one served model must agree on what it is served as (runner) and how it pools:
    its endpoints answer (or refuse) generation and pool embeddings one way, whichever engine a
    request reaches."""
    first = group[0]
    for config in group[1:]:
        if (config.runner, config.pooler_config, config.hf_overrides) != (first.runner, first.pooler_config,
                                                                          first.hf_overrides):
            raise ValueError(f"engine {config.engine_index}: runner, pooler_config and hf_overrides must be the "
                             f"same on every engine of a model (engine {first.engine_index} has runner "
                             f"{first.runner!r}, pooler_config {dict(first.pooler_config)}, hf_overrides "
                             f"{first.hf_overrides or '{}'}); set them for the model, not per engine")
        # (The router counts an image's placeholders once, whichever engine it reaches.)
        if config.mm_processor_kwargs != first.mm_processor_kwargs:
            raise ValueError(f"engine {config.engine_index}: mm_processor_kwargs must be the same on every engine of "
                             f"a model (engine {first.engine_index} has {first.mm_processor_kwargs or '{}'}); set it "
                             "for the model, not per engine")
        # (The router fills a request's unset sampling parameters and checks its logprobs once, whichever
        # engine it reaches.)
        if ((config.generation_config, config.override_generation_config, config.max_logprobs)
                != (first.generation_config, first.override_generation_config, first.max_logprobs)):
            raise ValueError(f"engine {config.engine_index}: generation_config, override_generation_config and "
                             f"max_logprobs must be the same on every engine of a model (engine {first.engine_index} "
                             f"has {first.generation_config!r}, {first.override_generation_config or '{}'} and "
                             f"{first.max_logprobs}); set them for the model, not per engine")
        # (A request's logprobs must mean the same whichever engine it reaches.)
        if config.logprobs_mode != first.logprobs_mode:
            raise ValueError(f"engine {config.engine_index}: logprobs_mode must be the same on every engine of a "
                             f"model (engine {first.engine_index} has {first.logprobs_mode!r}, this one "
                             f"{config.logprobs_mode!r}); set it for the model, not per engine")
        # (A request's vllm_xargs must mean the same whichever engine it reaches.)
        if config.logits_processors != first.logits_processors:
            raise ValueError(f"engine {config.engine_index}: logits_processors must be the same on every engine of a "
                             f"model (engine {first.engine_index} has {list(first.logits_processors)}); set them for "
                             "the model, not per engine")
        # (The router accepts prompt embeddings for a model only if whichever engine a request reaches does.)
        if config.enable_prompt_embeds != first.enable_prompt_embeds:
            raise ValueError(f"engine {config.engine_index}: enable_prompt_embeds must be the same on every engine "
                             f"of a model (engine {first.engine_index} has {first.enable_prompt_embeds}); set it for "
                             "the model, not per engine")


def engine_config_from_spec(model: str, index: int, spec: EngineSpec, seed: int = 0,
                            served_model_name: str | None = None,
                            lora_config: LoRAConfig | None = None, tokenizer: str | None = None,
                            language_model_only: bool = False, videos_refused: bool = False) -> EngineConfig:
    s = spec.model_dump()
    try:
        scheduler = SchedulerConfig(
            max_num_seqs=s["max_num_seqs"], max_num_batched_tokens=s["max_num_batched_tokens"],
            max_num_scheduled_tokens=s["max_num_scheduled_tokens"], max_model_len=s["max_model_len"],
            enable_chunked_prefill=s["enable_chunked_prefill"],
            long_prefill_token_threshold=s["long_prefill_token_threshold"],
            max_num_partial_prefills=s["max_num_partial_prefills"],
            max_long_partial_prefills=s["max_long_partial_prefills"], policy=s["scheduling_policy"],
            disable_chunked_mm_input=s["disable_chunked_mm_input"])
        speculative = SpeculativeConfig.from_dict(s["speculative_config"])
        transfer = KVTransferConfig.from_dict(s["kv_transfer_config"])
    except (ValueError, TypeError) as e:
        raise ValueError(f"engine {index}: {e}") from None
    return EngineConfig(
        model=model, served_model_name=served_model_name, engine_index=index,
        tensor_parallel_size=s["tensor_parallel_size"], pipeline_parallel_size=s["pipeline_parallel_size"],
        pp_layer_partition=layer_partition_from_env(s["pipeline_parallel_size"]),
        device=s["device"], dtype=s["dtype"], kv_cache_dtype=s["kv_cache_dtype"],
        mamba_cache_dtype=s["mamba_cache_dtype"], mamba_ssm_cache_dtype=s["mamba_ssm_cache_dtype"],
        mamba_cache_mode=s["mamba_cache_mode"], mamba_prefix_cache_slots=s["mamba_prefix_cache_slots"],
        enable_expert_parallel=s["enable_expert_parallel"],
        runner=s["runner"], pooler_config=tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                                          for k, v in (s["pooler_config"] or {}).items())),
        hf_overrides=json.dumps(s["hf_overrides"], sort_keys=True) if s["hf_overrides"] else "",
        mm_processor_kwargs=json.dumps(s["mm_processor_kwargs"], sort_keys=True) if s["mm_processor_kwargs"] else "",
        language_model_only=language_model_only, videos_refused=videos_refused,
        generation_config=s["generation_config"], max_logprobs=s["max_logprobs"],
        logprobs_mode=s["logprobs_mode"], tokenizer=tokenizer,
        log_stats=not s["disable_log_stats"],
        override_generation_config=json.dumps(s["override_generation_config"], sort_keys=True)
        if s["override_generation_config"] else "",
        scheduler=scheduler, block_size=s["block_size"],
        enable_prefix_caching=s["enable_prefix_caching"], num_gpu_blocks=s["num_gpu_blocks"],
        kv_cache_memory_bytes=s["kv_cache_memory_bytes"], gpu_memory_utilization=s["gpu_memory_utilization"],
        placement_strategy=s["placement_strategy"], num_cpus_per_worker=s["num_cpus_per_worker"],
        resources_per_worker=tuple(sorted((s["resources"] or {}).items())),
        node_labels=tuple(sorted((s["node_labels"] or {}).items())), seed=seed,
        executor_backend=s["executor_backend"], max_waiting_requests=s["max_waiting_requests"],
        engine_niceness=s["engine_niceness"], speculative_config=speculative, lora_config=lora_config,
        kv_cache_metrics_sample=s["kv_cache_metrics_sample"] if s["kv_cache_metrics"] else None,
        enable_sleep_mode=s["enable_sleep_mode"], logits_processors=tuple(s["logits_processors"] or ()),
        disable_hybrid_kv_cache_manager=s["disable_hybrid_kv_cache_manager"],
        kv_offloading_size=s["kv_offloading_size"], enable_prompt_embeds=s["enable_prompt_embeds"],
        kv_transfer_config=transfer)


def prefill_decode_overrides(num_prefill: int, num_engines: int | None, transfer: dict[str, Any] | None,
                             overrides: list[EngineSpec]) -> list[EngineSpec]:
    """``--num-prefill-engines N``: the first N engines kv_producer, the others kv_consumer (with the
    rest of ``transfer``, --kv-transfer-config), over the per-engine overrides; an engine whose own
    override sets kv_transfer_config keeps it."""
    total = num_engines if num_engines is not None else len(overrides)
    if not 1 <= num_prefill < total:
        raise ValueError(f"--num-prefill-engines {num_prefill}: needs at least one engine of each kind, so between 1 "
                         f"and the engine count less one (--num-engines is {total or 'not given'})")
    base = {k: v for k, v in (transfer or {}).items() if k != "kv_role"}
    specs = []
    for i in range(total):
        spec = overrides[i] if i < len(overrides) else EngineSpec()
        if spec.kv_transfer_config is None:
            role = "kv_producer" if i < num_prefill else "kv_consumer"
            spec = spec.model_copy(update={"kv_transfer_config": base | {"kv_role": role}})
        specs.append(spec)
    return specs


def load_engine_overrides(path: str) -> list[EngineSpec]:
    """``--engine-config FILE``: a YAML list of per-engine override mappings."""
    with open(path) as f:
        data = yaml.safe_load(f) or []
    if not isinstance(data, list) or not all(item is None or isinstance(item, dict) for item in data):
        raise ValueError(f"{path}: expected a YAML list of per-engine mappings")
    specs = []
    for i, item in enumerate(data):
        try:
            specs.append(EngineSpec(**(item or {})))
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())
            raise ValueError(f"{path}: engine {i}: {problems}") from None
    return specs


def chat_template_text(value: str, name: str = "chat_template") -> str:
    """A chat template setting as vLLM reads ``--chat-template``: a file's text, or the template itself
    when it is not a file (``name``: the setting, for the error)."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if _is_jinja(value):
        return value
    raise ValueError(f"{name}: no such file: {value}")


def _is_jinja(text: str) -> bool:
    return "{{" in text or "{%" in text


def read_chat_template_files(args: dict[str, Any]) -> dict[str, Any]:
    """A Serve config's ClusterConfig mapping with each model's ``chat_template`` read as
    ``--chat-template`` is (a path on the node building the application, or the template)."""
    out = dict(args)
    if isinstance(out.get("chat_template"), str):
        out["chat_template"] = chat_template_text(out["chat_template"])
    if isinstance(out.get("models"), list):
        out["models"] = [
            {**m, "chat_template": chat_template_text(m["chat_template"], f"models[{i}].chat_template")}
            if isinstance(m, dict) and isinstance(m.get("chat_template"), str) else m
            for i, m in enumerate(out["models"])]
    return out


def load_extra_models(path: str) -> list[ServedModel]:
    """``--extra-models FILE``: a YAML list of further served models (``ServedModel`` mappings)."""
    with open(path) as f:
        data = yaml.safe_load(f) or []
    if not isinstance(data, list) or not all(isinstance(item, dict) for item in data):
        raise ValueError(f"{path}: expected a YAML list of model mappings (model, served_model_name, ...)")
    models = []
    for i, item in enumerate(data):
        try:
            models.append(ServedModel(**item))
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())
            raise ValueError(f"{path}: model {i}: {problems}") from None
    return models


def scheduler_flags_to_spec(flags: dict[str, Any]) -> EngineSpec:
    """Map vLLM-named keyword flags (``LLM(max_num_seqs=...)``, ``policy`` too) onto an EngineSpec."""
    flags = dict(flags)
    if "policy" in flags:
        flags["scheduling_policy"] = flags.pop("policy")
    return EngineSpec(**flags)
