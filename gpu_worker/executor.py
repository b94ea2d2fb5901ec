"""Executors: how an engine runs its workers.

``UniProcExecutor`` runs the single TP=1 worker inside the engine's own process (no extra hop per
step). ``RayWorkerGroupExecutor`` runs one ``Worker`` Ray actor per TP rank in the engine's
placement group (bundle i holds rank i), sends every rank the same ``SchedulerOutput`` and returns
rank 0's ``ModelRunnerOutput``; a rank that dies surfaces as an exception within the step.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import json
import logging
import os
import socket
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine_core.config import EngineConfig, SchedulerConfig
from engine_core.core.kv_cache_utils import blocks_held_bound
from engine_core.cpu_priority import engine_niceness, lower_cpu_priority
from engine_core.executor import Executor, ModelInfo, PoolingInfo, engine_uses_gpu
from engine_core.generation_defaults import model_sampling_defaults
from engine_core.logits_processor import load_logits_processors
from engine_core.outputs import LoRARequest, ModelRunnerOutput
from engine_core.sched.output import SchedulerOutput
from engine_core.tokenizer_files import read_image_processor_config
from gpu_worker.bitnet_checkpoint import check_bitnet_model
from gpu_worker.config import ModelConfig, check_dtype_supported, parse_dtype
from gpu_worker.eagle_config import EAGLE_METHODS, eagle_head_config
from gpu_worker.kv_cache_groups import KVCacheGrouping, groups_cost_more, hybrid_kv_cache_grouping, pipeline_stages
from gpu_worker.model_resolver import (
    DtypeRule,
    check_model_reference,
    resolve_model,
    resolve_tokenizer,
    worker_reference,
)
from gpu_worker.models.llama import pipeline_refusal
from gpu_worker.models.mtp import mtp_config
from gpu_worker.pooler_config import (
    DenseProjection,
    PoolerConfig,
    resolve_pooler_config,
    sentence_transformers_max_seq_length,
    sentence_transformers_text_settings,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def _in_ray_actor() -> bool:
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:
        return False


# Families whose adapters would name modules the engine does not wrap (refused at start, not at an
# adapter's load).
LORA_UNSERVED = {
    "JetMoeForCausalLM": "its attention experts' projections are stacked parameters, not layers LoRA wraps",
    "LongcatFlashForCausalLM": "its layers are served as half-layers under other names",
    "ModernBertDecoderForCausalLM": "its fused Wi / Wo projections are not adapter targets here",
    # (Hybrids whose linear-attention layers name their projections as attention's, q_proj ... o_proj: an
    # adapter on those names trains both kinds, and the linear layers' are fused or renamed here.)
    "KimiLinearForCausalLM": "its delta-attention layers' q/k/v/o projections are not adapter targets here",
    "BailingHybridForCausalLM": "its linear-attention layers' q/k/v/o projections are not adapter targets here",
    "OlmoHybridForCausalLM": "its Gated DeltaNet layers' q/k/v/o projections are not adapter targets here",
    "Zamba2ForCausalLM": "its shared transformer blocks (and their per-use LoRA) are not adapter targets here",
}


def _worker_kwargs(config: EngineConfig, model: str | Path, max_model_len: int, num_cpus: int | None,
                   pooler_dense: tuple[DenseProjection, ...] = (), hybrid_kv_cache: bool = False) -> dict[str, Any]:
    """A worker's arguments; ``model``: what it loads, which it resolves on its own node (a GGUF is
    converted there: the engine's cache directory is on the engine's node only); ``hybrid_kv_cache``: its
    attention layers keep their caches in KV cache groups (gpu_worker/kv_cache_groups.py)."""
    return {
        "pooler_dense": pooler_dense,
        "hybrid_kv_cache": hybrid_kv_cache,
        "model_path_or_config": str(model), "device": config.device, "dtype": config.dtype,
        "max_model_len": max_model_len, "max_num_seqs": config.scheduler.max_num_seqs,
        "max_num_batched_tokens": config.scheduler.token_budget, "num_cpus": num_cpus, "seed": config.seed,
        "num_spec_tokens": config.speculative_config.num_speculative_tokens if config.speculative_config else 0,
        "max_lora_rank": config.lora_config.max_lora_rank if config.lora_config is not None else None,
        "max_loras": config.lora_config.max_loras if config.lora_config is not None else None,
        "max_cpu_loras": config.lora_config.max_cpu_loras if config.lora_config is not None else None,
        "kv_cache_dtype": config.kv_cache_dtype,
        "mamba_cache_dtype": config.mamba_cache_dtype,
        "mamba_ssm_cache_dtype": config.mamba_ssm_cache_dtype,
        "num_recurrent_state_slots": config.recurrent_state_slots,
        "enable_expert_parallel": config.enable_expert_parallel,
        "embedding_only": config.runner == "pooling",
        "hf_overrides": json.loads(config.hf_overrides) if config.hf_overrides else None,
        "mm_processor_kwargs": json.loads(config.mm_processor_kwargs) if config.mm_processor_kwargs else None,
        "language_model_only": config.language_model_only,
        "videos_refused": config.videos_refused,
        "max_logprobs": config.max_logprobs,
        "logprobs_mode": config.logprobs_mode,
        "tokenizer": config.tokenizer,
        # (Resolved once, here: every rank runs the same classes, whatever each node has installed.)
        "logits_processors": load_logits_processors(config.logits_processors)
        if config.speculative_config is None else (),
        "draft_model": draft_model_reference(config),
        "draft_method": config.speculative_config.method if draft_model_reference(config) else "draft_model",
        "mtp_drafter": config.speculative_config is not None and config.speculative_config.method == "mtp",
        "kv_offloading_bytes": config.kv_offloading_bytes_per_rank(),
        "pp_layer_partition": config.pp_layer_partition if config.pipeline_parallel_size > 1 else None,
    }


def read_model_config(model: str) -> ModelConfig:
    """``model``'s configuration (a directory's config.json, a GGUF's metadata), nothing converted."""
    from gpu_worker.gguf_loader import gguf_hf_config
    from gpu_worker.model_resolver import locate_model

    path, is_gguf = locate_model(model)
    return ModelConfig.from_dict(gguf_hf_config(path)) if is_gguf else ModelConfig.from_pretrained(path)


def draft_model_reference(config: EngineConfig) -> str | None:
    """Speculative decoding's draft model or EAGLE head (methods draft_model, eagle, eagle3) as the
    engine was given it, or None; each worker resolves it on its own node (a GGUF converted there)."""
    spec = config.speculative_config
    if spec is None or not spec.uses_draft_model:
        return None
    return worker_reference(spec.model)


ALLOW_LONG_MAX_MODEL_LEN_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"


def _mamba_refusal(config: EngineConfig, model_config: ModelConfig) -> str | None:
    """What an engine cannot do for a model with recurrent layers (Mamba, Mamba-2, Gated DeltaNet, Kimi
    Delta Attention, lightning attention, short convolutions; None: nothing it asks for). Each
    request's state there covers exactly the tokens computed so far: another engine's KV or the host
    tier's would come without it. (Speculative decoding keeps the state before each draft it verifies:
    gpu_worker.model_runner.)"""
    try:
        model_config.mamba.per_rank(config.tensor_parallel_size)
    except ValueError as e:
        return str(e)
    if config.kv_transfer_config is not None:
        return ("prefill/decode disaggregation hands on KV blocks, not their per-request state: drop "
                "--kv-transfer-config")
    if config.kv_offloading_size is not None:
        return ("KV offloading brings prefix-cache blocks back without the recurrent states at their ends: drop "
                "--kv-offloading-size")
    return None


def _check_long_max_model_len(engine_index: int, wanted: int, context: int) -> None:
    """A --max-model-len past the model's context length is refused, as vLLM refuses it, unless
    vLLM's switch allows it; here it then runs at the model's length (positions past the model's are
    never computed), with a warning."""
    if os.environ.get(ALLOW_LONG_MAX_MODEL_LEN_ENV, "").lower() not in ("1", "true"):
        raise ValueError(f"engine {engine_index}: max_model_len ({wanted}) is greater than the model's context "
                         f"length ({context}, from its config). Set {ALLOW_LONG_MAX_MODEL_LEN_ENV}=1 in the engines' "
                         f"environment to start at the model's {context} instead")
    logger.warning("engine %d: max_model_len %d is greater than the model's context length %d: serving %d "
                   "(%s is set)", engine_index, wanted, context, context, ALLOW_LONG_MAX_MODEL_LEN_ENV)


class _ExecutorBase(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        resolved = resolve_model(config.model, has_tokenizer=config.tokenizer is not None,
                                 dtype=self._gguf_dtype_rule(config))
        self.model_dir = Path(resolved.model_dir)
        # What the workers load, by the engine's reference, not this node's conversion of a GGUF:
        # each worker converts it on its own node (a rank elsewhere has no copy of this node's cache).
        self.worker_model = worker_reference(config.model)
        self.model_config = ModelConfig.from_pretrained(
            self.model_dir, json.loads(config.hf_overrides) if config.hf_overrides else None, config.tokenizer,
            json.loads(config.mm_processor_kwargs) if config.mm_processor_kwargs else None,
            language_model_only=config.language_model_only, pipeline_stages=config.pipeline_parallel_size > 1,
            videos_refused=config.videos_refused)
        if config.pipeline_parallel_size > 1 and self.model_config.architecture == "Gemma3ForCausalLM" \
                and not config.language_model_only and read_image_processor_config(self.model_dir) is not None:
            logger.warning("engine %d: under pipeline parallelism Gemma 3 serves its language model alone: "
                           "requests with images are refused", config.engine_index)
        if str(config.dtype) != "auto":
            # (Refused here, before any worker starts: --dtype float16 for Gemma 2/3.)
            try:
                check_dtype_supported(parse_dtype(config.dtype), self.model_config)
            except ValueError as e:
                raise ValueError(f"engine {config.engine_index}: {e}") from None
        if config.runner == "generate" and self.model_config.embedding_only:
            kind = ("an encoder (bidirectional attention)" if self.model_config.encoder_only
                    else "an embedding model without an LM head")
            raise ValueError(f"runner 'generate': {self.model_dir} is {kind} "
                             f"({self.model_config.raw['architectures'][0]}: embeddings or classes only); serve it "
                             "with --runner pooling or auto")
        embeds_only = self.model_config.embedding_only or config.runner == "pooling"
        # A model mixing full-attention and windowed layers: its KV cache groups (None: one group).
        self.kv_cache_grouping, single_group_reason = hybrid_kv_cache_grouping(self.model_config, config)
        if single_group_reason:
            logger.info("engine %d: the hybrid KV cache manager is off (%s): the windowed layers keep every block of "
                        "a request, as the full-attention ones do", config.engine_index, single_group_reason)
        draft = draft_model_reference(config)
        spec = config.speculative_config
        if embeds_only and spec is not None and spec.proposes_in_workers:
            raise ValueError(f"engine {config.engine_index}: a pooling model generates nothing, so it takes no "
                             f"drafter (--speculative-config method {spec.method})")
        if draft is not None:
            # (What the workers would refuse, found before they start; an EAGLE head has no tokenizer.)
            check_model_reference(draft, needs_tokenizer=spec is not None and spec.method == "draft_model")
        if spec is not None and spec.method == "mtp":
            try:
                mtp_config(self.model_config)
            except ValueError as e:
                raise ValueError(f"engine {config.engine_index}: {e}") from None
        # The drafter's KV cache, beside the model's (its config, and its layers where not all it has).
        drafter_kv: tuple[ModelConfig, int | None] | None = None
        if spec is not None and spec.method == "mtp":
            drafter_kv = (mtp_config(self.model_config), 1)
        if draft is not None and spec is not None and spec.method in EAGLE_METHODS:
            try:  # (the head is read where the engine runs, as the workers will read it)
                drafter_kv = (eagle_head_config(draft, spec.method, self.model_config), None)
            except ValueError as e:
                raise ValueError(f"engine {config.engine_index}: {e}") from None
        if self.model_config.mamba_layers and (refusal := _mamba_refusal(config, self.model_config)):
            raise ValueError(f"engine {config.engine_index}: {self.model_config.raw['architectures'][0]} has "
                             f"{self.model_config.mamba.layer_name} layers: {refusal}")
        if self.model_config.quantization == "bitnet":
            try:
                check_bitnet_model(self.model_config.architecture, config.tensor_parallel_size,
                                   lora=config.lora_config is not None)
            except ValueError as e:
                raise ValueError(f"engine {config.engine_index}: {e}") from None
        if config.lora_config is not None and self.model_config.architecture in LORA_UNSERVED:
            raise ValueError(f"engine {config.engine_index}: LoRA adapters are not served for "
                             f"{self.model_config.architecture} ({LORA_UNSERVED[self.model_config.architecture]}): "
                             "drop --enable-lora")
        if self.model_config.architecture == "BitNetForCausalLM" and config.tensor_parallel_size > 1:
            raise ValueError(f"engine {config.engine_index}: BitNetForCausalLM is served on one tensor-parallel "
                             "rank (its norms inside each sublayer span whole rows)")
        pp = config.pipeline_parallel_size
        if pp > 1 and (refusal := pipeline_refusal(self.model_config, pp, embeds_only)):
            raise ValueError(f"engine {config.engine_index}: pipeline_parallel_size {pp}: {refusal}")
        if pp > 1 and config.pp_layer_partition is not None \
                and sum(config.pp_layer_partition) != self.model_config.num_hidden_layers:
            raise ValueError(f"engine {config.engine_index}: the layer partition {list(config.pp_layer_partition)} "
                             f"(VLLM_PP_LAYER_PARTITION) has {sum(config.pp_layer_partition)} layers; the model has "
                             f"{self.model_config.num_hidden_layers}")
        if embeds_only and config.logits_processors:
            raise ValueError(f"engine {config.engine_index}: a pooling model samples nothing, so it takes no custom "
                             "logits processors (--logits-processors)")
        pooling_unavailable = ""
        try:
            # (An encoder pools its [CLS] token unless its files say otherwise, as vLLM's BERT models do.)
            pooler = resolve_pooler_config(self.model_dir, dict(config.pooler_config),
                                           default_type=self.model_config.default_pooling_type,
                                           hidden_size=self.model_config.hidden_size,
                                           default_step_tag_id=self.model_config.step_tag_id,
                                           read_files_pooling=not (self.model_config.token_classifier
                                                                   or self.model_config.late_interaction))
        except ValueError as e:
            if embeds_only:
                raise
            # Served to generate: its sentence-transformers pooling need not stop that; embedding
            # requests are refused with the reason.
            logger.warning("engine %d: %s; it generates, and refuses embeddings", config.engine_index, e)
            pooler, pooling_unavailable = PoolerConfig(), str(e)
        if self.model_config.encoder_only and self.model_config.labels and not self.model_config.token_classifier:
            pooler = self._encoder_classifier_pooler(pooler, dict(config.pooler_config))
        if self.model_config.late_interaction:
            if pooler.pooling_type != "ALL":  # (ColBERT serves every token's vector, nothing else, as in vLLM)
                raise ValueError(f"pooler_config pooling_type {pooler.pooling_type!r}: a ColBERT model pools every "
                                 "token (ALL); drop pooling_type")
            if "normalize" not in dict(config.pooler_config):
                # (Its vectors are normalised, whatever its sentence-transformers files list: PyLate
                # normalises in the model, and vLLM's token_embed does.)
                pooler = dataclasses.replace(pooler, normalize=True)
        # The sentence-transformers projections of an embedding model's pooled states (a classifier's
        # head reads them unprojected); the workers load their weights.
        self.pooler_dense = () if self.model_config.labels else pooler.dense
        # One pooled row's values: a class logit each, or the embedding's (STEP: the columns kept;
        # ColBERT: its vectors').
        row_size = (len(self.model_config.labels) or self.model_config.colbert_dim
                    or pooler.embedding_size(self.model_config.hidden_size))
        if pooler.returned_token_ids is not None:
            if max(pooler.returned_token_ids) >= row_size:
                raise ValueError(f"pooler_config returned_token_ids {list(pooler.returned_token_ids)}: each row "
                                 f"pooled from this model has {row_size} values (columns 0..{row_size - 1})")
            row_size = len(pooler.returned_token_ids)
        prompts, do_lower_case = sentence_transformers_text_settings(self.model_dir)
        wanted = config.scheduler.max_model_len  # None: the model's context length
        if wanted is None and embeds_only:
            # (A sentence-transformers checkpoint's max_seq_length bounds it by default, as in vLLM.)
            wanted = sentence_transformers_max_seq_length(self.model_dir)
        context = self.model_config.max_context_len
        if config.scheduler.max_model_len is not None and config.scheduler.max_model_len > context:
            _check_long_max_model_len(config.engine_index, config.scheduler.max_model_len, context)
        self.max_model_len = min(wanted or context, context)
        if self.kv_cache_grouping is not None and spec is not None and spec.method == "draft_model":
            drafter_kv = (read_model_config(spec.model), None)
        if self.kv_cache_grouping is not None:
            # (A decoding pass: the request's token, the drafts it verifies, a drafter's lookahead slots.)
            pass_tokens = 1 if spec is None else 1 + (spec.num_speculative_tokens or 0) + spec.num_lookahead_slots
            stages = pipeline_stages(self.model_config.num_hidden_layers, config.pipeline_parallel_size,
                                     config.pp_layer_partition)
            costlier = groups_cost_more(self.kv_cache_grouping, self.model_config, self.max_model_len,
                                        config.block_size, pass_tokens, config.tensor_parallel_size,
                                        max((end - start for start, end in stages), default=None), drafter_kv)
            if costlier:
                logger.info("engine %d: the hybrid KV cache manager is off (%s): the windowed layers keep every "
                            "block of a request, as the full-attention ones do", config.engine_index, costlier)
                self.kv_cache_grouping = None
        # The workers size a pass as the engine's scheduler will (EngineCore): a budget derived from the
        # context length is derived from this one; an encoder's prompts run whole.
        scheduler = config.scheduler.with_max_model_len(self.max_model_len)
        if self.model_config.encoder_only:
            try:
                scheduler = scheduler.for_whole_prompts()
            except ValueError as e:
                raise ValueError(f"engine {config.engine_index}: {e}") from None
        self.config = config = dataclasses.replace(config, scheduler=scheduler)
        tokenizer_dir, eos_token_ids = "", tuple(self.model_config.eos_token_ids)
        if config.tokenizer is not None:
            try:
                path, tokenizer = resolve_tokenizer(config.tokenizer, self.model_config.vocab_size)
            except ValueError as e:
                raise ValueError(f"engine {config.engine_index}: {e}") from None
            tokenizer_dir = str(path)
            # (Its end of sequence ends a request too, as vLLM's tokenizer EOS does, whatever the
            # model's files list.)
            if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_token_ids:
                eos_token_ids += (int(tokenizer.eos_token_id),)
        sampling_defaults: dict[str, float | int] = {}
        if not embeds_only:  # (an embedding model samples nothing: its generation config is not read)
            try:
                sampling_defaults = model_sampling_defaults(
                    self.model_dir, config.generation_config,
                    json.loads(config.override_generation_config) if config.override_generation_config else None)
            except ValueError as e:
                raise ValueError(f"engine {config.engine_index}: {e}") from None
        if sampling_defaults:
            logger.info("engine %d: requests that leave them unset get the model's sampling parameters %s (from "
                        "its generation config; --generation-config vllm turns this off)", config.engine_index,
                        sampling_defaults)
        self._info = ModelInfo(
            served_model_name=config.served_model_name or resolved.served_name, model_dir=str(self.model_dir),
            default_sampling_params=sampling_defaults, tokenizer_dir=tokenizer_dir,
            max_logprobs=config.max_logprobs if config.max_logprobs >= 0 else self.model_config.vocab_size,
            max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size, eos_token_ids=eos_token_ids,
            # (The size of its embeddings: a Dense projection's, or ColBERT's vectors'.)
            hidden_size=self.model_config.colbert_dim or (pooler.embedding_size(self.model_config.hidden_size)
                                                          if not self.model_config.labels
                                                          else self.model_config.hidden_size),
            input_embedding_size=self.model_config.hidden_size,
            image_token_id=self.model_config.vision.image_token_id if self.model_config.vision else None,
            image_geometry=self.model_config.vision.geometry if self.model_config.vision else None,
            video_token_id=getattr(self.model_config.vision, "video_token_id", None),
            max_positions=self.model_config.max_context_len,
            sliding_window=self.model_config.uniform_sliding_window,
            long_rope_after=self.model_config.long_rope_after, encoder_only=self.model_config.encoder_only,
            mamba=bool(self.model_config.mamba_layers),
            inputs_need_token_ids=self.model_config.gemma3n is not None or bool(
                self.model_config.gemma4 is not None and self.model_config.gemma4.hidden_size_per_layer_input),
            kv_cache_shapes_differ=len(set(self.model_config.attention_layer_geometry)) > 1,
            kv_cache_groups=self.kv_cache_grouping.engine_windows if self.kv_cache_grouping is not None else (),
            pooling=PoolingInfo(generates=not embeds_only, pooling_type=pooler.pooling_type,
                                normalize=pooler.normalize, unavailable=pooling_unavailable,
                                labels=self.model_config.labels,
                                classifier_activation=self.model_config.classifier_activation,
                                cross_encoder_activation=self.model_config.cross_encoder_activation,
                                token_types=self.model_config.type_vocab_size > 1,
                                step_tag_id=pooler.step_tag_id, returned_token_ids=pooler.returned_token_ids,
                                row_size=row_size, token_heads=self._token_heads(),
                                # (ColBERT serves its token_embed vectors only, and scores by MaxSim.)
                                task="token_embed" if self.model_config.late_interaction else None,
                                late_interaction=self.model_config.late_interaction,
                                matryoshka=self.model_config.matryoshka,
                                matryoshka_dimensions=self.model_config.matryoshka_dimensions,
                                prompts=prompts, do_lower_case=do_lower_case,
                                joins_pair_text=not self.model_config.raw.get(
                                    "use_pad_token", not self.model_config.classifier_token_ids)))
        experts, tp = self.model_config.num_experts, config.tensor_parallel_size
        if config.enable_expert_parallel and (not experts or tp == 1):
            logger.info("engine %d: --enable-expert-parallel has no effect (%s)", config.engine_index,
                        "the model has no experts" if not experts else "tensor_parallel_size is 1")
        if config.enable_expert_parallel and experts % tp:
            # Refused here, before any worker starts, rather than by every rank's model build.
            raise ValueError(f"enable_expert_parallel: the model's {experts} experts cannot be split evenly over "
                             f"tensor_parallel_size={tp}; drop --enable-expert-parallel (experts split by width) "
                             "or pick a size that divides them")
        self._num_blocks: int | None = None
        # Adapters loaded on the workers, in load order: a restarted worker group gets them back.
        self._loras: dict[int, LoRARequest] = {}

    def _gguf_dtype_rule(self, config: EngineConfig) -> DtypeRule:
        """The dtype a GGUF is converted at here: the workers', so a worker on this node finds the
        engine's conversion instead of making a second one at another dtype."""
        from gpu_worker.worker import gguf_dtype_rule

        return gguf_dtype_rule(config.dtype, self._workers_device(config), config.runner == "pooling",
                               json.loads(config.hf_overrides) if config.hf_overrides else None)

    def _workers_device(self, config: EngineConfig) -> torch.device:
        """The device the workers run on (``auto`` resolved as they will): here, in this process."""
        from gpu_worker.worker import resolve_device

        return resolve_device(config.device, 0)

    def _token_heads(self) -> tuple[str, ...]:
        """The pooling tasks the model answers per token by heads of its own: its head modules', and
        a ColBERT's token_embed (a PyLate one's through its Dense projection)."""
        own = self.model_config.head_tasks
        return own or (("token_embed",) if self.model_config.late_interaction else ())

    def _encoder_classifier_pooler(self, pooler: PoolerConfig, asked: dict[str, Any]) -> PoolerConfig:
        """An encoder classifier's head reads what its architecture pools (BERT's and RoBERTa's
        [CLS], ModernBERT's classifier_pooling), as transformers and vLLM run it, whatever
        sentence-transformers files say; --pooler-config asking another pooling is refused."""
        pooling = self.model_config.default_pooling_type
        if str(asked.get("pooling_type", pooling)).upper() != pooling:
            raise ValueError(f"pooler_config pooling_type {asked['pooling_type']!r}: the classifier head of "
                             f"{self.model_config.raw['architectures'][0]} reads {pooling} pooling; drop pooling_type")
        return dataclasses.replace(pooler, pooling_type=pooling)

    def _check_lora_enabled(self) -> None:
        if self.config.lora_config is None:
            raise ValueError("LoRA is not enabled on this engine (--enable-lora)")

    def add_lora(self, lora: LoRARequest) -> bool:
        self._check_lora_enabled()
        added = any(self._load_lora(lora))
        self._loras[lora.lora_int_id] = lora
        return added

    def remove_lora(self, lora_int_id: int) -> bool:
        self._check_lora_enabled()
        removed = any(self._unload_lora(lora_int_id))
        self._loras.pop(lora_int_id, None)
        return removed

    def _load_lora(self, lora: LoRARequest) -> list[bool]:
        raise NotImplementedError

    def _unload_lora(self, lora_int_id: int) -> list[bool]:
        raise NotImplementedError

    def model_info(self) -> ModelInfo:
        return self._info

    def _note_workers(self, dtype: Any, device: str) -> None:
        """What the loaded workers run on: the model's dtype and the device type (``auto`` resolved)."""
        self._info = dataclasses.replace(self._info, dtype=str(dtype).removeprefix("torch."), device=device)

    def scheduler_config(self) -> SchedulerConfig:
        return self.config.scheduler

    def _block_args(self) -> dict[str, Any]:
        return {"block_size": self.config.block_size, "num_blocks": self.config.num_gpu_blocks,
                "kv_cache_memory_bytes": self.config.kv_cache_memory_bytes,
                "gpu_memory_utilization": self.config.gpu_memory_utilization}


class UniProcExecutor(_ExecutorBase):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        from gpu_worker.worker import Worker

        # Inside a Ray actor, torch gets as many threads as the actor holds CPUs (so engines sharing
        # a machine do not oversubscribe it); in a user's own process, torch's default.
        self._num_cpus = max(1, int(config.num_cpus_per_worker)) if _in_ray_actor() else None
        self._worker_cls = Worker
        self.worker = self._new_worker()
        self._note_workers(self.worker.dtype, self.worker.device.type)

    def _new_worker(self):
        worker = self._worker_cls(rank=0, world_size=1, **_worker_kwargs(self.config, self.worker_model,
                                                                         self.max_model_len, self._num_cpus,
                                                                         self.pooler_dense,
                                                                         self.kv_cache_grouping is not None))
        worker.load_model()
        for lora in self._loras.values():
            worker.add_lora(lora)
        return worker

    def _load_lora(self, lora: LoRARequest) -> list[bool]:
        return [self._live().add_lora(lora)]

    def _unload_lora(self, lora_int_id: int) -> list[bool]:
        return [self._live().remove_lora(lora_int_id)]

    def sleep(self, level: int) -> None:
        self._live().sleep(level)

    def wake_up(self, tags: list[str]) -> None:
        self._live().wake_up(tags)

    def read_kv_blocks(self, block_ids: list[int]) -> list[Any]:
        return [self._live().read_kv_blocks(block_ids)]

    def write_kv_blocks(self, block_ids: list[int], payload: list[Any]) -> None:
        _check_ranks(payload, 1)
        self._live().write_kv_blocks(block_ids, payload[0])

    def restart(self) -> None:
        """A failed step may have left the runner's state half-updated: start from a fresh worker,
        once the old one's weights and KV cache are freed (a GPU holds one worker's, not two)."""
        import torch

        if self.worker is not None:  # (None: an earlier restart failed; this one tries again)
            self.worker.shutdown()
        self.worker = None  # (None until the new one serves: a failed load leaves no half-made worker)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.worker = self._new_worker()

    def determine_num_blocks(self) -> int:
        args = self._block_args()
        if args["num_blocks"] is None and args["kv_cache_memory_bytes"] is None and self._live().device.type == "cpu":
            # CPU default: enough blocks for max_num_seqs full-length sequences, capped at 1 GiB, and
            # room for the recurrent states beside them (a model with recurrent layers).
            per_block = self._live().bytes_per_block(self.config.block_size)
            args["kv_cache_memory_bytes"] = (default_cpu_kv_bytes(self.config, self.max_model_len, per_block,
                                                                  self.kv_cache_grouping)
                                             + self._live().mamba_state_bytes())
        return self._live().determine_num_blocks(**args)

    def initialize_cache(self, num_blocks: int) -> int:
        return self._live().initialize_cache(num_blocks, self.config.block_size)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        out = self._live().execute_model(scheduler_output)
        assert out is not None
        return out

    def check_health(self) -> None:
        self._live()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()

    def _live(self):
        if self.worker is None:
            raise RuntimeError("the engine's worker is not running: its restart after a failed step failed")
        return self.worker


def default_cpu_kv_bytes(config: EngineConfig, max_model_len: int, bytes_per_block: int,
                         grouping: KVCacheGrouping | None = None) -> int:
    """max_num_seqs full-length sequences' blocks (under the hybrid KV cache manager, ``grouping``'s: a
    block in every group, a windowed group's as many as its window bounds, a pass's tokens and a
    drafter's lookahead slots), capped at 1 GiB."""
    windows = grouping.engine_windows if grouping is not None else (None,)
    spec = config.speculative_config
    lookahead = spec.num_lookahead_slots if spec is not None else 0
    blocks_wanted = config.scheduler.max_num_seqs * blocks_held_bound(
        max_model_len, windows, config.scheduler.token_budget + lookahead, config.block_size)
    return min(blocks_wanted * bytes_per_block, 1 << 30)


def _check_ranks(payload: list[Any], world_size: int) -> None:
    """KV read from another engine comes as one part per worker (each tensor-parallel rank of each
    pipeline stage)."""
    if len(payload) != world_size:
        raise ValueError(f"the producer's KV comes from {len(payload)} workers, this engine has {world_size}: the "
                         "same --tensor-parallel-size and --pipeline-parallel-size are needed on both")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class RayWorkerGroupExecutor(_ExecutorBase):
    """One Worker actor per rank (each tensor-parallel rank of each pipeline stage), placed in the
    placement group the engine runs in (bundle = rank). Every pass goes to all of them at once: the
    stages run one after the other, each handing its hidden states to the next, and the last
    stage's TP rank 0 answers."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.workers: list[Any] = []
        self._start_workers()

    def _workers_device(self, config: EngineConfig) -> torch.device:
        """(Ray places the workers on GPUs when the cluster has them, whatever this actor sees.)"""
        import torch

        return torch.device("cuda" if engine_uses_gpu(config) else "cpu")

    def _start_workers(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from gpu_worker.worker import RayWorker

        pg = ray.util.get_current_placement_group()
        tp, world = self.config.tensor_parallel_size, self.config.world_size
        num_cpus = self.config.num_cpus_per_worker
        use_gpu = engine_uses_gpu(self.config)
        actor_cls = ray.remote(RayWorker)
        workers = []
        for rank in range(world):
            options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": 1 if use_gpu else 0,
                                       "resources": dict(self.config.resources_per_worker)}
            if pg is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)
            workers.append(actor_cls.options(**options).remote(
                rank=rank, world_size=tp, pipeline_parallel_size=self.config.pipeline_parallel_size,
                **_worker_kwargs(self.config, self.worker_model, self.max_model_len, max(1, int(num_cpus)),
                                 self.pooler_dense, self.kv_cache_grouping is not None)))
        self.workers = workers
        # Sync actors run every call on their main thread: lowering it before load_model covers
        # the thread that computes and the torch threads it starts.
        niceness = engine_niceness(self.config.engine_niceness, use_gpu)
        ray.get([w.__ray_call__.remote(lambda _w: lower_cpu_priority(niceness)) for w in workers])
        if world > 1:
            master_addr = ray.get(workers[0].__ray_call__.remote(lambda _self: ray.util.get_node_ip_address()))
            master_port = ray.get(workers[0].__ray_call__.remote(lambda _self: _free_port()))
            ray.get([w.init_distributed.remote(master_addr, master_port) for w in workers])
        ray.get([w.load_model.remote() for w in workers])
        self._note_workers(*ray.get(workers[0].__ray_call__.remote(lambda w: (str(w.dtype), w.device.type))))
        for lora in self._loras.values():
            ray.get([w.add_lora.remote(lora) for w in workers])

    def _load_lora(self, lora: LoRARequest) -> list[bool]:
        return self._run_all("add_lora", lora)

    def _unload_lora(self, lora_int_id: int) -> list[bool]:
        return self._run_all("remove_lora", lora_int_id)

    def _run_all(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """Call ``method`` on every rank; the first rank to fail raises at once (no waiting on the rest)."""
        import ray

        refs = [getattr(w, method).remote(*args) for w in self.workers]
        results: dict[Any, Any] = {}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready:
                raise TimeoutError(f"workers did not finish {method} within {timeout} s")
            results[ready[0]] = ray.get(ready[0])
        return [results[r] for r in refs]

    def read_kv_blocks(self, block_ids: list[int]) -> list[Any]:
        return self._run_all("read_kv_blocks", block_ids)

    def write_kv_blocks(self, block_ids: list[int], payload: list[Any]) -> None:
        import ray

        _check_ranks(payload, len(self.workers))
        ray.get([worker.write_kv_blocks.remote(block_ids, part) for worker, part in zip(self.workers, payload)])

    def determine_num_blocks(self) -> int:
        import ray

        args = self._block_args()
        if args["num_blocks"] is None and args["kv_cache_memory_bytes"] is None:
            device = ray.get(self.workers[0].__ray_call__.remote(lambda w: w.device.type))
            if device == "cpu":
                # (The rank holding the most layers: pipeline stages may hold one more than others.)
                per_block = max(ray.get([w.bytes_per_block.remote(self.config.block_size) for w in self.workers]))
                states = max(ray.get([w.mamba_state_bytes.remote() for w in self.workers]))
                args["kv_cache_memory_bytes"] = (default_cpu_kv_bytes(self.config, self.max_model_len, per_block,
                                                                      self.kv_cache_grouping) + states)
        results = self._run_all("determine_num_blocks", *args.values())
        return min(results)

    def initialize_cache(self, num_blocks: int) -> int:
        return min(self._run_all("initialize_cache", num_blocks, self.config.block_size))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        import ray

        ref = ray.put(scheduler_output)
        out = self._run_all("execute_model", ref)[self._driver_rank]
        assert out is not None
        return out

    @property
    def _driver_rank(self) -> int:
        """The worker whose output is the pass's: TP rank 0 of the last pipeline stage."""
        return self.config.world_size - self.config.tensor_parallel_size

    @property
    def max_concurrent_batches(self) -> int:  # type: ignore[override]
        return self.config.pipeline_parallel_size

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> concurrent.futures.Future[ModelRunnerOutput]:
        """Send a pass to every worker without waiting: each runs its calls in order, so a stage
        starts the next pass as soon as it handed this one on. The future fails as soon as any rank
        fails (a stage waiting for a dead one would never answer)."""
        import ray

        ref = ray.put(scheduler_output)
        futures = [w.execute_model.remote(ref).future() for w in self.workers]
        result: concurrent.futures.Future[ModelRunnerOutput] = concurrent.futures.Future()
        remaining = [len(futures)]
        lock = threading.Lock()

        def done(future: concurrent.futures.Future[Any]) -> None:
            error = future.exception()
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
                if result.done():
                    return
                if error is not None:
                    result.set_exception(error)
                elif last:
                    output = futures[self._driver_rank].result()
                    assert output is not None
                    result.set_result(output)

        for future in futures:
            future.add_done_callback(done)
        return result

    def check_health(self) -> None:
        import ray

        ray.get([w.__ray_call__.remote(lambda _w: True) for w in self.workers], timeout=10)

    def sleep(self, level: int) -> None:
        self._run_all("sleep", level)

    def wake_up(self, tags: list[str]) -> None:
        # (Level 2: each rank reads the checkpoint again, as long as that takes from the storage it
        # is on, as sleep has no limit either; a rank that dies fails the call.)
        self._run_all("wake_up", tags)

    def restart(self) -> None:
        """Replace every rank (a survivor may be stuck in a collective with the dead one)."""
        self._kill_workers()
        self._start_workers()

    def _kill_workers(self) -> None:
        import ray

        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception as e:
                logger.debug("kill worker: %s", e)
        self.workers = []

    def shutdown(self) -> None:
        import ray

        try:
            ray.get([w.shutdown.remote() for w in self.workers], timeout=10)
        except Exception as e:
            logger.debug("worker shutdown: %s", e)
        self._kill_workers()


def create_executor(config: EngineConfig) -> Executor:
    """The executor factory handed to the engine (engine_core never imports gpu_worker)."""
    backend = config.executor_backend
    if backend == "auto":
        backend = "uni" if config.world_size == 1 else "ray"
    if backend == "uni":
        return UniProcExecutor(config)
    return RayWorkerGroupExecutor(config)
