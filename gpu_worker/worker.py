"""One tensor-parallel rank of one pipeline stage: owns a device, a model shard (its stage's
layers, split by width over the stage's ranks), their KV cache and a ModelRunner.

A plain class so the engine can run it in-process or as a Ray actor (``ray.remote(Worker)``).
Call order: ``init_distributed`` (TP > 1) -> ``load_model`` -> ``determine_num_blocks`` ->
``initialize_cache`` -> ``execute_model`` per step, with the same SchedulerOutput on every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from engine_core.log_setup import configure_actor_logging
from engine_core.logits_processor import LogitsProcessorContext, LogitsProcessorSpec, load_logits_processors
from engine_core.outputs import LoRARequest, ModelRunnerOutput
from engine_core.sched.output import SchedulerOutput
from gpu_worker import distributed
from gpu_worker.config import (
    FLOAT16_UNSUPPORTED_ARCHITECTURES,
    ModelConfig,
    check_dtype_supported,
    parse_dtype,
    with_overrides,
)
from gpu_worker.eagle_config import EAGLE_METHODS, eagle_head_config
from gpu_worker.kv_cache import model_bytes_per_block, num_blocks_for_budget, resolve_kv_cache_dtype
from gpu_worker.kv_cache_groups import group_attention_layers, pipeline_stages
from gpu_worker.layers.weight_utils import WeightLike
from gpu_worker.logits_processor_batch import LogitsProcessorBatch
from gpu_worker.lora.manager import LoRAManager
from gpu_worker.mamba_config import resolve_mamba_state_dtypes
from gpu_worker.model_resolver import DtypeRule, local_model_dir
from gpu_worker.model_runner import ModelRunner, WeightSource
from gpu_worker.models.llama import pipeline_refusal
from gpu_worker.models.mtp import mtp_config
from gpu_worker.pooler_config import DenseProjection

# A picklable source of (hf_name, tensor) pairs, e.g. functools.partial(gguf_to_hf_tensors, path).
WeightsFactory = Callable[[], Iterable[tuple[str, WeightLike]]]


def resolve_device(device: str | torch.device, rank: int) -> torch.device:
    """Resolve "auto" to CUDA when present, else CPU. A bare "cuda" becomes one GPU per rank (under
    Ray each actor sees only its own GPU, so that is cuda:0 there)."""
    if str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", rank % max(1, torch.cuda.device_count()))
    return device


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig, device: torch.device,
                  pooling: bool = False, bf16_supported: bool | None = None) -> torch.dtype:
    """``bf16_supported``: whether the GPU has bfloat16 (None: ask it, which opens a CUDA context)."""
    if str(dtype) != "auto":
        explicit = parse_dtype(dtype)
        check_dtype_supported(explicit, config)
        return explicit
    if device.type != "cuda":
        # CPU: fp32 keeps results exact and avoids slow fp16 kernels.
        return torch.float32
    # vLLM's rule: the checkpoint's dtype, with float32 brought down (half the weight memory, so
    # about twice the KV blocks) to the first the GPU and the model both take: float16 for an
    # embedding model, else bfloat16 where the GPU has it.
    bf16 = bf16_supported if bf16_supported is not None else (
        not torch.cuda.is_available() or torch.cuda.is_bf16_supported())
    candidates = (torch.bfloat16, torch.float16, torch.float32) if bf16 else (torch.float16, torch.float32)
    runnable = [d for d in candidates if d != torch.float16 or config.architecture not in
                FLOAT16_UNSUPPORTED_ARCHITECTURES]
    preferred = torch.float16 if pooling and torch.float16 in runnable else runnable[0]
    if config.dtype in (None, torch.float32) or config.dtype not in runnable:
        return preferred
    return config.dtype


def gguf_dtype_rule(dtype: str | torch.dtype, device: torch.device, embedding_only: bool = False,
                    hf_overrides: dict[str, Any] | None = None, bf16_supported: bool | None = None) -> DtypeRule:
    """The dtype a GGUF is converted at: the one a worker on ``device`` will serve its converted
    config in (resolve_dtype: --dtype when given; under auto, float32 on the CPU, on a GPU what
    vLLM's rule picks for a checkpoint that states no dtype), so the cache holds the weights as served."""
    def rule(hf_config: dict[str, Any]) -> torch.dtype:
        config = ModelConfig.from_dict(with_overrides(hf_config, hf_overrides or {}))
        return resolve_dtype(dtype, config, device, pooling=embedding_only or config.encoder_only,
                             bf16_supported=bf16_supported)

    return rule


# The blocks a rank that keeps no KV (a pipeline stage of recurrent layers alone) reports: no bound, so
# that the group-wide minimum is the other stages'.
NO_BLOCK_BOUND = 2**62


class Worker:
    def __init__(self, rank: int, world_size: int, model_path_or_config: str | Path | ModelConfig | dict[str, Any],
                 device: str | torch.device = "auto", dtype: str | torch.dtype = "auto",
                 max_model_len: int | None = None, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 weights: str | Path | WeightsFactory | None = None, num_cpus: int | None = None,
                 seed: int = 0, num_spec_tokens: int = 0, max_lora_rank: int | None = None,
                 max_loras: int | None = None, kv_cache_dtype: str | torch.dtype | None = "auto",
                 max_cpu_loras: int | None = None, enable_expert_parallel: bool = False,
                 embedding_only: bool = False, hf_overrides: dict[str, Any] | None = None,
                 pooler_dense: tuple[DenseProjection, ...] = (), max_logprobs: int = 20,
                 tokenizer: str | None = None, logits_processors: tuple[LogitsProcessorSpec, ...] = (),
                 draft_model: str | Path | None = None, kv_offloading_bytes: int = 0,
                 logprobs_mode: str = "raw_logprobs", pipeline_parallel_size: int = 1,
                 pp_layer_partition: tuple[int, ...] | None = None,
                 mm_processor_kwargs: dict[str, Any] | None = None, language_model_only: bool = False,
                 videos_refused: bool = False, mtp_drafter: bool = False,
                 draft_method: str = "draft_model", mamba_cache_dtype: str = "auto",
                 mamba_ssm_cache_dtype: str = "auto", num_recurrent_state_slots: int = 0,
                 hybrid_kv_cache: bool = False) -> None:
        # ``rank``: over every stage's ranks (stage rank // world_size); ``world_size``: the
        # tensor-parallel ranks of one stage.
        self.rank = rank
        self.world_size = world_size
        self.pipeline_parallel_size = pipeline_parallel_size
        # Each stage's decoder layers (None: an even split).
        self.pp_layer_partition = tuple(pp_layer_partition) if pp_layer_partition else None
        if not 0 <= rank < world_size * pipeline_parallel_size:
            raise ValueError(f"rank {rank} is not among the {world_size} x {pipeline_parallel_size} ranks")
        self.device = resolve_device(device, rank)
        if isinstance(model_path_or_config, ModelConfig):
            self.model_config = model_path_or_config
            self.model_dir = None
        elif isinstance(model_path_or_config, dict):
            self.model_config = ModelConfig.from_dict(model_path_or_config)
            self.model_dir = None
        else:
            # (A GGUF is converted on this worker's node if it has no conversion yet, at the dtype it serves.)
            self.model_dir = local_model_dir(model_path_or_config,
                                             dtype=gguf_dtype_rule(dtype, self.device, embedding_only, hf_overrides))
            self.model_config = ModelConfig.from_pretrained(self.model_dir, hf_overrides, tokenizer,
                                                            mm_processor_kwargs,
                                                            language_model_only=language_model_only,
                                                            videos_refused=videos_refused,
                                                            pipeline_stages=pipeline_parallel_size > 1)
        if enable_expert_parallel:
            # A MoE model's ranks hold whole experts, a share of them each (no effect on a dense model).
            self.model_config = dataclasses.replace(self.model_config, expert_parallel=True)
        if embedding_only:
            # --runner pooling: served for embeddings, without the LM head.
            self.model_config = dataclasses.replace(self.model_config, embedding_only=True)
        self.weights = weights if weights is not None else self.model_dir
        if self.weights is None:
            raise ValueError("a config without a model directory needs `weights` (a directory or a factory)")
        self.dtype = resolve_dtype(dtype, self.model_config, self.device,
                                   pooling=embedding_only or self.model_config.encoder_only)
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.dtype)
        # The recurrent layers' (conv, recurrent) state dtypes.
        self.mamba_state_dtypes = resolve_mamba_state_dtypes(mamba_cache_dtype, mamba_ssm_cache_dtype, self.dtype)
        # The recurrent states the prefix cache keeps beside the live ones (--mamba-cache-mode align).
        self.num_recurrent_state_slots = num_recurrent_state_slots if self.model_config.mamba is not None else 0
        self.max_model_len = max_model_len
        # The attention layers keep their caches in KV cache groups (gpu_worker/kv_cache_groups.py): a
        # block is a page of each of the groups' shared tensors.
        # (Under pipeline parallelism each group takes its share of layers from every stage, and this
        # rank's stage keeps that share's tensors for its own layers.)
        num_layers = self.model_config.num_hidden_layers
        stages = pipeline_stages(num_layers, pipeline_parallel_size, self.pp_layer_partition) if hybrid_kv_cache else []
        self.kv_cache_grouping = (group_attention_layers([self.model_config.layer_sliding_window(i)
                                                          for i in range(num_layers)], stages)
                                  if hybrid_kv_cache else None)
        if hybrid_kv_cache and self.kv_cache_grouping is None:
            raise ValueError("hybrid_kv_cache: the model does not mix full-attention and windowed layers")
        if self.kv_cache_grouping is not None and stages:
            self.kv_cache_grouping = self.kv_cache_grouping.for_stage(*stages[rank // world_size])
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_spec_tokens = num_spec_tokens
        # LoRA: the largest adapter rank served (None: LoRA off).
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        # The sentence-transformers projections of its embeddings (read from model_dir at load).
        self.pooler_dense = tuple(pooler_dense)
        self.max_logprobs = max_logprobs
        # --logprobs-mode: what the sampled tokens' logprobs are (raw_logprobs, raw_logits, processed_*).
        self.logprobs_mode = logprobs_mode
        # Custom logits processors (classes or qualified names), beside those of installed entry points.
        self.logits_processors = tuple(logits_processors)
        # Speculative decoding's draft model or EAGLE head (``draft_method`` draft_model, eagle or
        # eagle3): its directory and config; it proposes num_spec_tokens tokens a pass.
        self.draft_method = draft_method
        self.draft_model_dir = None if draft_model is None else local_model_dir(draft_model, dtype=self.dtype)
        if self.draft_model_dir is None:
            self.draft_config = None
        elif draft_method in EAGLE_METHODS:
            self.draft_config = eagle_head_config(self.draft_model_dir, draft_method, self.model_config)
        elif draft_method == "draft_model":
            self.draft_config = ModelConfig.from_pretrained(self.draft_model_dir, None, tokenizer)
        else:
            raise ValueError(f"draft_method must be draft_model, eagle or eagle3, got {draft_method!r}")
        if self.draft_config is not None:
            check_dtype_supported(self.dtype, self.draft_config)  # (the draft model runs in the target's dtype)
        if self.draft_config is not None and not num_spec_tokens:
            raise ValueError("a draft model needs num_spec_tokens >= 1")
        # Speculative decoding's method mtp: the config of the model's own multi-token-prediction layer.
        self.mtp_config = mtp_config(self.model_config) if mtp_drafter else None
        if mtp_drafter and (not num_spec_tokens or self.draft_config is not None):
            raise ValueError("the MTP drafter needs num_spec_tokens >= 1, and no draft model beside it")
        # KV offloading: this rank's share of the host-memory tier, in bytes (0: off).
        self.kv_offloading_bytes = kv_offloading_bytes
        self.runner: ModelRunner | None = None
        self.block_size: int | None = None
        if num_cpus is not None:
            self.set_num_threads(num_cpus)
        torch.manual_seed(seed)

    def set_num_threads(self, num_cpus: int) -> None:
        """Intra-op threads = the CPUs this rank was given (a Ray actor's num_cpus)."""
        torch.set_num_threads(max(1, int(num_cpus)))

    def init_distributed(self, master_addr: str = "127.0.0.1", master_port: int = 29500) -> None:
        distributed.init_distributed(self.rank, self.world_size * self.pipeline_parallel_size, master_addr,
                                     master_port, device=self.device, tp_size=self.world_size,
                                     layer_partition=self.pp_layer_partition)

    @property
    def is_driver(self) -> bool:
        """The rank whose pass output is the engine's: TP rank 0 of the last stage (it samples)."""
        return self.rank == self.world_size * (self.pipeline_parallel_size - 1)

    def load_model(self) -> None:
        if (self.world_size * self.pipeline_parallel_size > 1
                and (distributed.get_tp_world_size(), distributed.get_pp_world_size())
                != (self.world_size, self.pipeline_parallel_size)):
            raise RuntimeError("init_distributed() must come before load_model() with more than one rank")
        if self.pipeline_parallel_size > 1:
            refusal = pipeline_refusal(self.model_config, self.pipeline_parallel_size)
            if refusal is None and (self.draft_config is not None or self.mtp_config is not None):
                refusal = "pipeline parallelism takes no draft model, EAGLE head or MTP drafter"
            if refusal is not None:
                raise ValueError(refusal)
        self.runner = ModelRunner(self.model_config, self.device, self.dtype, self.max_model_len,
                                  self.max_num_seqs, self.max_num_batched_tokens, self.num_spec_tokens,
                                  self.max_lora_rank,
                                  # On an accelerator only a step's worth of adapters stays on the device.
                                  self.max_loras if self.device.type != "cpu" else None,
                                  kv_cache_dtype=self.kv_cache_dtype, max_cpu_loras=self.max_cpu_loras,
                                  max_logprobs=self.max_logprobs, logprobs_mode=self.logprobs_mode,
                                  logits_processors=self._logits_processor_batch(),
                                  mamba_state_dtypes=self.mamba_state_dtypes,
                                  num_recurrent_state_slots=self.num_recurrent_state_slots,
                                  kv_cache_grouping=self.kv_cache_grouping)
        self.runner.load_model(self._weight_source())
        if self.draft_config is not None and self.draft_config.eagle is not None:
            self.runner.load_eagle_drafter(self.draft_config, self.draft_model_dir, self.num_spec_tokens)
        elif self.draft_config is not None:
            self.runner.load_draft_model(self.draft_config, self.draft_model_dir, self.num_spec_tokens)
        if self.mtp_config is not None:
            self.runner.load_mtp_drafter(self._weight_source(), self.num_spec_tokens)
        if self.pooler_dense:
            if self.model_dir is None:
                raise ValueError("Dense projections are read from a model directory; this worker has none")
            self.runner.load_dense(self.model_dir, self.pooler_dense)

    def _logits_processor_batch(self) -> LogitsProcessorBatch | None:
        """The batch of the custom logits processors, None when there are none. Not on a model that
        only pools, nor with speculative decoding (the engine refuses named ones there, as vLLM).
        Every rank keeps the batch's order; only rank 0, which samples, holds processors."""
        if self.model_config.embedding_only or self.num_spec_tokens:
            return None
        # (Entry points were read by the engine, whose list every rank gets whole.)
        classes = load_logits_processors(self.logits_processors, with_entry_points=False)
        if not classes:
            return None
        context = LogitsProcessorContext(
            model=str(self.model_dir) if self.model_dir is not None else "", vocab_size=self.model_config.vocab_size,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len or self.model_config.max_context_len)
        return LogitsProcessorBatch(classes, context, self.device, holds_processors=self.is_driver)

    def _runner(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError("load_model() has not been called")
        return self.runner

    def bytes_per_block(self, block_size: int) -> int:
        """A block's bytes on this rank: its stage's layers' KV cache, and the drafter's beside it (a
        draft model's, the MTP layer's)."""
        # (Under the hybrid KV cache manager, a page of each of the groups' shared tensors.)
        per_block = model_bytes_per_block(self.model_config, block_size, self.world_size, self.kv_cache_dtype,
                                          self._num_stage_attention_layers() if self.kv_cache_grouping is None
                                          else self.kv_cache_grouping.group_size)
        if self.draft_config is not None:
            per_block += model_bytes_per_block(self.draft_config, block_size, self.world_size, self.kv_cache_dtype)
        if self.mtp_config is not None:
            per_block += model_bytes_per_block(self.mtp_config, block_size, self.world_size, self.kv_cache_dtype,
                                               num_layers=1)
        return per_block

    def mamba_state_bytes(self) -> int:
        """The recurrent layers' states on this rank (its pipeline stage's layers'): a row for each of
        max_num_seqs requests, one for each state the prefix cache keeps (--mamba-cache-mode align), and
        with speculative decoding num_spec_tokens more a request (its states before each draft a pass
        verifies: where a rejection puts the request back)."""
        config = self.model_config
        if config.mamba is None:
            return 0
        layers = config.mamba_layers
        if self.pipeline_parallel_size > 1:
            start, end = distributed.pp_layer_range(config.num_hidden_layers, self.rank // self.world_size,
                                                    self.pipeline_parallel_size, self.pp_layer_partition)
            layers = layers[start:end]
        return (config.mamba.per_rank(self.world_size).state_bytes(*self.mamba_state_dtypes) * sum(layers)
                * (self.max_num_seqs * (1 + self.num_spec_tokens) + self.num_recurrent_state_slots))

    def _state_knobs(self, joint: str) -> str:
        """The other flags that size the recurrent states, for an error message: the prefix cache's
        kept states, the states kept after each draft (each draft another state per request)."""
        knobs = (["--mamba-prefix-cache-slots"] if self.num_recurrent_state_slots else []) \
            + (["the speculative config's num_speculative_tokens"] if self.num_spec_tokens else [])
        return "".join(joint + knob for knob in knobs)

    def _states_held(self) -> str:
        slots = self.num_recurrent_state_slots
        return (f"{self.max_num_seqs} requests" + (f" (and {self.num_spec_tokens} after drafts each)"
                                                   if self.num_spec_tokens else "")
                + (f" and {slots} kept for the prefix cache" if slots else ""))

    def _num_stage_attention_layers(self) -> int | None:
        """The layers of this rank's pipeline stage that keep a KV cache (None: one stage, all that do):
        a hybrid's recurrent layers keep none, unless they run beside attention (Falcon-H1's)."""
        if self.pipeline_parallel_size == 1:
            return None
        config = self.model_config
        start, end = distributed.pp_layer_range(config.num_hidden_layers, self.rank // self.world_size,
                                                self.pipeline_parallel_size, self.pp_layer_partition)
        return sum(1 for i in range(start, end) if config.parallel_hybrid or not config.layer_is_mamba(i))

    def determine_num_blocks(self, block_size: int, num_blocks: int | None = None,
                             kv_cache_memory_bytes: int | None = None, gpu_memory_utilization: float = 0.9) -> int:
        """KV blocks for CacheConfig.num_blocks: explicit, from a byte budget, or (CUDA) from what a
        profiled max-size step leaves of ``gpu_memory_utilization`` of the device. Every rank
        returns the group-wide minimum. An encoder keeps no cache: its blocks cost nothing, and
        only count a pass's tokens for the scheduler. A model with recurrent (Mamba, Mamba-2, Gated
        DeltaNet, short-convolution) layers keeps their states for max_num_seqs requests beside the
        blocks; with no attention layer at all its blocks cost nothing either, and are as many as
        max_num_seqs requests of max_model_len tokens need, the states' room still checked against
        the budget."""
        cacheless = self.model_config.encoder_only or not self.model_config.num_attention_layers
        if num_blocks is None and cacheless:
            states = self.mamba_state_bytes()
            # (On CUDA a full pass is still profiled: weights and activations must fit the share.)
            budget = (self._profile_kv_budget(block_size, gpu_memory_utilization) if self.device.type == "cuda"
                      else kv_cache_memory_bytes)
            if budget is not None and budget - states < 0:
                room = f" and the recurrent states of {self._states_held()} ({states} bytes)" if states else ""
                share = (f"gpu_memory_utilization={gpu_memory_utilization} of the device"
                         if self.device.type == "cuda" else f"kv_cache_memory_bytes={kv_cache_memory_bytes}")
                raise ValueError(f"the model, a pass of {self._runner().max_num_batched_tokens} tokens{room} need more "
                                 f"than {share}: raise it, or lower --max-num-batched-tokens / --max-num-seqs"
                                 + self._state_knobs(" / "))
            runner = self._runner()
            num_blocks = (runner.cacheless_num_blocks(block_size) if self.model_config.encoder_only
                          else runner.max_num_seqs * -(-runner.max_model_len // block_size))
        if num_blocks is None and self.bytes_per_block(block_size) == 0:
            # (A pipeline stage of a hybrid's recurrent layers alone keeps no KV: the other stages' blocks
            # bound the count; its states must still fit its budget.)
            budget = (self._profile_kv_budget(block_size, gpu_memory_utilization) if self.device.type == "cuda"
                      else kv_cache_memory_bytes)
            if budget is not None and budget < self.mamba_state_bytes():
                raise ValueError(f"this pipeline stage's recurrent states of {self._states_held()} "
                                 f"({self.mamba_state_bytes()} bytes) need more than its budget ({budget} bytes): "
                                 "lower --max-num-seqs" + self._state_knobs(" or "))
            num_blocks = NO_BLOCK_BOUND
        if num_blocks is None:
            per_block = self.bytes_per_block(block_size)
            if kv_cache_memory_bytes is not None:
                budget = kv_cache_memory_bytes
            elif self.device.type == "cuda":
                budget = self._profile_kv_budget(block_size, gpu_memory_utilization)
            else:
                raise ValueError("on CPU pass num_blocks or kv_cache_memory_bytes")
            states = self.mamba_state_bytes()
            if states and budget - states < per_block:
                raise ValueError(f"the recurrent states of {self._states_held()} ({states} bytes) leave less than "
                                 f"one KV block ({per_block} bytes) of the cache's {budget} bytes: give it more "
                                 "memory, or lower --max-num-seqs"
                                 + self._state_knobs(" / "))
            num_blocks = num_blocks_for_budget(budget - states, per_block)
        return distributed.all_reduce_min(num_blocks, self.device)

    def _profile_kv_budget(self, block_size: int, gpu_memory_utilization: float) -> int:
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._runner().profile_run(block_size)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)  # weights + activations at the peak
        free, total = torch.cuda.mem_get_info(self.device)
        # CUDA context, NCCL buffers, other processes: used, yet not through torch's allocator.
        outside_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        torch.cuda.empty_cache()
        # (LoRA adapters are copied in as steps need them: room for --max-loras of them at --max-lora-rank.)
        lora = self._runner().lora
        adapters = lora.device_bytes_reserved() if lora is not None else 0
        return int(total * gpu_memory_utilization - peak - outside_torch - adapters)

    def initialize_cache(self, num_blocks: int, block_size: int) -> int:
        """The KV cache, and KV offloading's host tier: how many blocks this rank's share holds (0: off)."""
        # (Without offloading no division: a model of Mamba-2 layers alone has blocks of no bytes.)
        num_offload_blocks = (self.kv_offloading_bytes // self.bytes_per_block(block_size)
                              if self.kv_offloading_bytes else 0)
        if self.kv_offloading_bytes and not num_offload_blocks:
            raise ValueError(f"--kv-offloading-size gives this rank {self.kv_offloading_bytes} bytes, less than one "
                             f"KV block ({self.bytes_per_block(block_size)} bytes)")
        self._runner().initialize_kv_cache(num_blocks, block_size, num_offload_blocks)
        self.block_size = block_size
        return num_offload_blocks

    def _transferred_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The caches a prompt's KV blocks travel in between engines (prefill/decode disaggregation):
        the model's layers (under the KV cache groups their shared tensors, a block id a page of each,
        whichever group holds it), then the MTP drafter's layer (of the same geometry; the engines refuse
        a draft model, whose cache differs, with a transfer)."""
        runner = self._runner()
        if self.mtp_config is None or runner.drafter is None:
            return runner.block_caches
        return [*runner.block_caches, *runner.drafter.runner.kv_caches]

    def read_kv_blocks(self, block_ids: list[int]) -> tuple[str, torch.Tensor]:
        """This rank's KV in ``block_ids``, for another engine to read (prefill/decode disaggregation):
        the cache's dtype, and every layer's K and V as one host tensor of the cache's bytes,
        [layers, 2, blocks, block_size, heads, head_dim * element size]."""
        caches = self._transferred_caches()
        if not caches:
            raise RuntimeError("this worker holds no KV cache (asleep, or not initialized)")
        device = caches[0][0].device
        index = torch.tensor(block_ids, dtype=torch.long, device=device)
        # Layer by layer into one host tensor (page-locked beside a GPU, the copies queued and waited
        # for once), so the device needs room for one layer's rows at a time, not the whole prompt's.
        # (As bytes: index_select has no kernel for every cache dtype, fp8 on the CPU among them.)
        row_shape = caches[0][0].view(torch.uint8).shape[1:]
        out = torch.empty((len(caches), 2, len(block_ids), *row_shape), dtype=torch.uint8,
                          pin_memory=device.type == "cuda")
        for layer, (k, v) in enumerate(caches):
            out[layer, 0].copy_(k.view(torch.uint8).index_select(0, index), non_blocking=True)
            out[layer, 1].copy_(v.view(torch.uint8).index_select(0, index), non_blocking=True)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        return str(caches[0][0].dtype).removeprefix("torch."), out

    def write_kv_blocks(self, block_ids: list[int], payload: tuple[str, torch.Tensor]) -> None:
        """Put another engine's KV (``read_kv_blocks``' answer) into this rank's ``block_ids``."""
        dtype, data = payload
        caches = self._transferred_caches()
        if not caches:
            raise RuntimeError("this worker holds no KV cache (asleep, or not initialized)")
        own_dtype = str(caches[0][0].dtype).removeprefix("torch.")
        if dtype != own_dtype:
            raise ValueError(f"the producer's KV cache holds {dtype}, this engine's {own_dtype}: set the same "
                             "--dtype and --kv-cache-dtype on both")
        shape = (len(caches), 2, len(block_ids), *caches[0][0].view(torch.uint8).shape[1:])
        if tuple(data.shape) != shape:
            raise ValueError(f"the producer's KV blocks are shaped {tuple(data.shape)}, this engine's {shape}: the "
                             "same model, block size and tensor-parallel size are needed on both, and the same "
                             "speculative method (an MTP layer's cache travels beside the model's)")
        device = caches[0][0].device
        index = torch.tensor(block_ids, dtype=torch.long, device=device)
        for layer, (k, v) in enumerate(caches):  # (a layer at a time on the device, as read)
            k.view(torch.uint8)[index] = data[layer, 0].to(device)
            v.view(torch.uint8)[index] = data[layer, 1].to(device)

    def sleep(self, level: int) -> None:
        self._runner().sleep(level)

    def wake_up(self, tags: list[str]) -> None:
        self._runner().wake_up(tags, self._weight_source)

    def _weight_source(self) -> WeightSource:
        """The weights to load: the model directory, or a fresh iterator from the factory."""
        weights = self.weights
        return weights() if callable(weights) else weights

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        out = self._runner().execute_model(scheduler_output)
        return out if self.is_driver else None

    def _lora(self) -> LoRAManager:
        lora = self._runner().lora
        if lora is None:
            raise ValueError("LoRA is not enabled on this worker")
        return lora

    def add_lora(self, lora: LoRARequest) -> bool:
        """Load this rank's shard of an adapter; False if it was loaded already."""
        return self._lora().add_adapter(lora)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._lora().remove_adapter(lora_int_id)

    def list_loras(self) -> list[int]:
        return self._lora().list_adapters()

    def shutdown(self) -> None:
        distributed.destroy_distributed()


class RayWorker(Worker):
    """A Worker as a Ray actor (one per TP rank, ``RayWorkerGroupExecutor``): its log lines reach
    Ray's console too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        configure_actor_logging()
        super().__init__(*args, **kwargs)
