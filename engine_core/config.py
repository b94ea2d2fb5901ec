"""Engine-side configuration: frozen dataclasses validated in ``__post_init__``.

A bad value raises ``ValueError`` naming the flag and its allowed range; user input is never
checked with ``assert``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal, get_args

from engine_core.core.kv_cache_utils import AttentionWindow
from engine_core.kv_transfer import KVTransferConfig
from engine_core.lora import LoRAModule

# vLLM's --kv-cache-dtype choices that this engine stores (the workers map them to torch dtypes).
KVCacheDType = Literal["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"]
KV_CACHE_DTYPE_NAMES: tuple[str, ...] = get_args(KVCacheDType)
# The recurrent layers' state dtypes (vLLM's --mamba-cache-dtype, --mamba-ssm-cache-dtype).
MambaCacheDType = Literal["auto", "float32", "float16", "bfloat16"]
MAMBA_CACHE_DTYPE_NAMES: tuple[str, ...] = get_args(MambaCacheDType)
# What the prefix cache keeps of the recurrent layers (vLLM's --mamba-cache-mode): "none" (nothing:
# prefix caching is off for such models), "align" (their states at block boundaries worth keeping that the
# passes cross: kv_cache_manager.plan_state_saves).
MambaCacheMode = Literal["none", "align"]
MAMBA_CACHE_MODE_NAMES: tuple[str, ...] = get_args(MambaCacheMode)

# vLLM's --logprobs-mode: what the sampled tokens' logprobs (and top logprobs) are. raw_*: the model's
# logits (after a grammar's mask only), log-softmaxed or not; processed_*: the logits the token is
# drawn from (after penalties, biases, masks, temperature, min-p and top-k/top-p). Prompt logprobs
# are always raw.
LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
LOGPROBS_MODES: tuple[str, ...] = get_args(LogprobsMode)

# --dtype: the model's weights and activations (vLLM's choices, and their short names).
MODEL_DTYPE_NAMES = ("auto", "bfloat16", "float16", "float32", "half", "float", "bf16", "fp16", "fp32")

SchedulingPolicyName = Literal["fcfs", "priority"]

# vLLM's variable: the decoder layers of each pipeline stage, e.g. "10,14" (first stage first).
PP_LAYER_PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"


def layer_partition_from_env(pipeline_parallel_size: int) -> tuple[int, ...] | None:
    """VLLM_PP_LAYER_PARTITION ("10,14" -> (10, 14)) for an engine of several pipeline stages, as the
    process that makes the engines' configs reads it (once: the config carries it to the engine and
    its workers); None when unset or for one stage."""
    text = os.environ.get(PP_LAYER_PARTITION_ENV, "")
    if pipeline_parallel_size == 1 or not text:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"{PP_LAYER_PARTITION_ENV} must be comma-separated layer counts, one per pipeline stage "
                         f"(e.g. 10,14), got {text!r}") from None


def _require(condition: bool, flag: str, allowed: str, value: object) -> None:
    if not condition:
        raise ValueError(f"{flag} must be {allowed}, got {value!r}")


# The drafters speculative decoding has (SpeculativeConfig.method).
SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model", "mtp", "eagle", "eagle3")
# The methods whose drafts the engine proposes from token ids (the others' come from the workers).
TOKEN_DRAFT_METHODS = ("ngram", "suffix")
SUFFIX_FIELDS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                 "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")
# The methods whose drafter is a checkpoint of its own (``model``): a draft model, an EAGLE head.
DRAFT_CHECKPOINT_METHODS = ("draft_model", "eagle", "eagle3")
# vLLM's older names of the mtp method, by model family.
MTP_METHOD_ALIASES = ("deepseek_mtp", "glm4_moe_mtp", "qwen3_next_mtp")

# The per-pass token budget when --max-num-batched-tokens is not given (vLLM's default for online serving).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    # None: DEFAULT_MAX_NUM_BATCHED_TOKENS, or max_model_len where that is more and prompts run whole
    # (chunked prefill off, an encoder), as vLLM derives it.
    max_num_batched_tokens: int | None = None
    # When set, outranks max_num_batched_tokens as the per-pass token budget (seed: "silently outranks").
    max_num_scheduled_tokens: int | None = None
    # None: the model's own context length (the engine fills it in when it loads the model).
    max_model_len: int | None = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    policy: SchedulingPolicyName = "fcfs"
    # vLLM's --disable-chunked-mm-input: a chunk never ends inside an image's placeholders (it stops
    # before the image instead), for models whose image tokens must be computed in one pass.
    disable_chunked_mm_input: bool = False

    def __post_init__(self) -> None:
        _require(isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1,
                 "max_num_seqs", ">= 1", self.max_num_seqs)
        budget_derived = self.max_num_batched_tokens is None
        object.__setattr__(self, "_budget_derived", budget_derived)
        if budget_derived:
            whole = not self.enable_chunked_prefill and self.max_model_len is not None
            object.__setattr__(self, "max_num_batched_tokens", max(DEFAULT_MAX_NUM_BATCHED_TOKENS,
                                                                   self.max_model_len if whole else 0))
        _require(isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1,
                 "max_num_batched_tokens", ">= 1", self.max_num_batched_tokens)
        _require(self.max_num_scheduled_tokens is None
                 or (isinstance(self.max_num_scheduled_tokens, int) and self.max_num_scheduled_tokens >= 1),
                 "max_num_scheduled_tokens", "None or >= 1", self.max_num_scheduled_tokens)
        _require(self.max_model_len is None or (isinstance(self.max_model_len, int) and self.max_model_len >= 1),
                 "max_model_len", "None (the model's) or >= 1", self.max_model_len)
        _require(isinstance(self.long_prefill_token_threshold, int) and self.long_prefill_token_threshold >= 0,
                 "long_prefill_token_threshold", ">= 0", self.long_prefill_token_threshold)
        _require(isinstance(self.max_num_partial_prefills, int) and self.max_num_partial_prefills >= 1,
                 "max_num_partial_prefills", ">= 1", self.max_num_partial_prefills)
        _require(isinstance(self.max_long_partial_prefills, int)
                 and 1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills,
                 "max_long_partial_prefills", f"between 1 and max_num_partial_prefills "
                 f"({self.max_num_partial_prefills})", self.max_long_partial_prefills)
        _require(self.policy in ("fcfs", "priority"), "policy", "one of 'fcfs', 'priority'", self.policy)
        # Without chunked prefill a prompt is admitted whole or not at all: one longer than the
        # per-pass budget would wait at the head of the queue forever (vLLM refuses this too).
        _require(self.enable_chunked_prefill or self.max_model_len is None or self.token_budget >= self.max_model_len,
                 "max_num_batched_tokens", f">= max_model_len ({self.max_model_len}) when chunked prefill is "
                 "disabled, or prompts longer than the budget could never be scheduled", self.token_budget)
        # Partial prefills are chunks of prompts: without chunked prefill there are none to cap, and a
        # threshold past the context could never mark a prompt long (vLLM refuses both).
        _require(self.max_num_partial_prefills == 1 or self.enable_chunked_prefill, "max_num_partial_prefills",
                 "1 when chunked prefill is disabled", self.max_num_partial_prefills)
        _require(self.max_num_partial_prefills == 1 or self.max_model_len is None
                 or self.long_prefill_token_threshold <= self.max_model_len, "long_prefill_token_threshold",
                 f"<= max_model_len ({self.max_model_len}) with max_num_partial_prefills > 1",
                 self.long_prefill_token_threshold)
        # Seed: with max_num_partial_prefills > 1 and no threshold given, the config fills the
        # threshold in as 4% of the model's context length.
        derived = self.max_num_partial_prefills > 1 and self.long_prefill_token_threshold == 0
        object.__setattr__(self, "_threshold_derived", derived)
        if derived and self.max_model_len is not None:
            object.__setattr__(self, "long_prefill_token_threshold", int(self.max_model_len * 0.04))

    def _replaced(self, **changes: Any) -> SchedulerConfig:
        """``replace``, with what was derived from other flags left to be derived again."""
        derived: dict[str, Any] = {}
        if self._budget_derived:  # type: ignore[attr-defined]
            derived["max_num_batched_tokens"] = None
        if self._threshold_derived:  # type: ignore[attr-defined]
            derived["long_prefill_token_threshold"] = 0
        return replace(self, **{**derived, **changes})

    def with_max_model_len(self, max_model_len: int) -> SchedulerConfig:
        """The same flags for another context length; a threshold (or budget) derived from the
        context length is derived again from the new one."""
        return self._replaced(max_model_len=max_model_len)

    def for_whole_prompts(self) -> SchedulerConfig:
        """The same flags for a model whose prompts cannot be split (an encoder: every token attends
        to every other): no chunked prefill and no long-prefill threshold; a derived budget grows to
        max_model_len, and one set below it is refused (ValueError naming the flag)."""
        budget_set = not self._budget_derived or self.max_num_scheduled_tokens is not None  # type: ignore[attr-defined]
        if budget_set and self.max_model_len is not None and self.token_budget < self.max_model_len:
            raise ValueError(f"this model runs each prompt whole in one pass (an encoder), so max_num_batched_tokens "
                             f"({self.token_budget}) must be >= max_model_len ({self.max_model_len}): raise "
                             "--max-num-batched-tokens or lower --max-model-len")
        return self._replaced(enable_chunked_prefill=False, long_prefill_token_threshold=0,
                              max_num_partial_prefills=1, max_long_partial_prefills=1)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def token_budget(self) -> int:
        """The per-pass budget the scheduler seeds ``token_budget`` from."""
        # max_num_scheduled_tokens outranks max_num_batched_tokens when it is set.
        if self.max_num_scheduled_tokens is not None:
            return self.max_num_scheduled_tokens
        return self.max_num_batched_tokens


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Usable KV blocks. There is no reserved null block in this engine, so every id in
    # [0, num_blocks) can hold tokens.
    num_blocks: int = 4096
    enable_prefix_caching: bool = True
    # The model's sliding window when every layer attends through it (from the model, not a flag):
    # blocks behind a request's window are released as it advances.
    sliding_window: int | None = None
    # LongRoPE models (Phi-3 128k): the pretrained length; a longer prompt's blocks are keyed apart.
    long_rope_after: int | None = None
    # vLLM's --kv-cache-metrics: the share of blocks followed for residency metrics (None: off).
    kv_cache_metrics_sample: float | None = None
    # KV offloading: the host-memory tier's size in blocks (0: off; engine_core/core/kv_offload.py).
    num_offload_blocks: int = 0
    # A model with recurrent layers under --mamba-cache-mode align: how many of their states the prefix
    # cache keeps at block ends (0: none; engine_core/core/recurrent_state_cache.py).
    num_recurrent_state_slots: int = 0
    # A model mixing full-attention and windowed layers, under the hybrid KV cache manager: the window
    # each KV cache group's layers attend within (None: full attention; group 0's). Each group holds
    # its own blocks of a request, a windowed group's released behind the window. Empty: one group.
    kv_cache_groups: tuple[AttentionWindow | None, ...] = ()

    @property
    def group_windows(self) -> tuple[AttentionWindow | None, ...]:
        """Each KV cache group's window: the hybrid manager's groups, or the one group's (its sliding window)."""
        if self.kv_cache_groups:
            return self.kv_cache_groups
        return (None if self.sliding_window is None else AttentionWindow(self.sliding_window),)

    def __post_init__(self) -> None:
        _require(isinstance(self.block_size, int) and self.block_size >= 1, "block_size", ">= 1", self.block_size)
        _require(isinstance(self.num_offload_blocks, int) and self.num_offload_blocks >= 0, "num_offload_blocks",
                 ">= 0", self.num_offload_blocks)
        _require(isinstance(self.num_blocks, int) and self.num_blocks >= 1, "num_blocks", ">= 1", self.num_blocks)
        _require(isinstance(self.num_recurrent_state_slots, int) and self.num_recurrent_state_slots >= 0,
                 "num_recurrent_state_slots", ">= 0", self.num_recurrent_state_slots)
        _require(self.sliding_window is None or (isinstance(self.sliding_window, int) and self.sliding_window >= 1),
                 "sliding_window", ">= 1", self.sliding_window)
        _require(self.kv_cache_metrics_sample is None or 0.0 < self.kv_cache_metrics_sample <= 1.0,
                 "kv_cache_metrics_sample", "in (0, 1]", self.kv_cache_metrics_sample)
        _require(not self.kv_cache_groups or (self.kv_cache_groups[0] is None and self.sliding_window is None
                                              and len(self.kv_cache_groups) > 1),
                 "kv_cache_groups", "empty, or a full-attention group first and more after it (no sliding_window)",
                 self.kv_cache_groups)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``--speculative-config``), these drafters:
    - ``ngram`` (prompt lookup): the draft is the tokens that followed the earliest occurrence
      of the context's last n tokens, for n from ``prompt_lookup_max`` down to ``prompt_lookup_min``;
    - ``suffix`` (suffix decoding): the most frequent continuation of the context's last tokens in
      the request's prompt and output and in earlier requests' answers (engine_core.suffix_decoding),
      at most ``num_speculative_tokens`` (by default ``suffix_decoding_max_tree_depth``);
    - ``draft_model``: a smaller model of the same vocabulary (``model``) proposes each draft token
      greedily, one pass per token (gpu_worker.draft_model); it runs on the same workers and KV
      block table as the target, with a cache of its own;
    - ``mtp``: the model's own multi-token-prediction layer (DeepSeek-V3 / R1, GLM-4.5 and later,
      Qwen3-Next and Qwen3.5, whose checkpoints hold one), fed the target's last hidden states,
      proposes each draft token greedily (gpu_worker.hidden_state_drafter); also on the target's
      workers, with a one-layer cache;
    - ``eagle`` / ``eagle3``: an EAGLE or EAGLE-3 head trained for the target (``model``: its
      directory), fed the target's last hidden state (EAGLE) or three inner ones (EAGLE-3), drafting
      as the MTP layer does (gpu_worker.eagle_config, gpu_worker.models.eagle)."""

    method: str = "ngram"
    # Required, as in vLLM: drafts per request per pass.
    num_speculative_tokens: int | None = None
    # None: the other bound, or 5 when both are None (vLLM's defaults). ngram only.
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # draft_model: the draft model (a name the engines know, a Hugging Face directory or a .gguf),
    # and its tensor parallelism (None, or the target's: the draft shards over the same workers).
    model: str | None = None
    draft_tensor_parallel_size: int | None = None
    # suffix (vLLM's names and defaults): the windows' depth, answers kept for other requests (-1:
    # all, 0: none), tokens drafted per token matched, and the least estimated probability drafted.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.method == "[ngram]":  # (vLLM's older spelling)
            object.__setattr__(self, "method", "ngram")
        if self.method in MTP_METHOD_ALIASES:
            object.__setattr__(self, "method", "mtp")
        _require(self.method in SPECULATIVE_METHODS, "speculative_config.method",
                 f"one of {', '.join(SPECULATIVE_METHODS)} (the drafters built)", self.method)
        if self.method == "suffix":
            self._check_suffix()
        else:
            for name in SUFFIX_FIELDS:
                _require(getattr(self, name) == SpeculativeConfig.__dataclass_fields__[name].default,
                         f"speculative_config.{name}", f"unset with method {self.method} (suffix's)",
                         getattr(self, name))
        _require(isinstance(self.num_speculative_tokens, int) and not isinstance(self.num_speculative_tokens, bool)
                 and self.num_speculative_tokens >= 1,
                 "speculative_config.num_speculative_tokens", "given, and >= 1", self.num_speculative_tokens)
        if self.method == "suffix":
            return
        if self.proposes_in_workers:
            _require(self.draft_tensor_parallel_size is None
                     or (type(self.draft_tensor_parallel_size) is int and self.draft_tensor_parallel_size >= 1),
                     "speculative_config.draft_tensor_parallel_size", "None or >= 1",
                     self.draft_tensor_parallel_size)
        if self.method in DRAFT_CHECKPOINT_METHODS:
            what = ("the draft model (a model name, directory or .gguf)" if self.method == "draft_model"
                    else "the EAGLE head (a model name or directory)")
            _require(isinstance(self.model, str) and self.model.strip() != "", "speculative_config.model",
                     f"{what} with method {self.method}", self.model)
            _require(self.prompt_lookup_min is None and self.prompt_lookup_max is None,
                     "speculative_config.prompt_lookup_min", f"unset with method {self.method} (ngram's)",
                     self.prompt_lookup_min if self.prompt_lookup_min is not None else self.prompt_lookup_max)
            return
        if self.method == "mtp":
            _require(self.model is None, "speculative_config.model",
                     "unset with method mtp (the drafter is the served model's own MTP layer)", self.model)
            _require(self.prompt_lookup_min is None and self.prompt_lookup_max is None,
                     "speculative_config.prompt_lookup_min", "unset with method mtp (ngram's)",
                     self.prompt_lookup_min if self.prompt_lookup_min is not None else self.prompt_lookup_max)
            return
        _require(self.model is None and self.draft_tensor_parallel_size is None, "speculative_config.model",
                 "unset with method ngram (a draft model needs method draft_model)", self.model)
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        _require(isinstance(lo, int) and lo >= 1, "speculative_config.prompt_lookup_min", ">= 1", lo)
        _require(isinstance(hi, int) and hi >= lo, "speculative_config.prompt_lookup_max",
                 f">= prompt_lookup_min ({lo})", hi)
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    def _check_suffix(self) -> None:
        depth = self.suffix_decoding_max_tree_depth
        _require(type(depth) is int and depth >= 1, "speculative_config.suffix_decoding_max_tree_depth", ">= 1",
                 depth)
        if self.num_speculative_tokens is None:  # (vLLM's default: as deep as the windows)
            object.__setattr__(self, "num_speculative_tokens", depth)
        cached = self.suffix_decoding_max_cached_requests
        _require(type(cached) is int and cached >= -1, "speculative_config.suffix_decoding_max_cached_requests",
                 ">= -1 (-1: no limit, 0: no answers kept)", cached)
        factor = self.suffix_decoding_max_spec_factor
        _require(isinstance(factor, int | float) and not isinstance(factor, bool) and factor > 0,
                 "speculative_config.suffix_decoding_max_spec_factor", "> 0", factor)
        prob = self.suffix_decoding_min_token_prob
        _require(isinstance(prob, int | float) and not isinstance(prob, bool) and 0 <= prob <= 1,
                 "speculative_config.suffix_decoding_min_token_prob", "in [0, 1]", prob)
        _require(self.model is None and self.draft_tensor_parallel_size is None, "speculative_config.model",
                 "unset with method suffix (it drafts from token ids)", self.model)
        _require(self.prompt_lookup_min is None and self.prompt_lookup_max is None,
                 "speculative_config.prompt_lookup_min", "unset with method suffix (ngram's)",
                 self.prompt_lookup_min if self.prompt_lookup_min is not None else self.prompt_lookup_max)

    @property
    def uses_draft_model(self) -> bool:
        """Whether the drafter is a checkpoint of its own (a draft model, an EAGLE head: ``model``)."""
        return self.method in DRAFT_CHECKPOINT_METHODS

    @property
    def num_lookahead_slots(self) -> int:
        """The cache slots a request keeps ahead of its tokens for the drafts the workers propose after a
        pass (the scheduler's num_lookahead_tokens; 0 where drafts come from the engine's token ids, which
        a pass schedules among its tokens)."""
        return (self.num_speculative_tokens or 0) if self.proposes_in_workers else 0

    @property
    def proposes_in_workers(self) -> bool:
        """Whether the drafts come from the workers, after each pass (a draft model, the MTP layer,
        an EAGLE head), rather than from the engine's token ids (n-gram, suffix)."""
        return self.method not in TOKEN_DRAFT_METHODS

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> SpeculativeConfig | None:
        """None or an empty mapping: no speculative decoding (``{}`` turns a cluster-wide default off
        for one engine in an override list). A ``model`` without a ``method`` is a draft model or an
        EAGLE head, as vLLM infers it (_implied_by_draft)."""
        if not data:
            return None
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
                 "draft_tensor_parallel_size", *SUFFIX_FIELDS}
        unknown = sorted(set(data) - known)
        _require(not unknown, "speculative_config", f"a mapping of {', '.join(sorted(known))}", unknown)
        if data.get("model") is not None and "method" not in data:
            data = {**data, **_implied_by_draft(str(data["model"]), "num_speculative_tokens" in data)}
        return cls(**data)


# config.json architectures naming an EAGLE-3 head (the EAGLE authors' and vLLM's).
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def _implied_by_draft(model: str, has_k: bool) -> dict[str, Any]:
    """What a draft ``model`` given without a ``method`` implies, as vLLM infers it: an EAGLE-3 head
    (one the speculators library saved, whose proposal also gives num_speculative_tokens where that
    is not given; one whose architectures name it; "eagle3" in its name), an EAGLE head ("eagle-"
    in its name), else a draft model (a GGUF, the default model, a directory of another model)."""
    path = Path(model).expanduser()
    try:
        cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else None
    except (OSError, ValueError):
        cfg = None
    if not isinstance(cfg, dict):  # (a GGUF, a model name, an unreadable config: a draft model)
        return {"method": "draft_model"}
    if cfg.get("speculators_model_type") in ("eagle", "eagle3"):
        implied: dict[str, Any] = {"method": cfg["speculators_model_type"]}
        methods = (cfg.get("speculators_config") or {}).get("proposal_methods") if isinstance(
            cfg.get("speculators_config"), dict) else None
        first = methods[0] if isinstance(methods, list) and methods and isinstance(methods[0], dict) else {}
        k = first.get("speculative_tokens")
        if not has_k and type(k) is int:
            implied["num_speculative_tokens"] = k
        return implied
    name = model.lower()
    if (cfg.get("architectures") or [None])[0] in EAGLE3_ARCHITECTURES or re.search(r"(?<![a-z])eagle3", name):
        return {"method": "eagle3"}
    if re.search(r"(?<![a-z])eagle-", name):
        return {"method": "eagle"}
    return {"method": "draft_model"}


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's ``--enable-lora`` family). Registered adapters are held in the
    workers' memory (at most ``max_cpu_loras`` of them); a batch mixes at most ``max_loras``
    different adapters."""

    max_loras: int = 1
    # Largest rank an adapter may have (vLLM's default: 16).
    max_lora_rank: int = 16
    # Adapters kept in the workers' (host) memory; the least recently used beyond it are read from
    # their checkpoints again when next needed. None (given): max_loras, as vLLM; always set after init.
    max_cpu_loras: int | None = None
    # Adapters registered at start-up (``--lora-modules``), with ids 1, 2, ... in this order.
    lora_modules: tuple[LoRAModule, ...] = ()

    def __post_init__(self) -> None:
        _require(isinstance(self.max_loras, int) and self.max_loras >= 1, "max_loras", ">= 1", self.max_loras)
        _require(isinstance(self.max_lora_rank, int) and self.max_lora_rank >= 1, "max_lora_rank", ">= 1",
                 self.max_lora_rank)
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        _require(isinstance(self.max_cpu_loras, int) and self.max_cpu_loras >= self.max_loras,
                 "max_cpu_loras", f"at least max_loras ({self.max_loras})", self.max_cpu_loras)
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules))


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine (one EngineCore actor + its TP worker group) needs; engines may differ."""

    model: str = "SmolLM2-135M-Instruct"
    # The name clients use (and the model_name label); defaults to the model's own name.
    served_model_name: str | None = None
    engine_index: int = 0
    tensor_parallel_size: int = 1
    # vLLM's --pipeline-parallel-size: the model's layers split into this many stages, one after the
    # other, each stage a tensor-parallel group of its own (tensor_parallel_size x
    # pipeline_parallel_size workers in all, possibly on several nodes).
    pipeline_parallel_size: int = 1
    # How many decoder layers each pipeline stage holds, first stage first (vLLM's
    # VLLM_PP_LAYER_PARTITION: see layer_partition_from_env); None: an even split.
    pp_layer_partition: tuple[int, ...] | None = None
    # "auto" picks cuda when available, else cpu.
    device: str = "auto"
    dtype: str = "auto"
    # The KV cache's storage dtype (vLLM's --kv-cache-dtype): "auto" (the model's), "bfloat16", or
    # "fp8" / "fp8_e4m3" / "fp8_e5m2" (one byte per element: more blocks for the same memory).
    kv_cache_dtype: KVCacheDType = "auto"
    # Models with recurrent layers (Mamba, Mamba-2, Gated DeltaNet, Kimi Delta Attention, lightning
    # attention, short convolutions): their per-request states' storage dtypes (vLLM's
    # --mamba-cache-dtype: the conv and recurrent states; and --mamba-ssm-cache-dtype: the recurrent
    # state alone). "auto": the conv state in the model's dtype, the recurrent state in fp32
    # (gpu_worker.mamba_config.resolve_mamba_state_dtypes).
    mamba_cache_dtype: MambaCacheDType = "auto"
    mamba_ssm_cache_dtype: MambaCacheDType = "auto"
    # --mamba-cache-mode: "none" turns prefix caching off for them (a hit would skip tokens whose state
    # is not kept); "align" keeps their states at the block boundaries worth keeping that prefill chunks
    # and decodes cross (chunks are not cut for it), so that a hit runs to the last state kept
    # (engine_core/core/recurrent_state_cache.py), in --mamba-prefix-cache-slots slots beside the live
    # states (None: max_num_seqs of them), taken from the KV cache's memory.
    mamba_cache_mode: MambaCacheMode = "none"
    mamba_prefix_cache_slots: int | None = None
    # Mixture-of-experts models: split the experts over the TP ranks (each holds E / tp of them whole)
    # instead of splitting every expert's width (vLLM's --enable-expert-parallel).
    enable_expert_parallel: bool = False
    # vLLM's --runner: "generate" (tokens; embeddings too, from the last token), "pooling" (embeddings
    # only: no LM head is loaded, generation is refused), "auto" (pooling for a bare-decoder
    # checkpoint such as e5-mistral's MistralModel, generate otherwise).
    runner: Literal["auto", "generate", "pooling"] = "auto"
    # vLLM's --pooler-config: {"pooling_type": "LAST" | "MEAN" | "CLS" | "ALL" | "STEP", "normalize": bool,
    # "step_tag_id": int, "returned_token_ids": [int, ...]} (the last two: STEP only), over what
    # the checkpoint's sentence-transformers files say (gpu_worker.pooler_config).
    pooler_config: tuple[tuple[str, Any], ...] = ()
    # vLLM's --hf-overrides, as JSON text (hashable): keys set over the checkpoint's config.json,
    # e.g. {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"]}
    # to serve Qwen3-Reranker as a cross-encoder.
    hf_overrides: str = ""
    # vLLM's --mm-processor-kwargs, as JSON text: settings over the image processor's config
    # (Qwen2-VL's min_pixels / max_pixels: each image's token count follows them).
    mm_processor_kwargs: str = ""
    # A vision-language model's language model alone (vLLM's text-only mode: --limit-mm-per-prompt
    # '{"image": 0}'): its vision tower and projector are neither loaded nor profiled; images refused.
    # A model that takes videos (Qwen2-VL) keeps its tower for them unless ``videos_refused`` too
    # ('{"image": 0, "video": 0}'), as vLLM's text-only mode needs every modality's limit at 0.
    language_model_only: bool = False
    videos_refused: bool = False
    # vLLM's --generation-config ("auto": the model's generation_config.json; "vllm": none; or a folder
    # holding one) and --override-generation-config (JSON text): the sampling parameters a request gets
    # for those it leaves unset (engine_core/generation_defaults.py).
    generation_config: str = "auto"
    override_generation_config: str = ""
    # vLLM's --tokenizer: a Hugging Face tokenizer directory used instead of the model's own (a GGUF's
    # model with its original tokenizer and chat template, say); None: the model's.
    tokenizer: str | None = None
    # vLLM's --max-logprobs: the most logprobs (and prompt logprobs) a request may ask for per token;
    # -1: the whole vocabulary.
    max_logprobs: int = 20
    # vLLM's --logprobs-mode (LOGPROBS_MODES): raw_logprobs (the default), raw_logits,
    # processed_logprobs or processed_logits.
    logprobs_mode: LogprobsMode = "raw_logprobs"
    scheduler: SchedulerConfig = SchedulerConfig()
    block_size: int = 16
    enable_prefix_caching: bool = True
    # KV pool size: an explicit block count, or a memory budget (CPU bytes / CUDA utilisation).
    num_gpu_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    # Placement of the worker group: PACK or STRICT_PACK; optional pinning to a node.
    placement_strategy: str = "PACK"
    num_cpus_per_worker: float = 1.0
    resources_per_worker: tuple[tuple[str, float], ...] = ()
    node_labels: tuple[tuple[str, str], ...] = ()
    seed: int = 0
    log_stats: bool = True
    # The periodic stats line in the engine's log (with log_stats; engine_core/stats_logger.py): off in
    # the offline LLM unless asked, as in vLLM's.
    log_stats_line: bool = True
    # Largest number of queued (waiting) requests before add_request is refused (0: unlimited).
    max_waiting_requests: int = 0
    # "uni": the model runs inside the engine process (TP=1 only); "ray": a Ray worker actor per
    # rank; "auto": uni for TP=1, ray otherwise.
    executor_backend: str = "auto"
    # Added to the niceness of the engine's compute threads (and its TP workers'), so the router,
    # the ingress and the engine's I/O run first on a contended node (engine_core.cpu_priority).
    # None: 4 for engines that compute on the CPU, 0 for GPU engines (whose kernel launches must not wait).
    engine_niceness: int | None = None
    # Speculative decoding; None: one token per request per pass.
    speculative_config: SpeculativeConfig | None = None
    # LoRA adapters; None: the base model only (requests naming an adapter are refused).
    lora_config: LoRAConfig | None = None
    # vLLM's --kv-cache-metrics (--kv-cache-metrics-sample): the share of KV blocks followed for the
    # residency histograms (vllm:kv_block_*); None: off.
    kv_cache_metrics_sample: float | None = None
    # vLLM's --disable-hybrid-kv-cache-manager: a model mixing full-attention and windowed layers keeps
    # every block of a request in all of them, as a full-attention model does (by default its windowed
    # layers' blocks behind the window are released: gpu_worker/kv_cache_groups.py).
    disable_hybrid_kv_cache_manager: bool = False
    # vLLM's --enable-sleep-mode: the engine may release its KV cache and weights (sleep) and
    # restore them (wake_up), e.g. while an RL trainer uses the memory.
    enable_sleep_mode: bool = False
    # vLLM's --kv-offloading-size (GiB, all TP ranks together) with its native CPU backend: evicted
    # prefix-cache blocks are kept in host memory and copied back on a prefix hit
    # (engine_core/core/kv_offload.py); None: off. Needs the prefix cache.
    kv_offloading_size: float | None = None
    # vLLM's --kv-transfer-config: prefill/decode disaggregation (engine_core.kv_transfer): this engine
    # computes prompts for others (kv_producer), decodes prompts others computed (kv_consumer), or
    # both; None: off.
    kv_transfer_config: KVTransferConfig | None = None
    # vLLM's --logits-processors: custom logits processor classes, or their qualified names
    # ("package.module:Class"), run at every step (engine_core.logits_processor); those that
    # installed packages offer under the llm_cluster.logits_processors entry points run too.
    logits_processors: tuple[Any, ...] = ()
    # vLLM's --enable-prompt-embeds: requests may give their prompt as embeddings
    # (engine_core.prompt_embeds) instead of token ids.
    enable_prompt_embeds: bool = False

    def __post_init__(self) -> None:
        where = f"engine {self.engine_index}: "
        try:
            _require(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
                     "tensor_parallel_size", ">= 1", self.tensor_parallel_size)
            _require(type(self.pipeline_parallel_size) is int and self.pipeline_parallel_size >= 1,
                     "pipeline_parallel_size", ">= 1", self.pipeline_parallel_size)
            if self.pp_layer_partition is not None:
                partition = tuple(self.pp_layer_partition)
                object.__setattr__(self, "pp_layer_partition", partition)
                _require(len(partition) == self.pipeline_parallel_size and all(
                    type(n) is int and n >= 1 for n in partition), "pp_layer_partition",
                    f"{self.pipeline_parallel_size} layer counts >= 1 (one per pipeline stage)", partition)
            _require(self.device in ("auto", "cpu", "cuda"), "device", "one of auto, cpu, cuda", self.device)
            _require(not isinstance(self.dtype, str) or self.dtype.removeprefix("torch.") in MODEL_DTYPE_NAMES,
                     "dtype", f"one of {', '.join(MODEL_DTYPE_NAMES)}", self.dtype)
            _require(self.kv_cache_dtype in KV_CACHE_DTYPE_NAMES, "kv_cache_dtype",
                     f"one of {', '.join(KV_CACHE_DTYPE_NAMES)}", self.kv_cache_dtype)
            for name in ("mamba_cache_dtype", "mamba_ssm_cache_dtype"):
                _require(getattr(self, name) in MAMBA_CACHE_DTYPE_NAMES, name,
                         f"one of {', '.join(MAMBA_CACHE_DTYPE_NAMES)}", getattr(self, name))
            _require(self.mamba_cache_mode in MAMBA_CACHE_MODE_NAMES, "mamba_cache_mode",
                     f"one of {', '.join(MAMBA_CACHE_MODE_NAMES)}", self.mamba_cache_mode)
            _require(self.mamba_prefix_cache_slots is None or (type(self.mamba_prefix_cache_slots) is int
                                                               and self.mamba_prefix_cache_slots >= 1),
                     "mamba_prefix_cache_slots", "None or >= 1", self.mamba_prefix_cache_slots)
            _require(isinstance(self.block_size, int) and self.block_size >= 1, "block_size", ">= 1",
                     self.block_size)
            _require(self.num_gpu_blocks is None or self.num_gpu_blocks >= 1, "num_gpu_blocks",
                     "None or >= 1", self.num_gpu_blocks)
            _require(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
                     "kv_cache_memory_bytes", "None or > 0", self.kv_cache_memory_bytes)
            _require(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "in (0, 1]",
                     self.gpu_memory_utilization)
            _require(self.placement_strategy in ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"),
                     "placement_strategy", "one of PACK, STRICT_PACK, SPREAD, STRICT_SPREAD",
                     self.placement_strategy)
            _require(self.num_cpus_per_worker > 0, "num_cpus_per_worker", "> 0", self.num_cpus_per_worker)
            _require(self.executor_backend in ("auto", "uni", "ray"), "executor_backend", "one of auto, uni, ray",
                     self.executor_backend)
            _require(not (self.executor_backend == "uni" and self.world_size > 1), "executor_backend",
                     "'ray' or 'auto' when tensor_parallel_size or pipeline_parallel_size > 1", self.executor_backend)
            if self.pipeline_parallel_size > 1:
                _require(self.speculative_config is None, "speculative_config",
                         "unset with pipeline_parallel_size > 1 (speculative decoding under pipeline parallelism "
                         "is not built)", self.speculative_config)
            _require(self.engine_niceness is None
                     or (isinstance(self.engine_niceness, int) and 0 <= self.engine_niceness <= 19),
                     "engine_niceness", "None or an integer in [0, 19]", self.engine_niceness)
            _require(self.max_waiting_requests >= 0, "max_waiting_requests", ">= 0", self.max_waiting_requests)
            _require(self.runner in ("auto", "generate", "pooling"), "runner", "one of auto, generate, pooling",
                     self.runner)
            _require(not self.hf_overrides or isinstance(json.loads(self.hf_overrides), dict), "hf_overrides",
                     "a JSON object", self.hf_overrides)
            _require(not self.mm_processor_kwargs or isinstance(json.loads(self.mm_processor_kwargs), dict),
                     "mm_processor_kwargs", "a JSON object", self.mm_processor_kwargs)
            _require(self.tokenizer is None or (isinstance(self.tokenizer, str) and self.tokenizer.strip() != ""),
                     "tokenizer", "None or a tokenizer directory", self.tokenizer)
            _require(all(isinstance(p, str | type) for p in self.logits_processors), "logits_processors",
                     "classes or qualified class names", self.logits_processors)
            _require(self.kv_offloading_size is None
                     or (isinstance(self.kv_offloading_size, int | float) and self.kv_offloading_size > 0),
                     "kv_offloading_size", "None or > 0 (GiB)", self.kv_offloading_size)
            _require(self.kv_offloading_size is None or self.enable_prefix_caching, "kv_offloading_size",
                     "unset without the prefix cache (the host tier keeps prefix-cache blocks)",
                     self.kv_offloading_size)
            spec = self.speculative_config
            if spec is not None and spec.proposes_in_workers:
                _require(spec.draft_tensor_parallel_size in (None, self.tensor_parallel_size),
                         "speculative_config.draft_tensor_parallel_size",
                         f"unset or the target's tensor_parallel_size ({self.tensor_parallel_size}): the drafter "
                         "shards over the same workers", spec.draft_tensor_parallel_size)
                _require(not self.enable_prompt_embeds, "enable_prompt_embeds",
                         f"off with speculative method {spec.method} (its drafter reads token ids, not the "
                         "prompt's embeddings)", self.enable_prompt_embeds)
            _require(not (self.logits_processors and self.speculative_config is not None), "logits_processors",
                     "unset with speculative decoding (custom logits processors see one row per request)",
                     self.logits_processors)
            _require(type(self.max_logprobs) is int and self.max_logprobs >= -1, "max_logprobs",
                     "an integer >= -1 (-1: the whole vocabulary)", self.max_logprobs)
            _require(self.logprobs_mode in LOGPROBS_MODES, "logprobs_mode", "one of " + ", ".join(LOGPROBS_MODES),
                     self.logprobs_mode)
            _require(isinstance(self.generation_config, str) and self.generation_config != "", "generation_config",
                     "'auto', 'vllm' or a folder", self.generation_config)
            _require(not self.override_generation_config
                     or isinstance(json.loads(self.override_generation_config), dict), "override_generation_config",
                     "a JSON object", self.override_generation_config)
            if self.override_generation_config:  # (its values, as the engine will read them: a bad one
                # fails here, wherever the config is made, and not in each engine as it loads)
                from engine_core.generation_defaults import model_sampling_defaults

                model_sampling_defaults("", "vllm", json.loads(self.override_generation_config))
            pooler = dict(self.pooler_config)
            step_tag, returned = pooler.get("step_tag_id"), pooler.get("returned_token_ids")
            _require(set(pooler) <= {"pooling_type", "normalize", "step_tag_id", "returned_token_ids"}
                     and str(pooler.get("pooling_type", "LAST")).upper() in ("LAST", "MEAN", "CLS", "ALL", "STEP")
                     and isinstance(pooler.get("normalize", True), bool)
                     and (step_tag is None or (type(step_tag) is int and step_tag >= 0))
                     and (returned is None or (isinstance(returned, list | tuple) and len(returned) > 0
                                               and all(type(t) is int and t >= 0 for t in returned))),
                     "pooler_config", "an object of pooling_type (LAST, MEAN, CLS, ALL or STEP), normalize (true or "
                     "false), and for STEP step_tag_id (a token id) and returned_token_ids (token ids)", pooler)
        except ValueError as e:
            raise ValueError(where + str(e)) from None

    def cache_config(self, num_blocks: int, sliding_window: int | None = None,
                     long_rope_after: int | None = None, num_offload_blocks: int = 0,
                     recurrent: bool = False, kv_cache_groups: tuple[AttentionWindow | None, ...] = ()) -> CacheConfig:
        """The scheduler's cache settings; ``recurrent``: the model has recurrent layers;
        ``kv_cache_groups``: the hybrid KV cache manager's groups (CacheConfig.kv_cache_groups)."""
        return CacheConfig(block_size=self.block_size, num_blocks=num_blocks,
                           enable_prefix_caching=self.enable_prefix_caching, sliding_window=sliding_window,
                           long_rope_after=long_rope_after, kv_cache_metrics_sample=self.kv_cache_metrics_sample,
                           num_offload_blocks=num_offload_blocks,
                           num_recurrent_state_slots=self.recurrent_state_slots if recurrent else 0,
                           kv_cache_groups=kv_cache_groups)

    @property
    def recurrent_state_slots(self) -> int:
        """The recurrent states the prefix cache keeps, for a model with recurrent layers (0: none,
        unless --mamba-cache-mode align with prefix caching on)."""
        if self.mamba_cache_mode != "align" or not self.enable_prefix_caching:
            return 0
        return self.mamba_prefix_cache_slots or self.scheduler.max_num_seqs

    def kv_offloading_bytes_per_rank(self) -> int:
        """Each worker's share of the KV offloading tier (vLLM's --kv-offloading-size is the tier of
        all tensor-parallel ranks together, in GiB; a pipeline stage's ranks hold its layers' share); 0: off."""
        if not self.kv_offloading_size:
            return 0
        return int(self.kv_offloading_size * 2**30 / self.world_size)

    @property
    def world_size(self) -> int:
        """The engine's workers: one per tensor-parallel rank of each pipeline stage."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def engine_name(self) -> str:
        return f"engine-{self.engine_index}"
