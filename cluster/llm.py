"""The offline API, named as vLLM's so scripts port over: ``LLM(...).generate(...)`` and ``.chat(...)``.

One engine with TP=1 runs in this process (no Ray: the engine steps on the caller's thread);
several engines or TP > 1 run as Ray engine actors, and prompts are spread across them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from cluster.config import ClusterConfig, EngineSpec, scheduler_flags_to_spec
from engine_core.beam_search import BeamSearch, candidates_per_beam
from engine_core.config import EngineConfig, KVCacheDType
from engine_core.engine_core import EngineCore
from engine_core.executor import ModelInfo, PoolingInfo
from engine_core.logits_processor import LogitsProcessor, load_logits_processors, validate_request_params
from engine_core.multimodal import ImageGeometry, MultiModalFeature
from engine_core.outputs import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, LogprobsEntry, LoRARequest
from engine_core.prompt_embeds import PromptEmbeds
from engine_core.sampling_params import SamplingParams as EngineSamplingParams
from engine_core.sampling_params import logprobs_count
from engine_core.structured_output import check_structured_output
from router.bad_words import bad_words_token_ids
from router.classification import class_probabilities, pooled_output
from router.content_format import CONTENT_FORMATS, TEXT_PART_TYPES, resolve_content_format, template_content
from router.detokenizer import IncrementalDetokenizer, decode_after, token_text
from router.image_tiles import tiled_image_tokens
from router.multimodal import (
    DEFAULT_LIMIT_PER_PROMPT,
    MultiModalProcessor,
    as_rgb,
    check_image_size,
    image_placeholder,
    image_prompt_text,
    load_image_processor,
    timed_video_tokens,
    video_placeholder,
)
from router.scoring import cosine_scores, maxsim_scores, pair_params, score_pairs, tokenize_pair
from router.video import VIDEO_FPS, DecodedVideo, VideoSampling, decode_video, process_video, video_sampling_from

PromptType = str | list[int]

logger = logging.getLogger(__name__)


def _prompt_key(prompt: PromptType) -> tuple[str, Any]:
    return ("text", prompt) if isinstance(prompt, str) else ("ids", tuple(prompt))


@dataclass
class SamplingParams(EngineSamplingParams):
    """vLLM's offline sampling parameters: the engine's, plus what the offline API applies itself
    (``n`` samples per prompt, stop strings matched on the text)."""

    # None: up to the end of the context (vLLM's), resolved per prompt.
    max_tokens: int | None = 16
    n: int = 1
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    # Words that must not be generated (tokenised by the LLM into ``bad_words_token_ids``).
    bad_words: list[str] | None = None
    # How the text is made: special tokens left out, and none at all (token ids only) with
    # detokenize=False. spaces_between_special_tokens is taken as vLLM takes it and, as with vLLM's
    # fast tokenizers (every tokenizer here is one), the tokenizer's decoder decides the spacing.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    # The prompt's last this many tokens only (-1: as many as leave room to generate), as vLLM cuts it.
    truncate_prompt_tokens: int | None = None
    # vLLM's StructuredOutputsParams (or a dict of its fields: json, regex, choice, grammar,
    # json_object, disable_any_whitespace), the engine's structured_output under vLLM's name.
    structured_outputs: Any = None
    # vLLM's; the offline LLM returns each request's final output, whatever it says.
    output_kind: Any = None

    def __post_init__(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):  # (vLLM reads True as 1)
            if getattr(self, name) is True:
                setattr(self, name, 1)
        if self.seed == -1:  # (vLLM's "no seed"; read here, at the API's edge: sample i's seed + i may be -1)
            self.seed = None
        to_context_end = self.max_tokens is None
        if to_context_end:
            self.max_tokens = _TO_CONTEXT_END  # (for the engine's checks; resolved per prompt)
        if self.structured_outputs is not None:
            spec = _structured_output_spec(self.structured_outputs)
            if self.structured_output is not None and self.structured_output != spec:
                raise ValueError("give structured_outputs or structured_output, not both")
            self.structured_output = spec
        super().__post_init__()
        if to_context_end:
            self.max_tokens = None
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n!r}")
        if self.n > 1 and self.temperature == 0:
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop cannot contain an empty string")
        if not self.detokenize and self.stop_strings:
            raise ValueError("stop strings are matched on the text: they need detokenize=True")
        if self.truncate_prompt_tokens is not None and not (
                isinstance(self.truncate_prompt_tokens, int)
                and (self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1)):
            raise ValueError(f"truncate_prompt_tokens must be None, -1 or >= 1, got {self.truncate_prompt_tokens!r}")

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


_TO_CONTEXT_END = 2**31 - 1


def _structured_output_spec(value: Any) -> dict[str, Any]:
    """vLLM's StructuredOutputsParams (its set fields) or a dict of them, as the engine's spec."""
    from engine_core.structured_output import STRUCTURED_OUTPUT_KINDS, STRUCTURED_OUTPUT_OPTIONS

    items = value.items() if isinstance(value, dict) else (
        (name, getattr(value, name, None)) for name in STRUCTURED_OUTPUT_KINDS + STRUCTURED_OUTPUT_OPTIONS)
    return {name: v for name, v in items if v is not None and v is not False}  # (the fields left unset)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class Logprob:
    """vLLM's: a token's logprob in the model's distribution, its rank there (1 = the most likely)
    and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    # One {token id: Logprob} per generated token: the sampled token and the top ``logprobs`` others.
    logprobs: list[dict[int, Logprob]] | None = None
    stop_reason: int | str | None = None
    # The sum of the sampled tokens' logprobs (when logprobs were asked for), as vLLM reports it.
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class BeamSearchParams:
    """vLLM's: ``LLM.beam_search``'s width, length (rounds) and options."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # (picks only the one sampled candidate of each round; the rest are the best)
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False


@dataclass
class BeamSearchSequence:
    """vLLM's: one beam. ``tokens`` and ``text`` include the prompt, as vLLM's do; ``logprobs``: per
    generated token, {token id: Logprob} of it and the alternatives the engine ranked."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """vLLM's: a prompt's best beams, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """vLLM's ``LLM.embed`` result: one prompt's embedding."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


def _pooled_params(info: ModelInfo, normalize: bool = False, dimensions: int | None = None,
                   pooling: PoolingInfo | None = None) -> EngineSamplingParams:
    """An embedding request's parameters (a classifier's class logits), pooled as the model pools
    (or as ``pooling``, a pooling task's)."""
    return EngineSamplingParams(max_tokens=1, temperature=0.0, embed=True, embed_normalize=normalize,
                                embed_dimensions=dimensions, **(pooling or info.pooling).params_fields())


@dataclass
class PoolingParams:
    """vLLM's pooling parameters for LLM.embed, .classify, .encode and .score: ``dimensions`` (a
    Matryoshka model's first values), ``normalize`` (None: as the model's pooler config says),
    ``use_activation`` (False: a classifier's raw logits) and ``truncate_prompt_tokens`` (each
    prompt's first k tokens, as the pooling endpoints truncate by default; -1: as many as fit)."""

    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None


def _pooling_args(pooling_params: PoolingParams | None, truncate_prompt_tokens: int | None,
                  normalize: bool | None = None, dimensions: int | None = None
                  ) -> tuple[int | None, bool | None, int | None, bool | None]:
    """(truncate, normalize, dimensions, use_activation) from the keyword arguments and vLLM's
    PoolingParams (the keywords win when both give one)."""
    given = pooling_params or PoolingParams()
    truncate = truncate_prompt_tokens if truncate_prompt_tokens is not None else given.truncate_prompt_tokens
    if truncate is not None and not (isinstance(truncate, int) and (truncate == -1 or truncate >= 1)):
        raise ValueError(f"truncate_prompt_tokens must be None, -1 or >= 1, got {truncate!r}")
    return (truncate, normalize if normalize is not None else given.normalize,
            dimensions if dimensions is not None else given.dimensions, given.use_activation)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """vLLM's ``LLM.classify`` result: one prompt's class probabilities."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class PoolingOutput:
    # An embedding, a classifier's class probabilities, or (ALL / STEP pooling) one row per kept
    # token: a token classifier's class probabilities, a reward model's rewards, an embedding. A
    # float32 tensor, as vLLM's (its scripts call .tolist(), .shape, .argmax(-1)).
    data: Any

    def __post_init__(self) -> None:
        import torch  # (deferred: the CLI imports this module)

        if not isinstance(self.data, torch.Tensor):
            self.data = torch.tensor(self.data, dtype=torch.float32)


@dataclass
class PoolingRequestOutput:
    """vLLM's ``LLM.encode`` result: one prompt's pooled output, as /pooling answers it."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """vLLM's ``LLM.score`` result: one pair's score (the cosine similarity of its embeddings, a
    cross-encoder's score, or ColBERT's MaxSim)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    # None for a prompt given as embeddings (it has no token ids), as vLLM's.
    prompt_token_ids: list[int] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.time()))
    # With SamplingParams.prompt_logprobs: None for the first prompt token (nothing precedes it), then
    # each prompt token's {token id: Logprob}, its top ``prompt_logprobs`` alternatives included.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Prompt tokens the engine found in its prefix cache (vLLM's num_cached_tokens).
    num_cached_tokens: int = 0


# The keys of vLLM's prompt dicts this API serves.
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "prompt_embeds", "cache_salt", "multi_modal_data"})


@dataclass
class _ImagePrompt:
    """A prompt (text or token ids) with one image token per image (and video token per video), and
    its images (PIL, in order) and videos: vLLM's ``{"prompt": ..., "multi_modal_data": {"image":
    ..., "video": ...}}``."""

    prompt: str | list[int]
    images: list[Any]
    videos: list[DecodedVideo] = field(default_factory=list)


class _Pending:
    """One sample (engine request) of a prompt: ``group`` is the prompt's output, ``index`` the sample."""

    __slots__ = ("detok", "detokenize", "done", "embedding", "engine", "finish_reason", "group", "include_stop",
                 "index", "logprob_entries", "metrics", "num_cached_tokens", "prompt", "prompt_ids",
                 "prompt_logprobs", "skip_special", "stop_reason", "token_ids")

    def __init__(self, prompt: str | None, prompt_ids: list[int] | None, want_logprobs: bool, group: str = "",
                 index: int = 0, detok: IncrementalDetokenizer | None = None, include_stop: bool = False,
                 skip_special: bool = True, detokenize: bool = True) -> None:
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.group, self.index, self.detok = group, index, detok
        # include_stop_str_in_output: the stop token that ended the sample stays in its text too.
        self.include_stop = include_stop
        # How its text is made (skip_special_tokens; detokenize=False: no text, token ids only).
        self.skip_special, self.detokenize = skip_special, detokenize
        self.engine = 0
        self.token_ids: list[int] = []
        # (token ids, entry) per output with logprobs; turned into Logprob dicts once, at the end.
        self.logprob_entries: list[tuple[list[int], LogprobsEntry]] | None = [] if want_logprobs else None
        self.prompt_logprobs: LogprobsEntry | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.metrics = RequestMetrics(time.time())
        self.done = False
        self.embedding: list[float] | None = None
        self.num_cached_tokens = 0

    def apply(self, out: EngineCoreOutput, now: float) -> bool:
        """True when a stop string ended the sample here (the engine must then abort it)."""
        if out.pooling_output is not None:
            self.embedding = out.pooling_output
        if out.new_prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = out.new_prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.new_token_ids:
            if self.metrics.first_token_time is None:
                self.metrics.first_token_time = now
            new_token_ids = out.new_token_ids
            if self.detok is not None:
                consumed = len(self.detok.token_ids)
                self.detok.add_tokens(new_token_ids)
                if self.detok.stop_reason is not None:
                    # Tokens after the stop string (several arrive at once with speculative decoding)
                    # are not part of the sample.
                    new_token_ids = new_token_ids[:len(self.detok.token_ids) - consumed]
            self.token_ids.extend(new_token_ids)
            if self.logprob_entries is not None and out.new_logprobs is not None:
                self.logprob_entries.append((new_token_ids, out.new_logprobs))
            if self.detok is not None and self.detok.stop_reason is not None:
                self.finish_reason, self.stop_reason = "stop", self.detok.stop_reason
                self.metrics.finished_time = now
                self.done = True
                return out.finish_reason is None
        if out.finish_reason is not None:
            self.finish_reason = str(out.finish_reason)
            self.stop_reason = out.stop_reason
            self.metrics.finished_time = now
            self.done = True
        return False


def _logprob_dicts(token_ids: list[int], entry: LogprobsEntry, decode: Callable[[int], str]
                   ) -> list[dict[int, Logprob]]:
    """One {token id: Logprob} per token: the token itself first, then its alternatives (ranked 1..k)."""
    return [{t: Logprob(lp, rank, decode(t)) for t, lp, rank in row} for row in entry.ranked(token_ids)]


def _stop_ray_engines(handles: list[Any]) -> None:
    from cluster.launcher import stop_engines

    try:
        stop_engines(handles)
    except Exception as e:  # (at exit Ray may be gone already)
        logger.warning("stopping the LLM's engines failed: %s", e)


def _progress(use_tqdm: Any) -> Any:
    """vLLM's use_tqdm: a bool, or the tqdm class (a partial of it, say) to draw progress with."""
    return use_tqdm if callable(use_tqdm) else tqdm


# vLLM's LLM() arguments with nothing to do here, taken at any value: no CUDA graphs or compilation
# (the engines always run eagerly), no swap space (preempted requests are recomputed, as vLLM v1
# does), no code from a checkpoint is ever run, no download (nothing to authenticate).
VLLM_ARGS_WITHOUT_EFFECT = frozenset({
    "enforce_eager", "trust_remote_code", "swap_space", "max_seq_len_to_capture", "compilation_config",
    "cuda_graph_sizes", "disable_custom_all_reduce", "disable_async_output_proc", "hf_token"})
# vLLM's LLM() arguments for what is not built here: taken at their neutral values only.
VLLM_ARGS_AT_DEFAULT: dict[str, tuple[Any, ...]] = {
    "quantization": (None,), "revision": (None,), "tokenizer_revision": (None,), "code_revision": (None,),
    "download_dir": (None,), "tokenizer_mode": ("auto",), "load_format": ("auto",), "cpu_offload_gb": (0, 0.0),
    "data_parallel_size": (1,), "skip_tokenizer_init": (False,)}
VLLM_ARGS_WHY = {
    "quantization": "a checkpoint's own quantization is read from its files; quantizing as it loads is not built",
    "revision": "models are local directories or GGUF files: nothing is downloaded",
    "tokenizer_revision": "nothing is downloaded", "code_revision": "nothing is downloaded",
    "download_dir": "nothing is downloaded", "tokenizer_mode": "the checkpoint's Hugging Face tokenizer is used",
    "load_format": "weights load as the checkpoint has them", "cpu_offload_gb": "weights are not offloaded",
    "data_parallel_size": "engines are num_engines here", "skip_tokenizer_init": "the tokenizer is always loaded"}


class LLM:
    def __init__(self, model: str = "SmolLM2-135M-Instruct", num_engines: int = 1, tensor_parallel_size: int = 1,
                 num_gpu_blocks: int | None = None, device: str = "auto", dtype: str = "auto", seed: int | None = 0,
                 block_size: int = 16, enable_prefix_caching: bool = True, kv_cache_memory_bytes: int | None = None,
                 executor_backend: str = "auto", use_ray: bool | None = None, address: str | None = None,
                 engine_overrides: list[dict[str, Any]] | None = None, enable_lora: bool = False,
                 max_loras: int = 1, max_lora_rank: int = 16, max_cpu_loras: int | None = None,
                 kv_cache_dtype: KVCacheDType = "auto", enable_expert_parallel: bool = False,
                 runner: str = "auto", pooler_config: dict[str, Any] | None = None,
                 hf_overrides: dict[str, Any] | None = None, enable_sleep_mode: bool = False,
                 generation_config: str = "auto", override_generation_config: dict[str, Any] | None = None,
                 disable_log_stats: bool = True, tokenizer: str | None = None,
                 logits_processors: list[str | type[LogitsProcessor]] | None = None,
                 pipeline_parallel_size: int = 1, limit_mm_per_prompt: dict[str, int] | None = None,
                 media_io_kwargs: dict[str, Any] | None = None, **scheduler_flags: Any) -> None:
        """``limit_mm_per_prompt``: a vision-language model's most images in one prompt (vLLM's; {"image":
        0}: its language model alone, the vision tower not loaded). ``media_io_kwargs``: how a video
        URL's frames are sampled (vLLM's: {"video": {"num_frames": N}} or {"video": {"fps": F}}).
        ``scheduler_flags``: the engine flags by vLLM's names (max_num_seqs, max_model_len, ...);
        vLLM's arguments with nothing to do here are taken too (VLLM_ARGS_WITHOUT_EFFECT), and those for
        what is not built only at their neutral value (VLLM_ARGS_AT_DEFAULT), else a ValueError."""
        from gpu_worker.model_resolver import check_tokenizer_dir, load_tokenizer, resolve_model, worker_reference
        from gpu_worker.worker import gguf_dtype_rule, resolve_device

        if seed is None:  # (vLLM's "no seed": the engines' random state starts from 0 here)
            seed = 0
        backend = scheduler_flags.pop("distributed_executor_backend", None)
        if backend is not None:
            if backend not in ("ray", "mp", "uni"):
                raise ValueError(f"distributed_executor_backend {backend!r}: ray, mp or uni")
            executor_backend = "ray" if backend == "ray" else executor_backend
        for name in [k for k in scheduler_flags if k in VLLM_ARGS_WITHOUT_EFFECT]:
            scheduler_flags.pop(name)
        for name, neutral in VLLM_ARGS_AT_DEFAULT.items():
            if name in scheduler_flags and scheduler_flags.pop(name) not in neutral:
                raise ValueError(f"{name}: only {neutral[0]!r} here ({VLLM_ARGS_WHY[name]})")
        unknown = sorted(set(scheduler_flags) - set(EngineSpec.model_fields) - {"policy"})
        if unknown:
            raise TypeError(f"LLM() got arguments it does not take: {', '.join(unknown)}")

        # (--tokenizer: a directory, checked here before anything loads; the engines check it against
        # the model and use it too.)
        tokenizer = None if tokenizer is None else str(check_tokenizer_dir(tokenizer))
        # (A GGUF converted at the dtype the engines serve it in here, as an engine converts it: one
        # conversion, not a float32 one beside theirs. bfloat16 taken as there, as a Ray engine takes
        # it: asking the GPU would open a CUDA context in this process, which engines on Ray do not use.)
        resolved = resolve_model(model, has_tokenizer=tokenizer is not None,
                                 dtype=gguf_dtype_rule(dtype, resolve_device(device, 0), runner == "pooling",
                                                       hf_overrides, bf16_supported=True))
        self.model_dir = str(resolved.model_dir)
        self.tokenizer = load_tokenizer(resolved.model_dir if tokenizer is None else tokenizer)
        self._image_processor: MultiModalProcessor | None = None
        self._token_texts: dict[int, str] = {}
        spec = scheduler_flags_to_spec(scheduler_flags).model_copy(update={
            "tensor_parallel_size": tensor_parallel_size, "pipeline_parallel_size": pipeline_parallel_size,
            "num_gpu_blocks": num_gpu_blocks, "device": device,
            "dtype": dtype, "block_size": block_size, "enable_prefix_caching": enable_prefix_caching,
            "kv_cache_memory_bytes": kv_cache_memory_bytes, "executor_backend": executor_backend,
            "kv_cache_dtype": kv_cache_dtype, "enable_expert_parallel": enable_expert_parallel,
            "runner": runner, "pooler_config": pooler_config, "hf_overrides": hf_overrides,
            "enable_sleep_mode": enable_sleep_mode, "generation_config": generation_config,
            "override_generation_config": override_generation_config})
        # engine_overrides: per-engine flag mappings (engine i gets the i-th), e.g. a latency engine
        # beside a throughput one.
        # The engines are given a GGUF itself (each worker converts it on its own node: a rank on
        # another node has no copy of this node's cache), and a model directory as found.
        engines_model = worker_reference(model) if resolved.gguf_path is not None else self.model_dir
        self.cluster_config = ClusterConfig(model=engines_model, num_engines=num_engines, defaults=spec,
                                            engines=[EngineSpec(**o) for o in engine_overrides or []],
                                            address=address, seed=seed, enable_lora=enable_lora,
                                            max_loras=max_loras, max_lora_rank=max_lora_rank,
                                            max_cpu_loras=max_cpu_loras, tokenizer=tokenizer,
                                            limit_mm_per_prompt=limit_mm_per_prompt or {},
                                            media_io_kwargs=media_io_kwargs or {})
        # (vLLM's disable_log_stats, on by default offline: no periodic stats line from Ray engines
        # (an in-process engine writes none); the engines still keep their stats, which get_stats reports.)
        # (logits_processors: classes, which the engines unpickle by reference, or qualified names.)
        processors = {} if logits_processors is None else {"logits_processors": tuple(logits_processors)}
        self.engine_configs: list[EngineConfig] = [
            dataclasses.replace(c, log_stats_line=not disable_log_stats, **processors)
            for c in self.cluster_config.engine_configs()]
        # (An engine's TP and PP ranks beyond the first are Ray actors.)
        self.use_ray = use_ray if use_ray is not None else (len(self.engine_configs) > 1 or tensor_parallel_size > 1
                                                            or pipeline_parallel_size > 1 or executor_backend == "ray")
        self._ids = itertools.count()
        # The custom logits processors' classes, whose validate_params a request meets before it is
        # queued (loaded here, so a name that does not load fails before any engine starts).
        self._logits_processor_classes: tuple[type[LogitsProcessor], ...] = load_logits_processors(
            self.engine_configs[0].logits_processors)
        self._engine: EngineCore | None = None
        self._handles: list[Any] = []
        if self.use_ray:
            from cluster.launcher import ensure_ray, start_engines

            ensure_ray(address, namespace=self.cluster_config.namespace)
            self._handles = start_engines(self.engine_configs, self.cluster_config.namespace)
            # (An LLM dropped without shutdown(), `del llm` in a loop over models, stops its engines
            # when it is collected: their names and GPUs are free for the next.)
            self._stop_engines = weakref.finalize(self, _stop_ray_engines, list(self._handles))
        else:
            from gpu_worker.executor import create_executor

            self._engine = EngineCore(self.engine_configs[0], create_executor(self.engine_configs[0]))

    # -- public API ------------------------------------------------------------------------------

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None, *,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """``lora_request``: one adapter for every prompt, or one (or None) per prompt, as vLLM;
        adapters not loaded yet are loaded first (a checkpoint the model cannot serve raises).
        ``priority``: one per prompt, with scheduling_policy="priority" (lower first), as vLLM's."""
        if not self._model_info().pooling.generates:
            raise ValueError("this model is an embedding model (runner pooling): it does not generate; use "
                             "LLM.embed" + (", LLM.classify or LLM.score" if self._model_info().pooling.labels else ""))
        salts: list[str | None] = []
        prompt_list = self._as_prompt_list(prompts, salts)
        params_list = self._as_params_list(
            self.get_default_sampling_params() if sampling_params is None else sampling_params, len(prompt_list))
        loras = self._as_lora_list(lora_request, len(prompt_list))
        if priority is not None:
            if len(priority) != len(prompt_list):
                raise ValueError(f"priority has {len(priority)} values for {len(prompt_list)} prompts")
            if any(p != 0 for p in priority) and self.engine_configs[0].scheduler.policy != "priority":
                raise ValueError('priority needs scheduling_policy="priority"')
        pending: dict[str, _Pending] = {}
        requests = []
        max_model_len, vocab = self._max_model_len(), len(self.tokenizer)
        resolved: dict[int, EngineSamplingParams] = {}
        for params in params_list:
            if id(params) not in resolved:
                resolved[id(params)] = self._resolve_params(params, vocab)
        params_list = [resolved[id(params)] for params in params_list]
        self._load_loras(loras)
        # The tokenizer's EOS, as the router's requests (and vLLM's): the engine adds the model's others
        # as stop ids, which an answer they end names as its stop_reason.
        eos_token_id = self.tokenizer.eos_token_id if isinstance(self.tokenizer.eos_token_id, int) else None
        for index, (prompt, params, lora, salt) in enumerate(zip(prompt_list, params_list, loras, salts,
                                                                 strict=True)):
            embeds = prompt if isinstance(prompt, PromptEmbeds) else None
            features = None
            if isinstance(prompt, _ImagePrompt):
                ids, features = self._image_prompt(index, prompt, vocab, max_model_len - 1,
                                                   getattr(params, "truncate_prompt_tokens", None))
                prompt = prompt.prompt
            else:
                ids = (self._placeholder_ids(index, embeds, max_model_len - 1) if embeds is not None
                       else self._prompt_ids(index, prompt, vocab, max_model_len - 1,
                                             getattr(params, "truncate_prompt_tokens", None)))
            if params.max_tokens is None:  # (up to the end of the context)
                params = dataclasses.replace(params, max_tokens=max_model_len - len(ids))
            group = str(next(self._ids))
            text = prompt if isinstance(prompt, str) else None
            n = getattr(params, "n", 1)
            stops = getattr(params, "stop_strings", [])
            for sample in range(n):
                request_id = group if n == 1 else f"{group}-{sample}"
                sample_params = params
                if sample and params.seed is not None:  # sample i draws with seed + i, as vLLM and the router do
                    sample_params = dataclasses.replace(params)
                    sample_params.seed = params.seed + sample  # (set after the checks: -1 here is a seed)
                skip_special = getattr(params, "skip_special_tokens", True)
                detok = (IncrementalDetokenizer(self.tokenizer, [] if embeds is not None else ids, stop=stops,
                                                include_stop_str_in_output=params.include_stop_str_in_output,
                                                min_tokens=params.min_tokens, skip_special_tokens=skip_special)
                         if stops else None)
                pending[request_id] = _Pending(text, None if embeds is not None else ids, params.logprobs is not None,
                                               group, sample, detok, params.include_stop_str_in_output,
                                               skip_special, getattr(params, "detokenize", True))
                requests.append(EngineCoreRequest(request_id=request_id, prompt_token_ids=ids,
                                                  sampling_params=sample_params, eos_token_id=eos_token_id,
                                                  arrival_time=time.time(),
                                                  priority=0 if priority is None else priority[index],
                                                  lora_request=lora, cache_salt=salt, prompt_embeds=embeds,
                                                  mm_features=features))
        self._run(requests, pending, "Processed prompts", use_tqdm)
        groups: dict[str, list[_Pending]] = {}
        for p in pending.values():
            groups.setdefault(p.group, []).append(p)
        return [self._to_output(group, samples) for group, samples in groups.items()]

    def embed(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None, normalize: bool | None = None,
              dimensions: int | None = None, *, pooling_params: PoolingParams | None = None,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's ``LLM.embed``: each prompt's embedding, pooled as the model's pooler config says (its
        last token's final hidden state by default; see /v1/embeddings), first ``dimensions`` values
        when given, L2-normalised unless ``normalize`` or the pooler config says not."""
        info = self._model_info()
        if info.pooling.labels and info.pooling.per_token:
            raise ValueError("this model classifies every token (a token classifier or reward model): LLM.encode "
                             "(or LLM.reward) gives each token's classes, not LLM.embed")
        if info.pooling.labels:
            raise ValueError("this model is a sequence classifier: use LLM.classify (or LLM.score for a "
                             "cross-encoder), not LLM.embed")
        if info.pooling.per_token:
            raise ValueError(f"this model pools every token ({info.pooling.pooling_type} pooling): LLM.encode gives "
                             "each token's embedding")
        if info.pooling.unavailable:
            raise ValueError(f"this model does not serve embeddings: {info.pooling.unavailable}")
        truncate, normalize, dimensions, _ = _pooling_args(pooling_params, truncate_prompt_tokens, normalize,
                                                           dimensions)
        if normalize is None:
            normalize = info.pooling.normalize
        params = _pooled_params(info, normalize, dimensions)
        problem = info.pooling.dimensions_problem(dimensions, info.served_model_name, info.hidden_size)
        if problem:
            raise ValueError(problem)
        return [EmbeddingRequestOutput(request_id, EmbeddingOutput(vector), ids)
                for request_id, ids, vector in self._pool(prompts, params, lora_request, use_tqdm, "Embedded prompts",
                                                          truncate)]

    def classify(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None, *,
                 pooling_params: PoolingParams | None = None, truncate_prompt_tokens: int | None = None
                 ) -> list[ClassificationRequestOutput]:
        """vLLM's ``LLM.classify`` with a sequence classifier: each prompt's class probabilities
        (``outputs.probs``: by the checkpoint's problem_type, as /classify computes them)."""
        info = self._model_info()
        if not info.pooling.labels:
            raise ValueError("this model is not a sequence classifier (a *ForSequenceClassification checkpoint)")
        if info.pooling.per_token:
            raise ValueError("this model classifies every token (a token classifier or reward model): LLM.encode "
                             "gives each token's class probabilities")
        truncate, _, _, use_activation = _pooling_args(pooling_params, truncate_prompt_tokens)
        pooled = self._pool(prompts, _pooled_params(info), lora_request, use_tqdm, "Classified prompts", truncate)
        activation = "none" if use_activation is False else info.pooling.classifier_activation
        return [ClassificationRequestOutput(request_id, ClassificationOutput(class_probabilities(logits, activation)),
                                            ids)
                for request_id, ids, logits in pooled]

    def encode(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None, *,
               use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
               pooling_task: str | None = None, truncate_prompt_tokens: int | None = None
               ) -> list[PoolingRequestOutput]:
        """vLLM's ``LLM.encode``: each prompt's pooled output as the model's own endpoint computes it
        (as /pooling answers): an embedding model's embedding, a sequence classifier's class
        probabilities; under ALL / STEP pooling one row per kept token: a token classifier's class
        probabilities (NER), a reward model's rewards, each token's embedding. ``pooling_task``
        (vLLM's: embed, classify, token_embed, token_classify) asks for one of them."""
        if isinstance(pooling_params, bool):  # (our earlier order: use_tqdm second)
            raise TypeError("LLM.encode's second argument is pooling_params, as vLLM's; give use_tqdm by name")
        info = self._model_info()
        pooling = info.pooling.for_task(pooling_task)
        if not pooling.labels and not pooling.per_token:
            return [PoolingRequestOutput(out.request_id, PoolingOutput(out.outputs.embedding), out.prompt_token_ids)
                    for out in self.embed(prompts, use_tqdm, lora_request, pooling_params=pooling_params,
                                          truncate_prompt_tokens=truncate_prompt_tokens)]
        if pooling.unavailable:
            raise ValueError(f"this model does not serve embeddings: {pooling.unavailable}")
        truncate, normalize, _, use_activation = _pooling_args(pooling_params, truncate_prompt_tokens)
        params = _pooled_params(info, normalize=(pooling.normalize if normalize is None else normalize)
                                and not pooling.classifies, pooling=pooling)
        activation = "none" if use_activation is False else pooling.classifier_activation
        return [PoolingRequestOutput(request_id, PoolingOutput(pooled_output(values, pooling, activation)), ids)
                for request_id, ids, values in self._pool(prompts, params, lora_request, use_tqdm, "Pooled prompts",
                                                          truncate)]

    def reward(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True,
               lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[PoolingRequestOutput]:
        """vLLM's ``LLM.reward``, for reward models (and token classifiers): each prompt's rows, as
        LLM.encode gives them (an outcome reward model's reward at every token, a process reward
        model's two class probabilities at every step separator)."""
        if not self._model_info().pooling.per_token:
            raise ValueError("LLM.reward reads a model that pools every token (ALL or STEP pooling: a reward model "
                             "or token classifier); use LLM.classify or LLM.embed for this one")
        return self.encode(prompts, use_tqdm=use_tqdm, lora_request=lora_request)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what ``generate`` and ``chat`` use when given no sampling parameters: the model's
        defaults from its generation config (``generation_config``, ``override_generation_config``;
        its max_new_tokens as max_tokens) over the neutral ones."""
        return SamplingParams(**self._model_info().default_sampling_params)

    def _model_info(self) -> ModelInfo:
        if self._engine is None and not self._handles:
            raise RuntimeError("this LLM was shut down")
        return self._engine.model_info if self._engine is not None else self._handles[0].description.model_info

    def _pool(self, prompts: PromptType | Sequence[PromptType],
              params: EngineSamplingParams | list[EngineSamplingParams],
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None, use_tqdm: bool, label: str,
              truncate: int | None = None) -> list[tuple[str, list[int], list[float]]]:
        """(request id, prompt ids, pooled output) of each prompt, run as embedding requests
        (``params``: for all, or each prompt's own; ``truncate``: each prompt's first k tokens)."""
        salts: list[str | None] = []
        prompt_list = self._as_prompt_list(prompts, salts)
        loras = self._as_lora_list(lora_request, len(prompt_list))
        each = params if isinstance(params, list) else [params] * len(prompt_list)
        self._load_loras(loras)
        vocab, max_model_len = len(self.tokenizer), self._max_model_len()
        pending: dict[str, _Pending] = {}
        requests = []
        for index, (prompt, lora, prompt_params, salt) in enumerate(zip(prompt_list, loras, each, salts,
                                                                        strict=True)):
            if truncate is not None and not isinstance(prompt, PromptEmbeds):
                # (As the pooling endpoints truncate by default: the first k tokens kept, a text's
                # special tokens ([CLS] ... [SEP]) kept around them by its tokenizer.)
                k = max_model_len if truncate == -1 else truncate
                prompt = (list(self.tokenizer(prompt, truncation=True, max_length=k)["input_ids"])
                          if isinstance(prompt, str) else list(prompt)[:k])
            ids = self._prompt_ids(index, prompt, vocab, max_model_len)
            request_id = str(next(self._ids))
            pending[request_id] = _Pending(prompt if isinstance(prompt, str) else None, ids, False, request_id)
            requests.append(EngineCoreRequest(request_id=request_id, prompt_token_ids=ids,
                                              sampling_params=prompt_params, arrival_time=time.time(),
                                              lora_request=lora, cache_salt=salt))
        self._run(requests, pending, label, use_tqdm)
        out = []
        for request_id, p in pending.items():
            if p.embedding is None:
                raise RuntimeError(f"prompt {request_id} ended without its pooled output ({p.finish_reason}: "
                                   f"{p.stop_reason})")
            out.append((request_id, p.prompt_ids, p.embedding))
        return out

    def score(self, data_1: PromptType | Sequence[PromptType], data_2: PromptType | Sequence[PromptType],
              use_tqdm: bool = True, lora_request: LoRARequest | None = None) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score``, pairing one ``data_1`` prompt with every ``data_2`` prompt, or the
        i-th with the i-th. With an embedding model, each pair's cosine similarity: each distinct
        prompt is embedded once, and a pair's ``prompt_token_ids`` are its two prompts' ids, joined.
        With a cross-encoder (a one-output sequence classifier), the sigmoid of its logit over the
        pair, tokenised as the tokenizer joins a text pair (``prompt_token_ids``). With a ColBERT
        model, each pair's MaxSim over the two prompts' token vectors."""
        first, second = self._as_prompt_list(data_1), self._as_prompt_list(data_2)
        if not first or not second:
            raise ValueError("LLM.score needs at least one prompt on each side")
        pairs = score_pairs(len(first), len(second))
        pooling = self._model_info().pooling
        if pooling.labels and pooling.per_token:
            raise ValueError("this model classifies every token (a token classifier or reward model): LLM.encode "
                             "gives each token's classes; it scores no pairs")
        if pooling.labels:
            return self._cross_encoder_scores(first, second, pairs, use_tqdm, lora_request)
        unique: dict[tuple[str, Any], PromptType] = {}
        for prompt in [*first, *second]:
            unique.setdefault(_prompt_key(prompt), prompt)
        position = {key: i for i, key in enumerate(unique)}
        at = [position[_prompt_key(p)] for p in first], [position[_prompt_key(p)] for p in second]
        indices = [(at[0][i], at[1][j]) for i, j in pairs]
        if pooling.late_interaction:  # (ColBERT: one vector a token, scored by MaxSim)
            encoded = self.encode(list(unique.values()), use_tqdm=use_tqdm, lora_request=lora_request)
            ids = [e.prompt_token_ids for e in encoded]
            scores = maxsim_scores([e.outputs.data.flatten().tolist() for e in encoded], pooling.row_size,
                                   indices)
        else:
            embedded = self.embed(list(unique.values()), use_tqdm=use_tqdm, lora_request=lora_request)
            ids = [e.prompt_token_ids for e in embedded]
            scores = cosine_scores([e.outputs.embedding for e in embedded], indices)
        return [ScoringRequestOutput(str(next(self._ids)), ScoringOutput(score), ids[a] + ids[b])
                for (a, b), score in zip(indices, scores, strict=True)]

    def _cross_encoder_scores(self, first: list[PromptType], second: list[PromptType],
                              pairs: list[tuple[int, int]], use_tqdm: bool, lora_request: LoRARequest | None
                              ) -> list[ScoringRequestOutput]:
        info = self._model_info()
        if len(info.pooling.labels) != 1:
            raise ValueError("LLM.score needs a cross-encoder with one output; this classifier has "
                             f"{len(info.pooling.labels)} classes (use LLM.classify)")
        if not all(isinstance(p, str) for p in (*first, *second)):
            raise ValueError("a cross-encoder scores text pairs: give texts on both sides")
        joined = [tokenize_pair(self.tokenizer, first[i], second[j], joined=info.pooling.joins_pair_text)
                  for i, j in pairs]
        params = _pooled_params(info)
        each = [pair_params(params, start, info.pooling.token_types) for _, start in joined]
        return [ScoringRequestOutput(request_id, ScoringOutput(
                    class_probabilities(logits, info.pooling.cross_encoder_activation)[0]), ids)
                for request_id, ids, logits in self._pool([ids for ids, _ in joined], each, lora_request, use_tqdm,
                                                          "Scored pairs")]

    def _placeholder_ids(self, index: int, embeds: PromptEmbeds, max_tokens: int) -> list[int]:
        """The placeholder token ids of a prompt given as embeddings, checked as ``_prompt_ids`` checks."""
        if not self.engine_configs[0].enable_prompt_embeds:
            raise ValueError(f"prompt {index} is given as embeddings: start the LLM with enable_prompt_embeds=True")
        width = self._model_info().input_embedding_size
        if embeds.hidden_size != width:
            raise ValueError(f"prompt {index}: embeddings must have rows of the model's hidden size {width}, not "
                             f"{embeds.hidden_size}")
        if embeds.num_tokens > max_tokens:
            raise ValueError(f"prompt {index} has {embeds.num_tokens} embeddings; max_model_len is "
                             f"{self._max_model_len()}")
        return [0] * embeds.num_tokens

    def _prompt_ids(self, index: int, prompt: PromptType | PromptEmbeds, vocab: int, max_tokens: int,
                    truncate: int | None = None) -> list[int]:
        """A prompt's token ids, checked before anything is queued, as vLLM does: a bad prompt fails
        the call, not a pass. ``truncate``: only its last this many tokens (-1: the most that fit)."""
        if isinstance(prompt, PromptEmbeds):
            raise ValueError(f"prompt {index} is given as embeddings: only LLM.generate takes them")
        if isinstance(prompt, _ImagePrompt):
            raise ValueError(f"prompt {index} has images: only LLM.generate and LLM.chat take them")
        ids = list(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)
        if truncate is not None:  # (-1: as much as leaves room for one token)
            ids = ids[-(max_tokens if truncate == -1 else truncate):]
        if not ids:
            raise ValueError(f"prompt {index} is empty")
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt {index}: token ids must be integers in [0, {vocab})")
        if len(ids) > max_tokens:
            raise ValueError(f"prompt {index} has {len(ids)} tokens; max_model_len is {self._max_model_len()}"
                             + (", which leaves no room to generate" if max_tokens < self._max_model_len() else ""))
        return ids

    def _image_prompt(self, index: int, prompt: _ImagePrompt, vocab: int, max_tokens: int,
                      truncate: int | None) -> tuple[list[int], list[MultiModalFeature]]:
        """An image prompt's token ids (each image token expanded to the image's placeholders) and its
        images as the engines take them (processed here, by the model's image processor)."""
        if truncate is not None:
            raise ValueError(f"prompt {index} has images: truncate_prompt_tokens would cut into them")
        images = self._images()
        try:
            images.check_count(len(prompt.images))
            processed = []
            for image in prompt.images:  # (the router's checks: not too large or too narrow; RGB)
                check_image_size(image.width, image.height)
                processed.append(images.process_image(as_rgb(image)))
            if images.geometry.bidirectional and not isinstance(prompt.prompt, str) \
                    and images.image_token_id not in prompt.prompt:
                raise ValueError("a Gemma 3 prompt given as token ids must hold each image's whole sequence (its "
                                 "image token where the image goes, between its begin and end tokens); or give "
                                 "the prompt as text, where its <start_of_image> is written out as its processor does")
            if images.geometry.tiled and not isinstance(prompt.prompt, str):
                self._check_wrapped_image_tokens(prompt.prompt, images)
            text = images.prompt_text(prompt.prompt) if isinstance(prompt.prompt, str) else prompt.prompt
            images.check_count(len(prompt.videos), "video")
            processor = images.image_processor
            videos = [process_video(video, images.geometry, processor.image_mean, processor.image_std, self.model_dir)
                      for video in prompt.videos]
            ids, offsets, video_offsets = images.expand_media(self._prompt_ids(index, text, vocab, max_tokens),
                                                              [p.image_size for p in processed], videos)
        except ValueError as e:
            raise ValueError(f"prompt {index}: {e}") from None
        if len(ids) > max_tokens:
            raise ValueError(f"prompt {index} has {len(ids)} tokens with its images' placeholders; max_model_len "
                             f"is {self._max_model_len()}")
        return ids, images.features(processed, ids, offsets, videos, video_offsets)

    def _check_wrapped_image_tokens(self, ids: list[int], images: MultiModalProcessor) -> None:
        """InternVL: a prompt given as token ids must hold each image token between the begin and end
        tokens its processor writes around it (a prompt given as text gets them written in)."""
        assert images.prompt_replacement is not None
        token_text, replacement = images.prompt_replacement
        begin, end = (self.tokenizer.convert_tokens_to_ids(t) for t in replacement.split(token_text))
        for i, t in enumerate(ids):
            if t == images.image_token_id and not (0 < i < len(ids) - 1 and ids[i - 1] == begin and ids[i + 1] == end):
                raise ValueError(f"a prompt given as token ids must hold each image as {replacement} (its image "
                                 "token between its begin and end tokens); or give the prompt as text, where they "
                                 "are written in as its processor does")

    def _images(self) -> MultiModalProcessor:
        """The model's image processing (its placeholder token, tokens per image, image processor)."""
        if self._image_processor is None:
            info = self._model_info()
            if self.cluster_config.language_model_only and info.image_token_id is None:
                raise ValueError(f"At most 0 image(s) may be provided in one prompt (limit_mm_per_prompt "
                                 f"{{'image': 0}} for {info.served_model_name})")
            if info.image_token_id is None:
                raise ValueError(f"{info.served_model_name} takes no images: it is not a vision-language model")
            processor = load_image_processor(self.model_dir)
            self._image_processor = MultiModalProcessor(
                info.image_token_id, info.image_geometry, processor,
                self.model_dir, image_placeholder(self.tokenizer, info.image_token_id, info.image_geometry),
                max_images=self.cluster_config.limit_mm_per_prompt.get("image", DEFAULT_LIMIT_PER_PROMPT),
                prompt_replacement=image_prompt_text(self.tokenizer, info.image_token_id, info.image_geometry),
                video_token_id=info.video_token_id, video_placeholder=video_placeholder(self.tokenizer,
                                                                                        info.video_token_id),
                max_videos=self.cluster_config.limit_mm_per_prompt.get("video", DEFAULT_LIMIT_PER_PROMPT),
                video_sampling=video_sampling_from(self.cluster_config.media_io_kwargs),
                timed_videos=timed_video_tokens(self.tokenizer, info.video_token_id, info.image_geometry),
                tiled_images=tiled_image_tokens(self.tokenizer, processor, info.image_token_id, info.image_geometry))
        return self._image_processor

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request: LoRARequest | None = None, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search`` (engine_core.beam_search): each round, every prompt's live beams
        are generated together, one token each with their best 2 x width alternatives (at most
        --max-logprobs); a beam ends at an end-of-sequence token (unless ``ignore_eos``), the others
        run ``max_tokens`` rounds or to the context's end."""
        if params.beam_width < 1 or params.max_tokens < 1:
            raise ValueError("beam_width and max_tokens must be at least 1")
        if not self._model_info().pooling.generates:
            raise ValueError("this model is an embedding model (runner pooling): it does not generate")
        info, vocab, max_model_len = self._model_info(), len(self.tokenizer), self._max_model_len()
        stop_ids = set() if params.ignore_eos else set(info.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())
        searches, rounds, salts = [], [], []
        for index, prompt in enumerate(self._as_prompt_list(prompts, salts)):
            ids = self._prompt_ids(index, prompt, vocab, max_model_len - 1)
            searches.append(BeamSearch(ids, params.beam_width, stop_ids, params.length_penalty))
            rounds.append(min(params.max_tokens, max_model_len - len(ids)))
        limit = vocab if info.max_logprobs < 0 else info.max_logprobs
        step = SamplingParams(max_tokens=1, logprobs=candidates_per_beam(params.beam_width, limit),
                              temperature=params.temperature)
        rows: dict[int, dict[int, Logprob]] = {}  # id of a step's alternatives -> the engine's Logprob row
        for round_index in _progress(use_tqdm)(range(max(rounds)), desc="Beam search", disable=not use_tqdm):
            live = [(search, beam, salt) for search, left, salt in zip(searches, rounds, salts, strict=True)
                    if round_index < left for beam in search.live]
            if not live:
                break
            outputs = self.generate([{"prompt_token_ids": beam.tokens, "cache_salt": salt} if salt else beam.tokens
                                     for _, beam, salt in live], step, use_tqdm=False, lora_request=lora_request)
            steps: dict[int, list] = {}
            for (search, _, _), out in zip(live, outputs, strict=True):
                sample = out.outputs[0]
                row = sample.logprobs[0]  # (the sampled token first, then the best alternatives)
                alternatives = [(token, logprob.logprob) for token, logprob in row.items()][1:]
                rows[id(alternatives)] = row
                steps.setdefault(id(search), []).append((sample.token_ids[0], row[sample.token_ids[0]].logprob,
                                                         alternatives))
            for search in searches:
                if id(search) in steps:
                    search.advance(steps[id(search)])
        results = []
        for search in searches:
            sequences = []
            for beam in search.best():
                tokens = beam.tokens
                if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
                    tokens = tokens[:-1]
                sequences.append(BeamSearchSequence(
                    tokens=tokens, cum_logprob=beam.cum_logprob, text=self.tokenizer.decode(tokens),
                    finish_reason=beam.finish_reason, stop_reason=beam.stop_reason,
                    logprobs=[{token: rows[id(top)][token], **{t: lp for t, lp in rows[id(top)].items() if t != token}}
                              for token, _, top in beam.steps]))
            results.append(BeamSearchOutput(sequences))
        return results

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             chat_template: str | None = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: each conversation rendered with the chat template (or ``chat_template``),
        the ``tools`` passed to it; ``continue_final_message`` leaves the last message open for the
        answer to continue (instead of starting a new assistant turn). Messages' content reaches the
        template as text, or as OpenAI's list of parts (``chat_template_content_format``: auto reads
        the template, as the server's flag). The parameters come in vLLM's order, so positional
        calls written for vLLM bind as they do there."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        batch = [messages] if messages and isinstance(messages[0], dict) else messages
        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format must be one of {CONTENT_FORMATS}")
        content_format = resolve_content_format(chat_template_content_format, chat_template,
                                                self.tokenizer.chat_template, bool(tools))
        prompts: list[PromptType | _ImagePrompt] = []
        for conversation in batch:
            images, videos = [], []
            for m in conversation:  # (a part the model cannot be shown is refused, not dropped)
                for part in m.get("content") if isinstance(m.get("content"), list) else ():
                    if isinstance(part, str) or part.get("type") in TEXT_PART_TYPES:
                        continue
                    if part.get("type") not in ("image_url", "image_pil", "video_url"):
                        raise ValueError(f"message content of type {part.get('type')!r} is not supported "
                                         "(text, images and videos)")
                    media = self._images()  # (a model that takes none refuses them before any is loaded)
                    if part.get("type") == "video_url":
                        media.check_count(len(videos) + 1, "video")
                        videos.append(_chat_video(part, media.geometry, media.video_sampling))
                    else:
                        images.append(_chat_image(part))
            placeholder = self._images().placeholder if images or videos else None
            video_text = self._images().video_placeholder if videos else None
            conversation = [{**m, "content": template_content(_image_parts_marked(m.get("content")), content_format,
                                                              placeholder, video_text)} for m in conversation]
            # (The explicit arguments win over chat_template_kwargs' keys of the same name, as vLLM merges them.)
            text = self.tokenizer.apply_chat_template(conversation, **{
                **(chat_template_kwargs or {}), "add_generation_prompt": add_generation_prompt, "tokenize": False,
                "continue_final_message": continue_final_message, "chat_template": chat_template, "tools": tools})
            if images:  # (Gemma 3: each image's sequence, as its processor writes it)
                text = self._images().prompt_text(text)
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            prompts.append(_ImagePrompt(ids, images, videos) if images or videos else ids)
        outputs = self.generate(prompts, sampling_params, use_tqdm, lora_request)
        for out, prompt in zip(outputs, prompts):
            out.prompt = self.tokenizer.decode(prompt.prompt if isinstance(prompt, _ImagePrompt) else prompt)
        return outputs

    def _resolve_params(self, params: EngineSamplingParams, vocab: int) -> EngineSamplingParams:
        """Bad words become token sequences; every token id the parameters name must be in the
        vocabulary (checked before anything is queued)."""
        if params.structured_output is not None:
            check_structured_output(params.structured_output)
        words = getattr(params, "bad_words", None)
        if words:
            params = dataclasses.replace(params, bad_words_token_ids=bad_words_token_ids(self.tokenizer, words))
        outside = sorted({t for t in params.token_ids_in_use() if t >= vocab})
        if outside:
            raise ValueError(f"sampling parameters name token ids outside the vocabulary [0, {vocab}): {outside[:8]}")
        info = self._model_info()  # (the engines refuse it too, but mid-batch)
        for kind, asked in (("sample", params.logprobs), ("prompt", params.prompt_logprobs)):
            logprobs_count(kind, asked, info.vocab_size, info.max_logprobs)
        if info.pooling.generates and self.engine_configs[0].speculative_config is None:
            validate_request_params(self._logits_processor_classes, params)
        return params

    def _load_lora(self, lora: LoRARequest) -> None:
        """Load an adapter on every engine unless it is loaded already (vLLM loads on first use too)."""
        if self._engine is not None:
            self._engine.add_lora(lora)
        else:
            import ray

            ray.get([h.actor.add_lora.remote(lora) for h in self._handles])

    @staticmethod
    def _as_lora_list(lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int) -> list[LoRARequest | None]:
        if lora is None or isinstance(lora, LoRARequest):
            return [lora] * n
        loras = list(lora)
        if len(loras) != n:
            raise ValueError(f"lora_request has {len(loras)} entries for {n} prompts")
        return loras

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (vLLM's accessor)."""
        return self.tokenizer

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Empty every engine's prefix cache (vLLM's); False when an engine still holds requests.
        (vLLM's two arguments are taken: offline, nothing runs between calls, and the KV offloading
        tier keeps its blocks.)"""
        if self._engine is not None:
            return self._engine.reset_prefix_cache()
        import ray

        return all(ray.get([h.actor.reset_prefix_cache.remote() for h in self._handles]))

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (``enable_sleep_mode=True``): every engine empties its prefix cache and
        releases its KV cache, and its weights are moved to host memory (level 1; on the CPU they
        stay) or discarded (level 2: read from the checkpoint again on wake-up). generate() and the
        other calls are refused until wake_up()."""
        if self._engine is not None:
            self._engine.check_sleep(level)
            if not self._engine.is_sleeping() and not self._engine.reset_prefix_cache():
                raise RuntimeError("the engine still holds requests: it cannot sleep")
            self._engine.sleep(level)
        else:
            import ray

            ray.get([h.actor.sleep.remote(level) for h in self._handles])

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``tags`` name ("weights", "kv_cache"; None: both), e.g. the weights first to
        update them, then the KV cache."""
        if self._engine is not None:
            self._engine.wake_up(tags)
        else:
            import ray

            ray.get([h.actor.wake_up.remote(tags) for h in self._handles])

    def is_sleeping(self) -> bool:
        """Whether any engine has something released."""
        if self._engine is not None:
            return self._engine.is_sleeping()
        import ray

        return any(ray.get([h.actor.is_sleeping.remote() for h in self._handles]))

    def get_stats(self) -> list[Any]:
        if self._engine is not None:
            return [self._engine.stats()]
        import ray

        return ray.get([h.actor.get_stats.remote() for h in self._handles])

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
        if self._handles:
            self._stop_engines()
            self._handles = []

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- execution ------------------------------------------------------------------------------

    def _max_model_len(self) -> int:
        self._model_info()  # (refuses a shut-down LLM)
        if self._engine is not None:
            return self._engine.scheduler_config.max_model_len
        return min(h.description.scheduler_config["max_model_len"] for h in self._handles)

    def _load_loras(self, loras: list[LoRARequest | None]) -> None:
        """Load (once each) the adapters not loaded yet."""
        for lora in {lora.lora_int_id: lora for lora in loras if lora is not None}.values():
            self._load_lora(lora)

    def _run(self, requests: list[EngineCoreRequest], pending: dict[str, _Pending], desc: str,
             use_tqdm: bool) -> None:
        if any(c.enable_sleep_mode for c in self.engine_configs) and self.is_sleeping():
            raise RuntimeError("the LLM is sleeping: call wake_up() first")
        with _progress(use_tqdm)(total=len(requests), desc=desc, disable=not use_tqdm) as bar:
            if self._engine is not None:
                self._run_in_process(requests, pending, bar)
            else:
                self._run_on_ray(requests, pending, bar)

    def _run_in_process(self, requests: list[EngineCoreRequest], pending: dict[str, _Pending], bar: tqdm) -> None:
        engine = self._engine
        assert engine is not None
        stepping = False
        try:
            for request in requests:
                engine.add_request(request)
            remaining = len(requests)
            while remaining:
                stepping = True
                outputs = engine.step()
                stepping = False
                finished, stopped = self._apply(outputs.values(), pending, bar)
                remaining -= finished
                if stopped:  # a stop string ended them: the engine stops too
                    engine.abort_requests(stopped)
                if remaining and not engine.has_work():
                    raise RuntimeError("the engine has no work left but requests are unfinished")
        except BaseException:
            # Ctrl-C or an error: nothing of this call stays in the engine (nor its KV blocks).
            engine.abort_requests([rid for rid, p in pending.items() if not p.done])
            if stepping:
                # A pass cut short registered blocks in the prefix cache (and KV offloading's tier) whose
                # KV it never computed (or copied): forget them all rather than serve them later.
                engine.reset_prefix_cache()
            raise

    def _run_on_ray(self, requests: list[EngineCoreRequest], pending: dict[str, _Pending], bar: tqdm) -> None:
        import ray

        handles = [h.actor for h in self._handles]
        # Spread prompts across engines, in order (results keep the prompts' order regardless).
        for i, request in enumerate(requests):
            pending[request.request_id].engine = i % len(handles)
        try:
            # (Each admission is awaited, so a refused request raises here: the others are aborted below.)
            ray.get([handles[pending[r.request_id].engine].add_request.remote(r) for r in requests])
            remaining = len(requests)
            while remaining:
                outs = ray.get([h.get_output.remote(0, 0.5) for h in handles])
                finished, stopped = self._apply(outs, pending, bar)
                remaining -= finished
                for rid in stopped:  # a stop string ended them: the engines stop too
                    handles[pending[rid].engine].abort_requests.remote([rid])
        except BaseException:
            # Ctrl-C or an error: nothing of this call stays in the engines (nor its KV blocks).
            unfinished = [rid for rid, p in pending.items() if not p.done]
            for i, handle in enumerate(handles):
                ids = [rid for rid in unfinished if pending[rid].engine == i]
                if ids:
                    with contextlib.suppress(Exception):
                        ray.get(handle.abort_requests.remote(ids), timeout=30)
            raise

    @staticmethod
    def _apply(outputs: Any, pending: dict[str, _Pending], bar: tqdm) -> tuple[int, list[str]]:
        """Samples finished by these outputs, and those a stop string ended (to abort in the engine)."""
        now = time.time()
        finished = 0
        stopped = []
        for eco in outputs:
            eco: EngineCoreOutputs
            for out in eco.outputs:
                p = pending.get(out.request_id)
                if p is None or p.done:
                    continue
                if p.apply(out, now):
                    stopped.append(out.request_id)
                if p.done:
                    finished += 1
                    bar.update(1)
        return finished, stopped

    def _text(self, p: _Pending) -> str:
        if not p.detokenize:
            return ""
        if p.detok is not None and isinstance(p.stop_reason, str):
            return p.detok.output_text  # cut at the stop string (kept when include_stop_str_in_output)
        # The EOS or stop token that ended the request is not part of its text unless
        # include_stop_str_in_output (vLLM); token_ids keep it. The text reads as after the prompt.
        text_ids = p.token_ids[:-1] if p.finish_reason == "stop" and not p.include_stop else p.token_ids
        return decode_after(self.tokenizer, p.prompt_ids or [], text_ids, p.skip_special)

    def _decode_token(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = token_text(
                self.tokenizer, lambda ids, skip: self.tokenizer.decode(ids, skip_special_tokens=skip), token_id)
        return text

    def _sample_output(self, p: _Pending) -> CompletionOutput:
        logprobs = cumulative = None
        if p.logprob_entries is not None:
            logprobs = [row for ids, entry in p.logprob_entries
                        for row in _logprob_dicts(ids, entry, self._decode_token)]
            cumulative = sum(row[tid].logprob for row, tid in zip(logprobs, p.token_ids, strict=False))
        return CompletionOutput(index=p.index, text=self._text(p), token_ids=p.token_ids, finish_reason=p.finish_reason,
                                logprobs=logprobs, stop_reason=p.stop_reason, cumulative_logprob=cumulative)

    def _to_output(self, request_id: str, samples: list[_Pending]) -> RequestOutput:
        first = samples[0]
        prompt_logprobs = None
        entry = next((p.prompt_logprobs for p in samples if p.prompt_logprobs is not None), None)
        if entry is not None:
            prompt_logprobs = [None, *_logprob_dicts(first.prompt_ids[1:], entry, self._decode_token)]
        return RequestOutput(request_id=request_id, prompt=first.prompt, prompt_token_ids=first.prompt_ids,
                             outputs=[self._sample_output(p) for p in samples],
                             finished=all(p.done for p in samples), metrics=first.metrics,
                             prompt_logprobs=prompt_logprobs, num_cached_tokens=first.num_cached_tokens)

    @staticmethod
    def _as_prompt_list(prompts: PromptType | Sequence[PromptType],
                        salts: list[str | None] | None = None) -> list[PromptType | PromptEmbeds]:
        """Text, token ids, or vLLM's prompt dicts ({"prompt": text} / {"prompt_token_ids": ids} /
        {"prompt_embeds": a [tokens, hidden_size] tensor}), one or a list of them. ``salts``: filled
        with each prompt's ``cache_salt`` (a prompt dict's key, as vLLM's: prompts with different salts
        share no prefix-cache blocks)."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            prompts = [prompts]  # one prompt given as token ids
        out: list[PromptType | PromptEmbeds] = []
        for prompt in prompts:
            salt = None
            if isinstance(prompt, dict):
                unserved = sorted(k for k, v in prompt.items() if k not in _PROMPT_KEYS and v is not None)
                if unserved and _PROMPT_KEYS & set(prompt):
                    # (mm_processor_kwargs and the like: left out, the model would answer otherwise)
                    raise ValueError(f"a prompt's {', '.join(unserved)} cannot be served: prompts are text, token "
                                     "ids, embeddings, or text or token ids with multi_modal_data images")
                salt = prompt.get("cache_salt")
                if salt is not None and (not isinstance(salt, str) or not salt):
                    raise ValueError("a prompt's cache_salt must be a non-empty string")
                if prompt.get("multi_modal_data") is not None:
                    prompt = _image_prompt(prompt)
                elif "prompt_embeds" in prompt:
                    prompt = PromptEmbeds.from_tensor(prompt["prompt_embeds"])
                elif "prompt_token_ids" in prompt:
                    prompt = list(prompt["prompt_token_ids"])
                elif isinstance(prompt.get("prompt"), str):
                    prompt = prompt["prompt"]
                else:
                    raise TypeError(f"a prompt dict needs 'prompt' (text), 'prompt_token_ids' or 'prompt_embeds', got "
                                    f"{sorted(prompt)}")
            elif not isinstance(prompt, str | list | _ImagePrompt):  # (LLM.chat's image prompts come made)
                raise TypeError(f"a prompt is text, a list of token ids or a prompt dict, got {type(prompt).__name__}")
            out.append(prompt)
            if salts is not None:
                salts.append(salt)
        return out

    @staticmethod
    def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(params, EngineSamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling_params for {n} prompts")
        return params


def _image_prompt(prompt: dict[str, Any]) -> _ImagePrompt:
    """vLLM's prompt dict with ``multi_modal_data`` ({"image": a PIL image or a list of them})."""
    from PIL import Image

    data = prompt["multi_modal_data"]
    if not isinstance(data, dict) or set(data) - {"image", "video"}:
        raise ValueError(f"multi_modal_data takes images and videos ({{'image': ..., 'video': ...}}), got "
                         f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
    images = data.get("image")
    images = [] if images is None else images if isinstance(images, list) else [images]
    if not all(isinstance(image, Image.Image) for image in images):
        raise TypeError("multi_modal_data's images must be PIL images")
    # (A video: an array or a list of PIL frames; several: a list of those.)
    given = data.get("video")
    several = isinstance(given, list) and bool(given) and not isinstance(given[0], Image.Image)
    videos = [] if given is None else [_video_of(v) for v in (given if several else [given])]
    if "prompt_embeds" in prompt:
        raise ValueError("a prompt given as embeddings cannot have multi_modal_data")
    text = prompt.get("prompt_token_ids", prompt.get("prompt"))
    if not isinstance(text, str | list):
        raise TypeError("a prompt with multi_modal_data needs 'prompt' (text) or 'prompt_token_ids'")
    return _ImagePrompt(text if isinstance(text, str) else list(text), images, videos)


def _chat_image(part: dict[str, Any]) -> Any:
    """An image part of LLM.chat's messages as a PIL image: vLLM's ``image_pil``, or an ``image_url``
    (a data: URL; http(s) fetched here; file:// is refused, as the server refuses it without
    --allowed-local-media-path)."""
    import asyncio

    from PIL import Image

    from router.multimodal import MediaConnector, decode_image

    if part.get("type") == "image_pil":
        image = part.get("image_pil")
        if not isinstance(image, Image.Image):
            raise TypeError("an image_pil part must hold a PIL image")
        return image.convert("RGB")
    url = (part.get("image_url") or {}).get("url") if isinstance(part.get("image_url"), dict) else None
    if not isinstance(url, str):
        raise ValueError('an image_url part needs {"image_url": {"url": ...}}')
    return decode_image(asyncio.run(MediaConnector().fetch_bytes(url)))


def _chat_video(part: dict[str, Any], geometry: ImageGeometry, sampling: VideoSampling) -> DecodedVideo:
    """A video part of LLM.chat's messages (vLLM's ``video_url``: a data: URL, or http(s) fetched
    here), decoded and its frames sampled (router.video)."""
    import asyncio

    from router.multimodal import MediaConnector

    url = (part.get("video_url") or {}).get("url") if isinstance(part.get("video_url"), dict) else None
    if not isinstance(url, str):
        raise ValueError('a video_url part needs {"video_url": {"url": ...}}')
    return decode_video(asyncio.run(MediaConnector().for_videos().fetch_bytes(url)), geometry, sampling)


def _video_of(frames: Any) -> DecodedVideo:
    """vLLM's ``multi_modal_data`` video: its frames (a [frames, height, width, 3] uint8 array, or PIL
    images), taken as sampled at Qwen's 2 frames a second."""
    import numpy as np
    from PIL import Image

    if isinstance(frames, np.ndarray):
        if frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"a video array must be [frames, height, width, 3], got {list(frames.shape)}")
        frames = [Image.fromarray(np.asarray(frame, dtype=np.uint8)) for frame in frames]
    if not frames or not all(isinstance(frame, Image.Image) for frame in frames):
        raise TypeError("a video must be a [frames, height, width, 3] array or a list of PIL images")
    return DecodedVideo([frame.convert("RGB") for frame in frames], len(frames), VIDEO_FPS,
                        (frames[0].height, frames[0].width))


def _image_parts_marked(content: Any) -> Any:
    """Message content with ``image_pil`` parts as image parts (the template sees every image alike)."""
    if not isinstance(content, list):
        return content
    marked = {"type": "image_url", "image_url": {"url": ""}}
    return [marked if isinstance(part, dict) and part.get("type") == "image_pil" else part for part in content]
