"""EngineCore: one scheduler plus one executor, stepped on one thread.

A pass is exactly the seed's order: ``schedule()`` -> ``executor.execute_model()`` ->
``update_from_output()``, once each, with no concurrency inside the pass.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import queue
import time
from collections.abc import Callable
from typing import Any

from engine_core.config import EngineConfig, SchedulerConfig
from engine_core.core.block_pool import ALL_BLOCKS_CLEARED, BLOCKS_STORED, TIER_STORED
from engine_core.core.kv_cache_utils import AttentionWindow, blocks_held_bound
from engine_core.executor import Executor, ModelInfo
from engine_core.kv_transfer import KVConnector, PendingLoad, wants_remote_prefill
from engine_core.logits_processor import LogitsProcessor, load_logits_processors, validate_request_params
from engine_core.lora import LoRANotLoadedError, static_lora_requests
from engine_core.multimodal import check_features, with_article
from engine_core.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    LoRARequest,
    ModelRunnerOutput,
    SchedulerStats,
)
from engine_core.request import FinishReason, Request, RequestStatus
from engine_core.sampling_params import logprobs_count
from engine_core.sched.output import SchedulerOutput
from engine_core.sched.scheduler import PauseState, Scheduler
from engine_core.sleep_mode import WAKE_UP_TAGS, check_sleep, wake_up_tags
from engine_core.spec_decode import NgramProposer, SuffixProposer, model_drafts
from engine_core.structured_output import StructuredOutputManager
from engine_core.tokenizer_loader import load_tokenizer

logger = logging.getLogger(__name__)

_EMPTY_MODEL_OUTPUT = ModelRunnerOutput([], {}, [])


# The most prompt logprobs (alternatives and scored tokens) one request may ask for: they travel as one
# output, which must fit a request-channel frame (256 MiB; about 14 bytes a value).
MAX_PROMPT_LOGPROB_VALUES = 8 * 1024 * 1024
# float16's largest finite value (torch.finfo(torch.float16).max).
FLOAT16_MAX = 65504.0


class RequestRefusedError(ValueError):
    """A request this engine's model cannot serve as asked: generation of an embedding-only model
    (runner pooling), token types for a model without them, a streaming session on an encoder."""


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        self.config = config
        self.executor = executor
        self.model_info: ModelInfo = executor.model_info()
        if config.kv_offloading_size is not None and (self.model_info.sliding_window is not None
                                                      or self.model_info.encoder_only):
            executor.shutdown()
            kind = "an encoder has none of" if self.model_info.encoder_only else "a sliding-window model releases"
            raise ValueError(f"engine {config.engine_index}: --kv-offloading-size keeps prefix-cache blocks, which "
                             f"{kind}: drop it for this model")
        if config.enable_prompt_embeds and (self.model_info.encoder_only or not self.model_info.pooling.generates):
            executor.shutdown()
            raise ValueError(f"engine {config.engine_index}: --enable-prompt-embeds is for generating decoder models: "
                             f"{self.model_info.served_model_name} is an "
                             f"{'encoder' if self.model_info.encoder_only else 'embedding model'}")
        if config.enable_prompt_embeds and self.model_info.inputs_need_token_ids:
            executor.shutdown()
            raise ValueError(f"engine {config.engine_index}: --enable-prompt-embeds: "
                             f"{self.model_info.served_model_name}'s layers read per-layer inputs of the prompt's "
                             "token ids (Gemma 3n's, Gemma 4's), which embeddings do not give")
        num_blocks = executor.determine_num_blocks()
        # (The host-memory tier of KV offloading, in blocks: 0 when off.)
        self.num_offload_blocks = executor.initialize_cache(num_blocks) or 0
        self.num_blocks = num_blocks
        # (The executor may have derived it already, to size its workers' passes alike.)
        sched_cfg = executor.scheduler_config() or config.scheduler
        if sched_cfg.max_model_len is None:  # the model's own context length, as vLLM defaults it
            sched_cfg = sched_cfg.with_max_model_len(self.model_info.max_model_len)
        elif sched_cfg.max_model_len > self.model_info.max_model_len:
            # The model's context window bounds what the scheduler may admit.
            logger.info("engine %d: max_model_len %d capped to the model's %d", config.engine_index,
                        sched_cfg.max_model_len, self.model_info.max_model_len)
            sched_cfg = sched_cfg.with_max_model_len(self.model_info.max_model_len)
        if self.model_info.encoder_only:
            sched_cfg = self._encoder_scheduler_config(sched_cfg)
        capacity = num_blocks * config.block_size
        needed = sched_cfg.max_model_len
        groups = self.model_info.kv_cache_groups
        if groups:
            # The hybrid KV cache manager: a request holds blocks in every group, a windowed group's
            # bounded by its window (and one pass's tokens, with a drafter's lookahead slots).
            spec = config.speculative_config
            lookahead = spec.num_lookahead_slots if spec is not None else 0
            held = blocks_held_bound(needed, groups, sched_cfg.token_budget + lookahead, config.block_size)
            if held > num_blocks:
                executor.shutdown()
                raise ValueError(
                    f"engine {config.engine_index}: max_model_len ({needed}) needs {held} KV blocks over the model's "
                    f"{len(groups)} KV cache groups (full-attention and windowed layers), more than the cache holds "
                    f"({num_blocks} blocks of {config.block_size}): lower --max-model-len or give the cache more "
                    "memory (--num-gpu-blocks, --kv-cache-memory-bytes, --gpu-memory-utilization)")
        window = self.model_info.sliding_window
        if window is not None:
            # Blocks behind the window are released: a request holds at most its window's keys
            # plus one pass's tokens, rounded out to blocks at both ends (vLLM's bound).
            needed = min(needed, AttentionWindow(window).max_blocks_held(sched_cfg.token_budget, config.block_size)
                         * config.block_size)
        if capacity < needed and window is not None and config.scheduler.max_model_len is None:
            # No --max-model-len, and a long pass's window does not fit: serve what the cache holds
            # (at least the window, the length such a model served before the window was implemented).
            logger.info("engine %d: max_model_len %d capped to the %d tokens the KV cache holds",
                        config.engine_index, sched_cfg.max_model_len, capacity)
            sched_cfg = sched_cfg.with_max_model_len(capacity)
            needed = capacity
        if capacity < needed:
            # A request that long could never be admitted, and would hold up the queue behind it.
            executor.shutdown()
            raise ValueError(
                f"engine {config.engine_index}: max_model_len ({sched_cfg.max_model_len}) needs {needed} tokens of "
                f"KV cache, more than it can hold ({num_blocks} blocks of {config.block_size} = {capacity} tokens): "
                "lower --max-model-len or give the cache more memory (--num-gpu-blocks, --kv-cache-memory-bytes, "
                "--gpu-memory-utilization)")
        self.scheduler_config = sched_cfg
        spec = config.speculative_config
        # The custom logits processors' classes, whose validate_params each request meets (the
        # workers load and run them; a pooling model or speculative decoding runs none).
        try:
            self.logits_processor_classes: tuple[type[LogitsProcessor], ...] = (
                load_logits_processors(config.logits_processors)
                if self.model_info.pooling.generates and spec is None else ())
        except Exception:
            executor.shutdown()
            raise
        if self.model_info.encoder_only and config.enable_prefix_caching:
            # (Cached keys of a prefix depend on the tokens after it: a hit would be wrong.)
            self.config = config = dataclasses.replace(config, enable_prefix_caching=False)
        if self.model_info.mamba and config.enable_prefix_caching and config.mamba_cache_mode == "none":
            # (A hit would skip tokens whose recurrent state the cache does not hold, as in vLLM
            # without its align mode.)
            logger.warning("engine %d: prefix caching is off: %s has recurrent layers, whose per-request state "
                           "the prefix cache keeps only under --mamba-cache-mode align", config.engine_index,
                           self.model_info.served_model_name)
            self.config = config = dataclasses.replace(config, enable_prefix_caching=False)
        if config.kv_cache_metrics_sample is not None and not config.enable_prefix_caching:
            # (The residency histograms follow the prefix cache's blocks, as vLLM's: none without it.)
            logger.info("engine %d: --kv-cache-metrics has no effect without prefix caching", config.engine_index)
            self.config = config = dataclasses.replace(config, kv_cache_metrics_sample=None)
        cache_cfg = config.cache_config(num_blocks, self.model_info.sliding_window, self.model_info.long_rope_after,
                                        self.num_offload_blocks, recurrent=self.model_info.mamba,
                                        kv_cache_groups=self.model_info.kv_cache_groups)
        self.scheduler = Scheduler(sched_cfg, cache_cfg,
                                   log_stats=config.log_stats,
                                   include_finished_set=True,
                                   num_spec_tokens=spec.num_speculative_tokens if spec is not None else 0,
                                   lora_config=config.lora_config,
                                   max_tokens_per_mm_item=self.model_info.image_geometry.max_tokens
                                   if self.model_info.image_geometry is not None else 0,
                                   whole_images=self.model_info.image_geometry is not None
                                   and self.model_info.image_geometry.bidirectional)
        # The recurrent layers' states the prefix cache keeps (--mamba-cache-mode align; 0: none kept).
        kept_states = self.scheduler.kv_cache_manager.recurrent_states
        self.num_recurrent_state_slots = kept_states.num_slots if kept_states is not None else 0
        # LoRA adapters loaded on the workers, by id; the static ones (--lora-modules) load now.
        self.loras: dict[int, LoRARequest] = {}
        # Of those, the ones an in-place reload replaced: unloaded when no request uses them.
        self.retired_loras: set[int] = set()
        # A new load's id -> the id it replaces (not listed from the new one's load on).
        self._replaced_by: dict[int, int] = {}
        if config.lora_config is not None:
            if len(config.lora_config.lora_modules) > config.lora_config.max_cpu_loras:
                logger.warning("engine %d: %d adapters and --max-cpu-loras %d: the least recently used are read "
                               "from their checkpoints again inside the steps that need them (raise "
                               "--max-cpu-loras to keep them in memory)", config.engine_index,
                               len(config.lora_config.lora_modules), config.lora_config.max_cpu_loras)
            try:
                for lora in static_lora_requests(config.lora_config.lora_modules):
                    self.add_lora(lora)
            except Exception:
                executor.shutdown()
                raise
        # Speculative decoding: drafts are proposed here, from token ids, after every pass.
        self.drafter: NgramProposer | SuffixProposer | None = None
        if spec is not None and not spec.proposes_in_workers:
            proposer = SuffixProposer if spec.method == "suffix" else NgramProposer
            self.drafter = proposer(spec, sched_cfg.max_model_len)
        # A draft model or MTP layer proposes in the workers, after the pass: the drafts' cache slots
        # come with it.
        self.model_drafts_k = spec.num_lookahead_slots if spec is not None else 0
        if self.model_drafts_k:
            self.scheduler.num_lookahead_tokens = self.model_drafts_k
        self.last_stats = SchedulerStats()
        self.num_steps = 0
        # Passes in flight, oldest first (with their grammar failures), where the executor takes more
        # than one at a time (pipeline stages): see _step_pipelined.
        self._max_batches = max(1, int(getattr(executor, "max_concurrent_batches", 1)))
        self._batch_queue: collections.deque[tuple[SchedulerOutput, list[tuple[str, str]],
                                                   concurrent.futures.Future[ModelRunnerOutput],
                                                   dict[str, Request | None]]] = collections.deque()
        # Passes to take in before the next is scheduled (after one that preempted requests).
        self._passes_to_take = 0
        # The last pass scheduled and produced nothing (paused, or nothing admissible yet).
        self.last_step_idle = False
        # Sleep mode: what the workers have released ("weights", "kv_cache"), and at which level.
        self.asleep: set[str] = set()
        self.sleep_level = 0
        # Totals since start (the scheduler's counters are per-pass deltas).
        self._totals = {"prefix_queries": 0, "prefix_hits": 0, "preemptions": 0, "added": 0, "finished": 0,
                        "max_step_tokens": 0, "drafts": 0, "draft_tokens": 0, "accepted_tokens": 0,
                        "offload_stored": 0, "offload_loaded": 0, "external_queries": 0, "external_hits": 0,
                        "states_saved": 0, "states_restored": 0, "states_evicted": 0, "states_skipped": 0,
                        "kv_sent_blocks": 0, "kv_received_blocks": 0, "kv_load_failures": 0, "kv_declined": 0}
        # Made at the first structured-output request (xgrammar and the tokenizer load then).
        self._structured: StructuredOutputManager | None = None
        self._init_kv_transfer()

    # -- prefill/decode disaggregation (engine_core.kv_transfer) --------------------------------------

    def _init_kv_transfer(self) -> None:
        config = self.config
        transfer = config.kv_transfer_config
        self.kv_connector: KVConnector | None = None
        # How a decode engine reads a producer's blocks: a PendingLoad in, a future of the producer's
        # read_held_kv answer out (the Ray actor shell sets it); and how it is woken when one is done.
        self.kv_fetcher: Callable[[PendingLoad], concurrent.futures.Future[Any]] | None = None
        self.on_kv_load_done: Callable[[], None] | None = None
        # How a decode engine tells a producer it will not read the blocks it holds (fire and forget).
        self.kv_releaser: Callable[[dict[str, Any]], None] | None = None
        self._kv_loads_done: queue.SimpleQueue[tuple[PendingLoad, Any]] = queue.SimpleQueue()
        # Reads started and not answered yet, with when each gives up (the answer and the deadline
        # race for the entry: whichever pops it first decides; the other is dropped).
        self._kv_reads_in_flight: dict[int, tuple[PendingLoad, float]] = {}
        self._kv_load_failures: list[tuple[str, str]] = []
        # Producers' parameters that reached this engine without --kv-transfer-config (it computes
        # those prompts itself): their producers are told, as a consumer's declines are.
        self._unread_kv: list[dict[str, Any]] = []
        if transfer is None:
            return
        info = self.model_info
        problem = ("an encoder computes no KV cache to hand on" if info.encoder_only
                   else "an embedding model decodes nothing" if not info.pooling.generates
                   else "a sliding-window model releases the blocks behind its window"
                   if info.sliding_window is not None
                   else "a draft model's or EAGLE head's KV cache is not transferred (the MTP drafter's is)"
                   if config.speculative_config is not None and config.speculative_config.uses_draft_model
                   else "its layers' KV caches differ in shape (Gemma 4's full layers, MiMo-V2-Flash's windowed "
                        "ones), and the blocks travel as one tensor of every layer's" if info.kv_cache_shapes_differ
                   else None)
        if problem is not None:
            self.executor.shutdown()
            raise ValueError(f"engine {config.engine_index}: --kv-transfer-config: {problem}")
        self.kv_connector = KVConnector(transfer, config.block_size,
                                        {"remote_engine_id": config.engine_name, "remote_host": "", "remote_port": 0,
                                         "tp_size": config.tensor_parallel_size},
                                        group_window_starts=self.scheduler.kv_cache_manager.group_window_starts
                                        if self.scheduler.kv_cache_manager.groups else None)
        self.scheduler.connector = self.kv_connector

    def read_held_kv(self, request_id: str, nonce: str, block_ids: list[int], first_block: int, digest: str,
                     num_tokens: int, group_block_ids: list[int] = ()) -> list[Any]:
        """A decode engine reads the KV of a prefill finished here: ``block_ids``, its held blocks from
        ``first_block`` on (then ``group_block_ids``, its windowed KV cache groups' blocks the reader
        needs), for a reader with the prefill's nonce whose prompt's first ``num_tokens`` tokens have
        ``digest`` (they must be the prefill's); the blocks are let go after their last reader. A read
        refused for its prompt or blocks releases nothing. Busy-loop thread."""
        connector = self.kv_connector
        if connector is None or not connector.held_blocks(request_id, nonce, block_ids, first_block, digest,
                                                          num_tokens, group_block_ids):
            raise KeyError(f"request {request_id!r} holds no KV blocks here (never a prefill for a remote decode, "
                           "already read, or held past abort_request_timeout)")
        every_block = [*block_ids, *group_block_ids]
        try:
            payload = self.executor.read_kv_blocks(every_block)
        finally:
            self.release_held_kv(request_id, nonce)
        self._totals["kv_sent_blocks"] += len(every_block)
        return payload

    def release_held_kv(self, request_id: str, nonce: str) -> None:
        """One reader of a prefill held here is done with it (read it, or will not); the blocks go
        back after the last. Busy-loop thread."""
        request = self.kv_connector.release(request_id, nonce) if self.kv_connector is not None else None
        if request is not None:
            self.scheduler.kv_cache_manager.free(request)

    def decline_remote_kv(self, params: dict[str, Any] | None) -> None:
        """A request dropped before the scheduler saw it (during a pause, or refused) will not read
        the blocks its parameters name: its producer is told. Busy-loop thread."""
        if self.kv_connector is not None:
            self.kv_connector.decline_params(params)
        elif wants_remote_prefill(params):
            assert params is not None
            self._unread_kv.append(params)

    def kv_housekeeping(self) -> None:
        """Free the held blocks of prefills nobody read in time, and tell producers of the blocks
        this engine will not read. Busy-loop thread, every turn."""
        connector = self.kv_connector
        if connector is None and not self._unread_kv:
            return
        declined, self._unread_kv = self._unread_kv, []
        if connector is not None:
            for request in connector.expired():
                self.scheduler.kv_cache_manager.free(request)
            declined += connector.take_declined()
            if self._kv_reads_in_flight:
                self._give_up_slow_reads(connector.config.load_timeout_s)
        for params in declined:
            self._totals["kv_declined"] += 1
            if self.kv_releaser is None:
                continue
            try:
                self.kv_releaser(params)
            except Exception as e:  # (the producer frees them at its timeout)
                logger.info("engine %d: could not tell %r to free request %r's blocks: %s", self.config.engine_index,
                            params.get("remote_engine_id"), params.get("remote_request_id"), e)

    def kv_transfer_totals(self) -> dict[str, int]:
        """Prefill/decode disaggregation since start (the metrics read it at each scrape)."""
        t = self._totals
        return {"sent_blocks": t["kv_sent_blocks"], "received_blocks": t["kv_received_blocks"],
                "failed_reads": t["kv_load_failures"], "declined": t["kv_declined"],
                "held": self.kv_connector.num_held_requests if self.kv_connector is not None else 0}

    def encoder_cache_totals(self) -> dict[str, float]:
        """Images since start (a vision-language model's; the metrics read it at each scrape): those
        the workers encoded, those found encoded already, and the share of the encoder cache in use."""
        scheduler = self.scheduler
        manager = scheduler.encoder_cache_manager
        used = (manager.cache_size - manager.num_free_slots) / manager.cache_size if manager.cache_size else 0.0
        return {"encoded": scheduler.num_images_encoded, "found": scheduler.num_images_found_encoded, "usage": used}

    def _release_all_held_kv(self) -> None:
        if self.kv_connector is not None:
            for request in self.kv_connector.release_all():
                self.scheduler.kv_cache_manager.free(request)

    def _start_kv_loads(self) -> None:
        """Start reading the blocks of the requests this pass parked for remote KV."""
        assert self.kv_connector is not None
        for load in self.kv_connector.take_pending_loads():
            if self.kv_fetcher is None:
                self._kv_loads_done.put((load, RuntimeError("this engine cannot reach other engines")))
                continue
            try:
                future = self.kv_fetcher(load)
            except Exception as e:
                self._kv_loads_done.put((load, e))
                continue
            self._kv_reads_in_flight[id(load)] = (load, time.monotonic() + self.kv_connector.config.load_timeout_s)
            future.add_done_callback(lambda f, load=load: self._kv_load_finished(load, f))

    def _give_up_slow_reads(self, timeout_s: float) -> None:
        """Reads unanswered past their deadline fail (a producer alive but stuck would otherwise hold
        its requests here until their own timeouts). The producer frees its blocks at its own timeout;
        an answer that comes after is dropped."""
        now = time.monotonic()
        for key, (load, deadline) in list(self._kv_reads_in_flight.items()):
            if now >= deadline and self._kv_reads_in_flight.pop(key, None) is not None:
                self._kv_loads_done.put((load, TimeoutError(f"no answer in {timeout_s:g} s (load_timeout)")))

    def _kv_load_finished(self, load: PendingLoad, future: concurrent.futures.Future[Any]) -> None:
        if self._kv_reads_in_flight.pop(id(load), None) is None:
            return  # (given up on already)
        try:
            result = future.result()
        except Exception as e:
            result = e
        self._kv_loads_done.put((load, result))
        if self.on_kv_load_done is not None:
            self.on_kv_load_done()

    def _apply_kv_loads(self) -> None:
        """Write the remote KV read since the last pass into its blocks; those requests can run now
        (or, where the read failed, compute their prompts here or fail, as the config says)."""
        scheduler = self.scheduler
        while True:
            try:
                load, result = self._kv_loads_done.get_nowait()
            except queue.Empty:
                return
            request = scheduler.requests.get(load.request_id)
            if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue  # (aborted meanwhile: its blocks went back to the pool)
            if not isinstance(result, BaseException):
                try:
                    self.executor.write_kv_blocks([*load.block_ids, *load.group_block_ids], result)
                except Exception as e:
                    result = e
            if not isinstance(result, BaseException):
                scheduler.on_remote_kvs_ready(load.request_id)
                self._totals["kv_received_blocks"] += len(load.block_ids) + len(load.group_block_ids)
                continue
            self._totals["kv_load_failures"] += 1
            message = (f"could not read the prompt's KV from {load.params.get('remote_engine_id')!r}: "
                       f"{type(result).__name__}: {result}")
            assert self.kv_connector is not None
            if self.kv_connector.config.kv_load_failure_policy == "fail":
                self._kv_load_failures.append((load.request_id, message))
            else:
                logger.warning("engine %d: request %s %s; computing its prompt here", self.config.engine_index,
                               load.request_id, message)
                scheduler.on_remote_kvs_failed(load.request_id)

    @property
    def structured_output(self) -> StructuredOutputManager:
        if self._structured is None:
            info = self.model_info
            tokenizer_dir = info.tokenizer_dir or info.model_dir

            self._structured = StructuredOutputManager(lambda: load_tokenizer(tokenizer_dir), info.vocab_size,
                                                       info.eos_token_ids)
        return self._structured

    # -- LoRA adapters ----------------------------------------------------------------------------

    def _encoder_scheduler_config(self, sched_cfg: SchedulerConfig) -> SchedulerConfig:
        """An encoder's prompts attend both ways: each is scheduled whole in one pass (no chunked
        prefill, no long-prefill threshold), which a budget below max_model_len could not do."""
        try:
            whole = sched_cfg.for_whole_prompts()
        except ValueError as e:
            self.executor.shutdown()
            raise ValueError(f"engine {self.config.engine_index}: {e}") from None
        logger.info("engine %d: encoder model: whole prompts (budget %d), no prefix caching",
                    self.config.engine_index, whole.token_budget)
        return whole

    def add_lora(self, lora: LoRARequest, replacing: int | None = None) -> bool:
        """Load an adapter on every worker; False when it is loaded already. ValueError for a name
        or id taken by another adapter, or a checkpoint the model cannot serve. ``replacing``: the id
        of the adapter of that name this one is to replace (an in-place reload, finished by
        ``retire_lora``)."""
        if self.config.lora_config is None:
            raise ValueError(f"engine {self.config.engine_index}: LoRA is not enabled (--enable-lora)")
        held = self.loras.get(lora.lora_int_id)
        if held == lora:
            return False  # (loaded on every worker already; a restarted group got it back from the executor)
        if held is not None:
            raise ValueError(f"LoRA id {lora.lora_int_id} is already the adapter {held.lora_name!r}")
        for other in self.loras.values():
            if (other.lora_name == lora.lora_name and other.lora_int_id != replacing
                    and other.lora_int_id not in self.retired_loras):
                raise ValueError(f"a LoRA adapter named {lora.lora_name!r} is already loaded")
        added = self.executor.add_lora(lora)
        self.loras[lora.lora_int_id] = lora
        if replacing is not None and replacing in self.loras:
            # (Listed no longer from now on, before retire_lora: a router looking the name up meanwhile
            # finds the new load.)
            self._replaced_by[lora.lora_int_id] = replacing
        return added

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter no unfinished request uses; False when it was not loaded."""
        if lora_int_id not in self.loras:
            return False
        users = self.lora_users(lora_int_id)
        if users:
            raise ValueError(f"LoRA adapter {self.loras[lora_int_id].lora_name!r} is in use by {users} requests")
        self.executor.remove_lora(lora_int_id)
        del self.loras[lora_int_id]
        self.retired_loras.discard(lora_int_id)
        self._replaced_by.pop(lora_int_id, None)  # (a reload undone: the earlier load is listed again)
        return True

    def retire_lora(self, lora_int_id: int) -> bool:
        """An adapter replaced in place (a reload under its name, loaded with ``replacing``): it
        takes no new requests, and is unloaded once the requests that run under it finish (they
        finish with the weights they started with). False when it was not loaded."""
        if lora_int_id not in self.loras:
            return False
        self.retired_loras.add(lora_int_id)
        self.unload_retired_loras()
        return True

    def unload_retired_loras(self) -> None:
        """(Between passes: the retired adapters no request uses any longer. One the workers fail to
        unload is logged and forgotten here: it must not fail the passes after it.)"""
        for lora_int_id in [i for i in self.retired_loras if not self.lora_users(i)]:
            try:
                self.executor.remove_lora(lora_int_id)
            except Exception:
                logger.exception("engine %d: unloading the replaced LoRA id %d failed", self.config.engine_index,
                                 lora_int_id)
            del self.loras[lora_int_id]
            self.retired_loras.discard(lora_int_id)
            self._replaced_by = {new: old for new, old in self._replaced_by.items() if old != lora_int_id}

    # -- KV cache events ---------------------------------------------------------------------------

    def record_kv_events(self) -> list[tuple[int, list[bytes]]]:
        """Start recording the prefix cache's changes; returns its contents now as events (cleared,
        then every cached hash stored), the starting point for the changes that follow."""
        pool = self.scheduler.kv_cache_manager.block_pool
        pool.record_kv_events()
        pool.take_kv_events()  # (what was recorded before is in the snapshot)
        return self.kv_snapshot()

    def kv_snapshot(self) -> list[tuple[int, list[bytes]]]:
        """The prefix cache's contents as events: cleared, then every cached hash stored (and every
        hash KV offloading's host tier holds)."""
        manager = self.scheduler.kv_cache_manager
        # (A windowed KV cache group's (group, hash) keys are not the router's: it follows group 0's hashes.)
        events = [(ALL_BLOCKS_CLEARED, []), (BLOCKS_STORED, [h for h in manager.block_pool.cached_block_hash_to_block
                                                             if isinstance(h, bytes)])]
        if manager.offload is not None:
            events.append((TIER_STORED, manager.offload.hashes()))
        return events

    def active_lora_adapters(self) -> frozenset[tuple[int, str]]:
        """The adapters (id, name) of the live requests (running or waiting)."""
        return frozenset(self.scheduler.lora_request_counts)

    def lora_adapters_version(self) -> int:
        """Moves whenever ``active_lora_adapters`` does (compare it to skip building the set)."""
        return self.scheduler.lora_adapters_version

    def take_kv_events(self) -> list[tuple[int, list[bytes]]]:
        return self.scheduler.kv_cache_manager.block_pool.take_kv_events()

    def stop_kv_events(self) -> None:
        self.scheduler.kv_cache_manager.block_pool.stop_kv_events()

    def list_loras(self) -> list[LoRARequest]:
        """The adapters requests may name (not those retired by an in-place reload). (Safe to read from
        another thread while the engine's changes them: each is copied whole first.)"""
        hidden = frozenset(self.retired_loras) | frozenset(dict(self._replaced_by).values())
        loaded = list(self.loras.items())  # (read after: one unloaded meanwhile is not listed)
        return [lora for i, lora in loaded if i not in hidden]

    def lora_users(self, lora_int_id: int) -> int:
        """Unfinished requests running under the adapter (an unload waits for them)."""
        return sum(1 for r in list(self.scheduler.requests.values())
                   if r.lora_request is not None and r.lora_request.lora_int_id == lora_int_id)

    def check_lora(self, request: EngineCoreRequest) -> None:
        """LoRANotLoadedError unless the request's adapter (if any) is the one loaded under its id."""
        lora = request.lora_request
        if lora is not None and (self.loras.get(lora.lora_int_id) != lora or lora.lora_int_id in self.retired_loras):
            raise LoRANotLoadedError(f"LoRA adapter {lora.lora_name!r} (id {lora.lora_int_id}) is not loaded on engine "
                             f"{self.config.engine_index}")

    # -- inputs ---------------------------------------------------------------------------------

    def check_servable(self, request: EngineCoreRequest) -> None:
        """RequestRefusedError for what the model cannot serve: generation of an embedding-only model
        (runner pooling), token types for a model without a second type (not a BERT), a resumable
        (streaming-session) request on an encoder, whose prompt must run whole in one pass, or with
        structured output."""
        name, params = self.model_info.served_model_name, request.sampling_params
        if not self.model_info.pooling.generates and not params.embed:
            raise RequestRefusedError(f"{name} is an embedding model (runner pooling): it does not generate; "
                                      "ask it for embeddings")
        if params.compressed_token_type_ids is not None and not self.model_info.pooling.token_types:
            raise RequestRefusedError(f"{name} takes no token types (compressed_token_type_ids): only a model with "
                                      "two token types (BERT) does")
        if request.resumable and self.model_info.encoder_only:
            raise RequestRefusedError(f"{name} is an encoder: its prompts run whole in one pass, so it serves no "
                                      "streaming session (resumable request)")
        if request.resumable and params.structured_output is not None:
            # A session's later turns would run unconstrained: its grammar is compiled for its first
            # turn only.
            raise RequestRefusedError("structured output cannot constrain a streaming session (resumable request): "
                                      "send each constrained turn as a request of its own")
        if request.prompt_embeds is not None:
            self._check_prompt_embeds(request)
        if request.mm_features:
            self._check_images(request)
        if self.logits_processor_classes and not params.embed:
            try:
                validate_request_params(self.logits_processor_classes, params)
            except ValueError as e:  # (whatever the processor raised)
                raise RequestRefusedError(str(e)) from None
        info = self.model_info
        try:
            per_token = logprobs_count("prompt", params.prompt_logprobs, info.vocab_size, info.max_logprobs)
            logprobs_count("sample", params.logprobs, info.vocab_size, info.max_logprobs)
        except ValueError as e:
            raise RequestRefusedError(str(e)) from None
        # (A request's prompt logprobs go out as one answer: a vocabulary of alternatives per prompt token
        # would not fit one frame of the request channel.)
        if per_token is not None:
            values = (per_token + 1) * (len(request.prompt_token_ids) - 1)
            if values > MAX_PROMPT_LOGPROB_VALUES:
                raise RequestRefusedError(f"prompt_logprobs of {per_token} over a prompt of "
                                          f"{len(request.prompt_token_ids)} tokens is {values} values, more than one "
                                          f"answer may carry ({MAX_PROMPT_LOGPROB_VALUES}): ask for fewer")

    def _check_prompt_embeds(self, request: EngineCoreRequest) -> None:
        embeds, name = request.prompt_embeds, self.model_info.served_model_name
        assert embeds is not None
        if not self.config.enable_prompt_embeds:
            raise RequestRefusedError(f"{name} takes no prompt embeddings: start its engines with "
                                      "--enable-prompt-embeds")
        width = self.model_info.input_embedding_size
        if embeds.hidden_size != width:
            raise RequestRefusedError(f"prompt embeddings of {name} must have rows of its hidden size {width}, not "
                                      f"{embeds.hidden_size}")
        if embeds.num_tokens != len(request.prompt_token_ids):
            raise RequestRefusedError(f"a prompt of {embeds.num_tokens} embeddings needs as many placeholder token "
                                      f"ids, not {len(request.prompt_token_ids)}")
        if self.model_info.dtype == "float16" and embeds.dtype != "float16":
            # (Cast to the model's dtype, a value beyond float16's range would run as infinity.)
            largest = float(embeds.to_tensor().abs().max())
            if largest > FLOAT16_MAX:
                raise RequestRefusedError(f"{name} runs in float16, whose largest value is {FLOAT16_MAX:g}: its "
                                          f"prompt embeddings cannot hold {largest:g}")
        params = request.sampling_params
        for refused, what in ((params.embed, "embeddings (pooling)"), (params.prompt_logprobs is not None,
                                                                        "prompt logprobs"),
                              (request.resumable, "a streaming session (resumable request)")):
            if refused:
                raise RequestRefusedError(f"a prompt given as embeddings has no token ids: it cannot ask for {what}")

    def _check_images(self, request: EngineCoreRequest) -> None:
        info, features = self.model_info, request.mm_features
        assert features
        if info.image_token_id is None:
            why = ("--limit-mm-per-prompt '{\"image\": 0}' allows none" if self.config.language_model_only
                   else "it is not a vision-language model")
            raise RequestRefusedError(f"{info.served_model_name} takes no images: {why}")
        geometry = info.image_geometry
        assert geometry is not None
        for feature in features:
            size = feature.image_size or (1, 1)  # (a fixed count: the geometry reads no size)
            if feature.modality == "video" and (info.video_token_id is None or feature.num_frames < 1):
                raise RequestRefusedError(f"{info.served_model_name} takes no videos" if info.video_token_id is None
                                          else "a video needs its number of frames")
            if feature.modality not in ("image", "video"):
                raise RequestRefusedError(f"{info.served_model_name} takes images and videos, not a {feature.modality}")
            if feature.modality == "image" and self.config.language_model_only:  # (its tower kept for videos)
                raise RequestRefusedError(f"{info.served_model_name} takes no images: --limit-mm-per-prompt "
                                          "'{\"image\": 0}' allows none")
            if feature.modality == "video" and self.config.videos_refused:
                raise RequestRefusedError(f"{info.served_model_name} takes no videos: --limit-mm-per-prompt "
                                          "'{\"video\": 0}' allows none")
            if feature.modality == "video" and not 0 <= feature.second_per_grid < float("inf"):
                raise RequestRefusedError(f"a video's seconds per pair of frames must be a number >= 0, not "
                                          f"{feature.second_per_grid}")
            if geometry.counts_by_size and (feature.image_size is None or min(size) < 1):
                raise RequestRefusedError(f"{info.served_model_name} counts an image's tokens by its size: each image "
                                          "needs its (height, width)")
            try:
                tokens = geometry.tokens_of(feature)
            except ValueError as e:  # (Qwen2-VL: an image too thin to resize)
                raise RequestRefusedError(str(e)) from None
            if feature.length != tokens:
                raise RequestRefusedError(f"{info.served_model_name} takes this {feature.modality} as {tokens} tokens, "
                                          f"not {feature.length}")
            # (An image no pass can take would wait forever: the budgets are the model's largest image
            # or more, so this holds only where that bound is wrong, or with whole images per pass.)
            scheduler = self.scheduler
            if tokens > scheduler.max_num_encoder_input_tokens:
                raise RequestRefusedError(f"{with_article(feature.modality)} of {tokens} tokens is more than a pass "
                                          f"may encode ({scheduler.max_num_encoder_input_tokens})")
            whole = scheduler.scheduler_config.disable_chunked_mm_input or scheduler.whole_images
            pass_tokens = scheduler.max_num_scheduled_tokens
            if whole and scheduler.scheduler_config.long_prefill_token_threshold > 0:
                pass_tokens = min(pass_tokens, scheduler.scheduler_config.long_prefill_token_threshold)
            if whole and tokens > pass_tokens:
                why = ("--disable-chunked-mm-input keeps each image in one pass" if not scheduler.whole_images else
                       f"{info.served_model_name}'s image tokens attend to each other, so each image is in one pass")
                raise RequestRefusedError(f"{with_article(feature.modality)} of {tokens} tokens does not fit a pass of "
                                          f"{pass_tokens} tokens (--max-num-batched-tokens, "
                                          f"--long-prefill-token-threshold), and {why}")
            # (Checked here, not in the pass: a misshapen image would fail every request of its pass.)
            shape = geometry.input_shape_of(feature)
            if tuple(feature.pixel_values.shape) != shape:
                raise RequestRefusedError(f"{info.served_model_name}'s vision encoder takes this image's pixel values "
                                          f"as {list(shape)} ([tiles,] channels, height, width, or patches, "
                                          f"patch values), not "
                                          f"{list(feature.pixel_values.shape)}: its image processor's output size "
                                          "must be the tower's image_size")
        try:
            check_features(features, request.prompt_token_ids, info.image_token_id, geometry, info.video_token_id)
        except ValueError as e:
            raise RequestRefusedError(str(e)) from None
        if geometry.native and info.max_positions:
            # (M-RoPE: the text after a video counts on from past its time positions, which may be far
            # past its tokens; every token's position must stay within the model's rotary table.)
            delta = sum(geometry.positions_spanned(f) - f.length for f in features)
            if info.max_model_len + delta > info.max_positions:
                raise RequestRefusedError(f"the prompt's videos span {delta} more positions than they have "
                                          f"tokens (their frames' times): with max_model_len {info.max_model_len} "
                                          f"that is past the model's {info.max_positions} positions")
        if request.resumable:
            raise RequestRefusedError("a prompt with images cannot open a streaming session (resumable request)")

    def add_request(self, request: EngineCoreRequest) -> Request | None:
        """Returns the new Request, or None when the id continued a live streaming session."""
        self.check_lora(request)
        self.check_servable(request)
        eos = request.eos_token_id
        if eos is None and self.model_info.eos_token_ids:
            eos = self.model_info.eos_token_ids[0]
        params = request.sampling_params
        if params.logprobs == -1 or params.prompt_logprobs == -1:  # (-1: every token of the vocabulary)
            vocab, allowed = self.model_info.vocab_size, self.model_info.max_logprobs
            request.sampling_params = params = dataclasses.replace(
                params, logprobs=logprobs_count("sample", params.logprobs, vocab, allowed),
                prompt_logprobs=logprobs_count("prompt", params.prompt_logprobs, vocab, allowed))
        if not params.ignore_eos and self.model_info.eos_token_ids:
            # The model's EOS ids other than the request's (generation config; e.g. Llama 3's end of
            # text beside the tokenizer's end of turn, or a fine-tune's whose tokenizer ends turns with
            # another token) stop it too, as vLLM adds them to the stop ids, whichever client sent it.
            extra = [t for t in self.model_info.eos_token_ids if t != eos and t not in params.stop_token_ids]
            if extra:  # (a copy: the caller's parameters may be shared by other requests)
                request.sampling_params = dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids,
                                                                                         *extra])
        is_new = request.request_id not in self.scheduler.requests
        if self.kv_connector is not None and self.kv_connector.is_held(request.request_id):
            raise ValueError(f"request id {request.request_id!r} is in use (a prefill holding its KV for a reader)")
        engine_request = Request(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params, eos_token_id=eos, arrival_time=request.arrival_time,
            priority=request.priority, client_index=request.client_index, resumable=request.resumable,
            cache_salt=request.cache_salt, lora_request=request.lora_request, prompt_embeds=request.prompt_embeds,
            kv_transfer_params=request.kv_transfer_params if self.kv_connector is not None else None,
            mm_features=request.mm_features)
        if self.kv_connector is None:
            self.decline_remote_kv(request.kv_transfer_params)  # (computed here: a producer is told)
        self.scheduler.add_request(engine_request)
        if is_new:
            self._totals["added"] += 1
            if request.sampling_params.structured_output is not None:
                # Blocked on its grammar (by the Request constructor) until step() sees it compiled.
                self.structured_output.submit(request.request_id, request.sampling_params.structured_output,
                                              request.sampling_params.structured_output_after,
                                              request.sampling_params.structured_output_may_open,
                                              request.sampling_params.structured_output_then)
        return engine_request if is_new else None

    def abort_requests(self, request_ids: list[str], tell_clients: bool = False) -> None:
        """Abort requests; ``tell_clients``: each one's client gets its final output (an abort
        another client asked for, such as a background response cancelled through another router)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED, tell_clients)
        if self._structured is not None:
            for request_id in request_ids:
                self._structured.remove(request_id)

    def abort_all_requests(self) -> int:
        """Abort every request this engine holds, telling each client (a pause's "abort" mode)."""
        aborted = self.scheduler.abort_all_requests()
        # (And prefills held for their readers: a pause clears the cache, and new weights would make
        # their KV stale; the readers compute those prompts themselves.)
        self._release_all_held_kv()
        if self._structured is not None:
            for request_id in aborted:
                self._structured.remove(request_id)
        return len(aborted)

    def pause(self, mode: PauseState) -> None:
        self.scheduler.pause(mode)

    def is_paused(self) -> bool:
        return self.scheduler.pause_state != PauseState.UNPAUSED

    def num_in_flight_requests(self) -> int:
        """Requests this engine still has to finish (streaming sessions waiting for input not counted)."""
        return self.scheduler.get_num_unfinished_requests() - self.scheduler.num_waiting_for_streaming_input

    def resume(self) -> None:
        self.scheduler.resume()

    def reset_prefix_cache(self) -> bool:
        # (Prefills held for their readers go first: their readers compute those prompts themselves.)
        self._release_all_held_kv()
        return self.scheduler.reset_prefix_cache()

    # -- sleep mode ------------------------------------------------------------------------------

    def check_sleep(self, level: int) -> None:
        """ValueError unless this engine may sleep at ``level``."""
        check_sleep(level)
        if not self.config.enable_sleep_mode:
            raise ValueError(f"engine {self.config.engine_index} was not started with --enable-sleep-mode")

    def sleep(self, level: int) -> None:
        """Release the workers' KV cache and weights (level 1: to host memory; 2: discarded). The
        caller has emptied the engine (paused, no KV block in use, prefix cache reset). Wholly asleep
        already: only a deeper level does more (level 2 drops the host copy of level 1); woken in
        part, what was woken is released again (the workers release only what is awake)."""
        self.check_sleep(level)
        if self.asleep == set(WAKE_UP_TAGS) and level <= self.sleep_level:
            return
        if self.scheduler.kv_cache_manager.block_pool.get_usage() > 0:  # (queued requests hold none: they wait)
            raise RuntimeError(f"engine {self.config.engine_index} still holds KV blocks of requests (a "
                               "streaming session waiting for input holds its own): it cannot sleep")
        # Marked first: a rank that fails half-way is repaired by the next wake_up (each tag is
        # restored only where it was released).
        if "weights" not in self.asleep or level > self.sleep_level:  # (the level is the weights', as the workers')
            self.sleep_level = level
        self.asleep = set(WAKE_UP_TAGS)
        # (The workers drop their encoded images with the KV cache: none may be found cached after.)
        self.scheduler.encoder_cache_manager.reset()
        self.executor.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``tags`` name ("weights", "kv_cache"; None: both)."""
        waking = [tag for tag in wake_up_tags(tags) if tag in self.asleep]
        if waking:
            self.executor.wake_up(waking)
            self.asleep.difference_update(waking)
        if not self.asleep:
            self.sleep_level = 0

    def sleep_again(self) -> None:
        """After the workers were replaced (a failed step) while asleep: release what the new ones hold."""
        if self.asleep:
            self.executor.sleep(self.sleep_level)
            awake = [tag for tag in WAKE_UP_TAGS if tag not in self.asleep]
            if awake:  # (woken in part before the restart)
                self.executor.wake_up(awake)

    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def num_drainable_requests(self) -> int:
        """The requests a "wait" pause waits for: those that can still run to their end (under a
        pause of new requests only the running ones; under a full pause none)."""
        state = self.scheduler.pause_state
        if state == PauseState.PAUSED_ALL:
            return 0
        if state == PauseState.PAUSED_NEW:
            return len(self.scheduler.running)
        return self.num_in_flight_requests()

    def has_work(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or self.scheduler.has_finished_requests()
                or bool(self._batch_queue))

    # -- the pass -------------------------------------------------------------------------------

    def step(self) -> dict[int, EngineCoreOutputs]:
        """One pass. Raises whatever the executor raises (the caller fails the requests). Where the
        workers are a pipeline, passes overlap: see _step_pipelined."""
        if self._max_batches > 1:
            return self._step_pipelined()
        scheduler_output, failed = self._schedule_pass()
        if self._has_worker_work(scheduler_output):
            model_output = self.executor.execute_model(scheduler_output)
        else:
            model_output = _EMPTY_MODEL_OUTPUT
        return self._finish_pass(scheduler_output, model_output, failed)

    def _step_pipelined(self) -> dict[int, EngineCoreOutputs]:
        """vLLM's step_with_batch_queue: schedule a pass and start it without waiting while fewer
        than max_concurrent_batches are in flight (a request in flight has nothing new to schedule
        until its output is in, so the next pass holds other requests, or a prompt's next chunk);
        then wait for the oldest and take its output. Outputs are taken in the order passes were
        scheduled."""
        queue = self._batch_queue
        for _, _, future, _ in queue:  # (a failed pass fails the step now, before anything waits behind it)
            if future.done() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
        scheduled_tokens = False
        if len(queue) < self._max_batches and not self._passes_to_take:
            scheduler_output, failed = self._schedule_pass()
            future: concurrent.futures.Future[ModelRunnerOutput] | None = None
            if self._has_worker_work(scheduler_output):
                # (Bookkeeping alone, finished or preempted requests, queues behind the passes in flight too.)
                future = self.executor.execute_model_async(scheduler_output)
            elif failed or not queue:
                # (An empty pass beside passes in flight is dropped, as vLLM drops it: else every step
                # would queue another and the queue never drain.)
                future = concurrent.futures.Future()
                future.set_result(_EMPTY_MODEL_OUTPUT)
            if future is not None:
                # (Which request each scheduled id was: one aborted and added again under its id
                # while the pass was in flight must not get the old one's tokens.)
                scheduled = {rid: self.scheduler.requests.get(rid) for rid in scheduler_output.num_scheduled_tokens}
                queue.append((scheduler_output, failed, future, scheduled))
                scheduled_tokens = scheduler_output.total_num_scheduled_tokens > 0
                if scheduler_output.preempted_req_ids:
                    # A request preempted while an earlier pass holds its next token gets that token
                    # before it can be admitted again: the passes before this one are taken first.
                    self._passes_to_take = len(queue) - 1
            if scheduled_tokens and len(queue) < self._max_batches and not self._passes_to_take:
                self.last_step_idle = False
                return {}
        scheduler_output, failed, future, scheduled = queue.popleft()
        self._passes_to_take = max(0, self._passes_to_take - 1)
        model_output = future.result()
        for rid, request in scheduled.items():
            if self.scheduler.requests.get(rid) is not request:
                del scheduler_output.num_scheduled_tokens[rid]
        return self._finish_pass(scheduler_output, model_output, failed)

    @staticmethod
    def _has_worker_work(scheduler_output: SchedulerOutput) -> bool:
        # (A pass may schedule nothing yet copy blocks: an admission for remote KV can evict cached
        # blocks, which KV offloading saves to its host tier now, before they are overwritten. Or tell
        # the workers to drop encoded images: the scheduler names each eviction once.)
        return bool(scheduler_output.total_num_scheduled_tokens or scheduler_output.finished_req_ids
                    or scheduler_output.preempted_req_ids or scheduler_output.kv_offload_stores
                    or scheduler_output.kv_offload_loads or scheduler_output.free_encoder_mm_hashes)

    def _schedule_pass(self) -> tuple[SchedulerOutput, list[tuple[str, str]]]:
        """The first half of a pass: what runs, with its grammars' bitmask (and the requests whose
        grammar failed)."""
        self._promote_compiled_grammars()
        if self.kv_connector is not None:
            self._apply_kv_loads()
        scheduler_output = self.scheduler.schedule()
        if self.kv_connector is not None:
            self._start_kv_loads()
        return scheduler_output, self._attach_grammar_bitmask(scheduler_output)

    def _finish_pass(self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput,
                     failed: list[tuple[str, str]]) -> dict[int, EngineCoreOutputs]:
        """The second half: the workers' output applied to the requests."""
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        self.kv_housekeeping()
        # (The grammars first: a structured request's drafts are checked against its grammar as of
        # the tokens this pass produced.)
        failed += self._advance_grammars(outputs)
        if self._kv_load_failures:
            failed += self._kv_load_failures
            self._kv_load_failures = []
        self._update_drafts(model_output)
        for request_id, message in failed:
            self._fail_request(outputs, request_id, message)
        self.last_step_idle = (model_output is _EMPTY_MODEL_OUTPUT and not self._batch_queue
                               and not any(eco.outputs for eco in outputs.values()))
        self.num_steps += 1
        now = time.time()
        totals = self._totals
        for eco in outputs.values():
            eco.engine_index = self.config.engine_index
            eco.timestamp = now
            totals["finished"] += sum(1 for o in eco.outputs if o.finish_reason is not None)
            stats = eco.scheduler_stats
            if stats is not None:
                self.last_stats = stats
                totals["prefix_queries"] += stats.prefix_cache_stats.queries
                totals["prefix_hits"] += stats.prefix_cache_stats.hits
                totals["preemptions"] += stats.num_preemptions
                totals["max_step_tokens"] = max(totals["max_step_tokens"], stats.step_num_scheduled_tokens)
                totals["offload_stored"] += stats.kv_offload_stored_blocks
                totals["offload_loaded"] += stats.kv_offload_loaded_blocks
                totals["states_saved"] += stats.recurrent_states_saved
                totals["states_restored"] += stats.recurrent_states_restored
                totals["states_evicted"] += stats.recurrent_states_evicted
                totals["states_skipped"] += stats.recurrent_states_skipped
                if stats.connector_prefix_cache_stats is not None:
                    totals["external_queries"] += stats.connector_prefix_cache_stats.queries
                    totals["external_hits"] += stats.connector_prefix_cache_stats.hits
                if stats.spec_decoding_stats is not None:
                    totals["drafts"] += stats.spec_decoding_stats.num_drafts
                    totals["draft_tokens"] += stats.spec_decoding_stats.num_draft_tokens
                    totals["accepted_tokens"] += stats.spec_decoding_stats.num_accepted_tokens
        if self.retired_loras:
            self.unload_retired_loras()
        return outputs

    def _update_drafts(self, model_output: ModelRunnerOutput) -> None:
        """Give the running requests the drafts their next pass verifies (speculative decoding): the
        n-gram drafter's, or those the draft model proposed in the workers. A structured request's
        draft ends before the first token its grammar refuses (vLLM's ``update_draft_token_ids``):
        the scheduler never schedules, nor reserves slots for, the tokens cut."""
        if self.drafter is not None:  # (every pass: the suffix drafter also learns of the requests that left)
            drafts = self.drafter.propose(self.scheduler.running)
        elif self.model_drafts_k and model_output.draft_token_ids:
            drafts = model_drafts(self.scheduler.running, model_output.draft_token_ids, self.model_drafts_k,
                                  self.scheduler_config.max_model_len)
        else:
            return
        structured = self._structured
        if structured is not None and structured.has_matchers():
            drafts = {r: structured.validate_tokens(r, draft) for r, draft in drafts.items()}
        self.scheduler.update_draft_token_ids(drafts)

    # -- structured output (the grammars live beside the scheduler, see structured_output.py) --------

    def _promote_compiled_grammars(self) -> None:
        structured = self._structured
        if structured is None or not structured.has_pending():
            return
        ready, failed = structured.poll()
        for request_id in ready:
            self.scheduler.on_grammar_ready(request_id)
        for request_id, message in failed:
            self.scheduler.on_grammar_failed(request_id, message)

    def _attach_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> list[tuple[str, str]]:
        """Set the pass's grammar bitmask: rows for each structured request that samples this pass
        (a prefill chunk short of the prompt's end does not), one per position it samples (after its
        last token, and after each scheduled draft). Returns requests whose matcher failed."""
        structured = self._structured
        if structured is None or not structured.has_matchers():
            return []
        requests = self.scheduler.requests
        sampling = [r for r in scheduler_output.num_scheduled_tokens
                    if (req := requests.get(r)) is not None and req.num_computed_tokens >= req.num_tokens]
        scheduler_output.grammar_bitmask, failed = structured.bitmask(
            sampling, scheduler_output.scheduled_spec_decode_tokens)
        return failed

    def _advance_grammars(self, outputs: dict[int, EngineCoreOutputs]) -> list[tuple[str, str]]:
        """Advance each matcher by the tokens its request emitted; drop finished requests' matchers.
        Returns requests that emitted a token their grammar does not allow."""
        structured = self._structured
        if structured is None or not structured.has_matchers():
            return []
        failed = []
        for eco in outputs.values():
            for out in eco.outputs:
                error = structured.accept(out.request_id, out.new_token_ids)
                if out.finish_reason is not None:
                    structured.remove(out.request_id)
                    if error is not None:  # (its last token broke the grammar: an error, not "length")
                        out.finish_reason, out.stop_reason = FinishReason.ERROR, error
                elif error is not None:
                    failed.append((out.request_id, error))
        return failed

    def _fail_request(self, outputs: dict[int, EngineCoreOutputs], request_id: str, message: str) -> None:
        """Finish one live request with an error now (its client reads the message)."""
        request = self.scheduler.requests.get(request_id)
        if request is None or request.is_finished():
            return
        self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ERROR)
        self._add_error_output(outputs, request, message)

    def _add_error_output(self, outputs: dict[int, EngineCoreOutputs], request: Request, message: str) -> None:
        eco = outputs.setdefault(request.client_index,
                                 EngineCoreOutputs(engine_index=self.config.engine_index, timestamp=time.time()))
        eco.outputs.append(EngineCoreOutput(request.request_id, [], FinishReason.ERROR, message))

    @property
    def num_recurrent_states_held(self) -> int:
        """The recurrent-layer states the prefix cache keeps now (0 when it keeps none)."""
        kept = self.scheduler.kv_cache_manager.recurrent_states
        return len(kept) if kept is not None else 0

    def stats(self, healthy: bool = True) -> EngineStats:
        scheduler = self.scheduler
        t = self._totals
        kv = self.kv_transfer_totals()
        return EngineStats(
            engine_index=self.config.engine_index, healthy=healthy,
            scheduler_config=self.scheduler_config.as_dict(), num_blocks=self.num_blocks,
            block_size=self.config.block_size, last=self.last_stats, num_steps=self.num_steps,
            num_free_blocks=scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
            num_unfinished_requests=scheduler.get_num_unfinished_requests(),
            prefix_cache_queries=t["prefix_queries"], prefix_cache_hits=t["prefix_hits"],
            num_preemptions=t["preemptions"], num_requests_added=t["added"], num_requests_finished=t["finished"],
            max_step_num_scheduled_tokens=t["max_step_tokens"], spec_decode_num_drafts=t["drafts"],
            spec_decode_num_draft_tokens=t["draft_tokens"], spec_decode_num_accepted_tokens=t["accepted_tokens"],
            kv_offload_stored_blocks=t["offload_stored"], kv_offload_loaded_blocks=t["offload_loaded"],
            num_offload_blocks=self.num_offload_blocks, external_prefix_cache_queries=t["external_queries"],
            external_prefix_cache_hits=t["external_hits"], recurrent_states_saved=t["states_saved"],
            recurrent_states_restored=t["states_restored"], recurrent_states_evicted=t["states_evicted"],
            recurrent_states_skipped=t["states_skipped"], num_recurrent_state_slots=self.num_recurrent_state_slots,
            recurrent_states_held=self.num_recurrent_states_held,
            kv_transfer_sent_blocks=kv["sent_blocks"],
            kv_transfer_received_blocks=kv["received_blocks"], kv_transfer_failures=kv["failed_reads"],
            kv_transfer_declined=kv["declined"], kv_transfer_held_requests=kv["held"],
            num_images_encoded=self.scheduler.num_images_encoded,
            num_images_found_encoded=self.scheduler.num_images_found_encoded,
            encoder_cache_usage=self.encoder_cache_totals()["usage"])

    def fail_all_requests(self, message: str) -> dict[int, EngineCoreOutputs]:
        """Finish every live request with FINISHED_ERROR and build the outputs telling its client."""
        self._batch_queue.clear()  # (passes in flight went down with the workers)
        self._passes_to_take = 0
        requests = list(self.scheduler.requests.values())
        self.scheduler.finish_requests([r.request_id for r in requests], RequestStatus.FINISHED_ERROR)
        outputs: dict[int, EngineCoreOutputs] = {}
        for request in requests:
            self._add_error_output(outputs, request, message)
        # The workers are gone or reset: forget what the scheduler would tell them next pass.
        self.scheduler.finished_req_ids.clear()
        self._release_all_held_kv()  # (their KV is lost with the workers)
        if self._structured is not None:
            self._structured.clear()
        stats = self.scheduler.make_stats()
        if stats is not None:
            # The gauges (running, waiting, KV usage) as they are now, empty: no pass may follow to
            # report them (nothing is left to run), and they would show the failed load until one did.
            eco = next(iter(outputs.values()), None) or outputs.setdefault(
                0, EngineCoreOutputs(engine_index=self.config.engine_index, timestamp=time.time()))
            eco.scheduler_stats = stats
        return outputs

    def shutdown(self) -> None:
        if self._structured is not None:
            self._structured.shutdown()
        self.executor.shutdown()
