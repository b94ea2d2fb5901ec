"""vLLM-v1-style Scheduler: both halves of one pass in one class.

``schedule()`` runs first in a pass and decides what the model computes; ``update_from_output()``
runs last and folds the sampled tokens back in. Both read and write ``self.running`` and the
waiting queues on the engine's one thread, so there is nothing to lock.
Comments quote the facts of the seed (shared/seed/vllm-scheduler-both-halves.txt) where they live.
"""

from __future__ import annotations

import enum
import time
from collections import defaultdict, deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from engine_core.config import CacheConfig, LoRAConfig, SchedulerConfig
from engine_core.core.encoder_cache_manager import EncoderCacheManager
from engine_core.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from engine_core.core.kv_cache_utils import blocks_held_bound
from engine_core.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    SchedulerStats,
    SpecDecodingStats,
)
from engine_core.request import (
    BLOCKED_WAITING_STATUSES,
    EngineCoreEventType,
    Request,
    RequestStatus,
    StreamingUpdate,
)
from engine_core.sched.interface import SchedulerInterface
from engine_core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from engine_core.sched.request_queue import RequestQueue, SchedulingPolicy, create_request_queue
from engine_core.sched.utils import check_stop, remove_all

if TYPE_CHECKING:
    from engine_core.kv_transfer import KVConnector

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED
_WAITING = RequestStatus.WAITING


# vLLM's pause modes (POST /pause?mode=): what happens to the requests in flight (EngineActor.pause_generation).
PAUSE_MODES = ("abort", "wait", "keep")


class PauseState(enum.IntEnum):
    UNPAUSED = 0
    # No admissions; running requests keep going.
    PAUSED_NEW = 1
    # Nothing at all: the token budget is 0.
    PAUSED_ALL = 2


class _PartialPrefillCounter:
    """How many requests are mid-prefill in this pass, and how many of those are long.

    Active only when max_num_partial_prefills > 1 (default 1 = the seed's engine, no cap).
    """

    __slots__ = ("long_threshold", "max_long", "max_partial", "num_long", "num_partial")

    def __init__(self, config: SchedulerConfig) -> None:
        self.max_partial = config.max_num_partial_prefills
        self.max_long = config.max_long_partial_prefills
        self.long_threshold = config.long_prefill_token_threshold
        self.num_partial = 0
        self.num_long = 0

    def add(self, num_prompt_tokens_left: int) -> None:
        self.num_partial += 1
        if num_prompt_tokens_left > self.long_threshold:
            self.num_long += 1

    @property
    def full(self) -> bool:
        """No further prompt may be mid-prefill in this pass."""
        return self.num_partial >= self.max_partial

    def refuses_long(self, num_prompt_tokens_left: int) -> bool:
        """A prompt this long would be one long prefill too many (only known after its cache lookup)."""
        return num_prompt_tokens_left > self.long_threshold and self.num_long >= self.max_long


class _EncoderPass:
    """A pass's encoder work (images of vision-language prompts): what is left of its budget (in
    encoder output rows), and the images it reserved room for in the encoder cache (identifier ->
    rows), which a request scheduled in the pass must encode (``Scheduler._encoder_work``)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.allocated: dict[str, int] = {}
        # Per request scheduled, the images its chunk found encoded already (counted at the end of
        # the pass, for the requests still scheduled then).
        self.found: dict[str, int] = {}


def _count_adapters(requests: list[Request]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for request in requests:
        if request.lora_request is not None:
            name = request.lora_request.lora_name
            counts[name] = counts.get(name, 0) + 1
    return counts


class Scheduler(SchedulerInterface):
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 log_stats: bool = True, include_finished_set: bool = False, num_spec_tokens: int = 0,
                 lora_config: LoRAConfig | None = None, max_tokens_per_mm_item: int = 0,
                 whole_images: bool = False) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.log_stats = log_stats
        # --max-num-seqs becomes max_num_running_reqs: an admission cap, not a batch cap.
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        # max_num_scheduled_tokens if set, else max_num_batched_tokens: the seed of token_budget.
        self.max_num_scheduled_tokens = scheduler_config.token_budget
        self.max_model_len = scheduler_config.max_model_len
        # A vision-language model's images (vLLM's compute_mm_encoder_budget): a pass encodes at most
        # as many rows as it schedules tokens (or one image, if larger), and the encoder cache holds
        # as many; 0 for a text model.
        encoder_budget = max(self.max_num_scheduled_tokens, max_tokens_per_mm_item) if max_tokens_per_mm_item else 0
        self.max_num_encoder_input_tokens = encoder_budget
        # Gemma 3: an image's tokens attend to each other both ways, so no chunk ends inside an image,
        # cached or not (what is left of one after a prefix-cache hit runs in one chunk too).
        self.whole_images = whole_images
        self.encoder_cache_manager = EncoderCacheManager(encoder_budget)
        # Since start: images the workers encoded, and images a request met encoded already (the
        # encoder cache's hits; an image wholly inside a request's prefix-cache hit is neither).
        self.num_images_encoded = 0
        self.num_images_found_encoded = 0
        self.policy = SchedulingPolicy(scheduler_config.policy)
        self.block_size = cache_config.block_size
        self.num_lookahead_tokens = 0
        # Most draft tokens a request carries into a pass (speculative decoding; 0: off).
        self.num_spec_tokens = num_spec_tokens
        # Most distinct LoRA adapters in one pass (0: LoRA off). Both loops hold it.
        self.max_loras = lora_config.max_loras if lora_config is not None else 0
        # Adapters whose requests the cap held back, carried to the next pass (fairness, see _schedule_waiting).
        self._held_back_loras: set[int] = set()
        # Prefill/decode disaggregation (engine_core.kv_transfer; set by the engine when configured).
        self.connector: KVConnector | None = None

        # Every live request, whichever collection holds it.
        self.requests: dict[str, Request] = {}
        # The live requests under each LoRA adapter (by its cache key), and a count of the changes to
        # which adapters have any (the engine tells routers when it moves: LoRA affinity).
        self.lora_request_counts: dict[tuple[int, str], int] = {}
        self.lora_adapters_version = 0
        self.waiting: RequestQueue = create_request_queue(self.policy)
        # Requests that cannot be looked at yet (or were declined this pass); drained first under FCFS.
        self.skipped_waiting: RequestQueue = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Paused streaming sessions: in skipped_waiting, yet they hold a slot against max_num_seqs.
        self.num_waiting_for_streaming_input = 0

        # Finished since the previous pass: the workers drop these.
        self.finished_req_ids: set[str] = set()
        # Per client, finished since the last send (only with include_finished_set).
        self.finished_req_ids_dict: dict[int, set[str]] | None = (
            defaultdict(set) if include_finished_set else None)
        # Finished outside a pass (grammar failure, never schedulable): reported by the next
        # update_from_output, since no worker row carries them.
        self._finished_outside_pass: list[Request] = []
        self._grammar_failures: dict[str, str] = {}
        self._pause_state = PauseState.UNPAUSED

        self.kv_cache_manager = KVCacheManager(
            num_blocks=cache_config.num_blocks, block_size=cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching, log_stats=log_stats,
            sliding_window=cache_config.sliding_window, long_rope_after=cache_config.long_rope_after,
            kv_cache_metrics_sample=cache_config.kv_cache_metrics_sample, max_model_len=self.max_model_len,
            num_offload_blocks=cache_config.num_offload_blocks,
            num_recurrent_state_slots=cache_config.num_recurrent_state_slots,
            kv_cache_groups=cache_config.kv_cache_groups)
        # Recurrent layers' states kept at the block boundaries worth keeping that the passes cross
        # (--mamba-cache-mode align; chunks are not cut for it: the workers copy a state out where a
        # chunk's scan passes it).
        self.keeps_recurrent_states = self.kv_cache_manager.recurrent_states is not None

        # Stats counters (deltas since make_stats) and last-pass figures.
        self._num_preemptions = 0
        self._num_scheduled_tokens = 0
        self._num_steps = 0
        self._last_step_tokens = 0
        self._last_step_budget = 0
        self._spec_stats = SpecDecodingStats(num_spec_tokens, num_accepted_tokens_per_pos=[0] * num_spec_tokens) \
            if num_spec_tokens else None

    # ------------------------------------------------------------------ add_request

    def add_request(self, request: Request) -> None:
        existing = self.requests.get(request.request_id)
        # A live id is not a new request: it is the next input chunk of a streaming session.
        if existing is not None:
            if existing.streaming_queue is None:
                raise ValueError(f"request id {request.request_id!r} is already in use "
                                 "and is not a resumable streaming session")
            update = StreamingUpdate.from_request(request)
            if existing.status != RequestStatus.WAITING_FOR_STREAMING_REQ:
                # The session is busy: the update (or None, which ends it) waits its turn.
                existing.streaming_queue.append(update)
            elif update is not None:
                self._update_request_as_session(existing, update)
            else:
                # A non-resumable continuation of an idle session ends it.
                self.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
            return
        if request.resumable:
            request.streaming_queue = deque()
        # No allocation, no budget, no limit here: add_request cannot fail for capacity.
        self._enqueue_waiting_request(request)
        self.requests[request.request_id] = request
        if request.lora_request is not None:
            key = request.lora_request.cache_key
            count = self.lora_request_counts.get(key, 0)
            self.lora_request_counts[key] = count + 1
            if not count:
                self.lora_adapters_version += 1
        if self.log_stats:
            request.record_event(EngineCoreEventType.QUEUED)

    def _enqueue_waiting_request(self, request: Request) -> None:
        # The routing rule: a WAITING_FOR_* status goes to skipped_waiting, anything else to waiting.
        if request.status in BLOCKED_WAITING_STATUSES:
            self.skipped_waiting.add_request(request)
        else:
            self.waiting.add_request(request)

    def _update_request_as_session(self, request: Request, update: StreamingUpdate) -> None:
        """Apply the next chunk to an idle session; it stays in skipped_waiting, now admissible."""
        self._continue_session(request, update)
        request.status = _WAITING
        self.num_waiting_for_streaming_input -= 1

    # ------------------------------------------------------------------ blocked-request hooks

    def on_grammar_ready(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is not None and request.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
            # Blocked is a phase: promoted to WAITING, admitted from skipped_waiting on a later pass.
            request.status = _WAITING

    def on_remote_kvs_ready(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            request.status = _WAITING

    def on_grammar_failed(self, request_id: str, message: str) -> None:
        request = self.requests.get(request_id)
        if request is not None and not request.is_finished():
            # Finished with FINISHED_ERROR by the next update_from_output; nobody else is touched.
            self._grammar_failures[request_id] = message

    # ------------------------------------------------------------------ schedule (first half)

    def schedule(self) -> SchedulerOutput:
        num_scheduled_tokens: dict[str, int] = {}
        preempted_reqs: list[Request] = []
        scheduled_new_reqs: list[Request] = []
        scheduled_resumed_reqs: list[Request] = []
        scheduled_running_reqs: list[Request] = []
        req_to_new_blocks: dict[str, KVCacheBlocks] = {}
        scheduled_spec_decode_tokens: dict[str, list[int]] = {}
        # The budget is a local: seeded every pass, spent by subtraction, thrown away at return.
        token_budget = 0 if self._pause_state == PauseState.PAUSED_ALL else self.max_num_scheduled_tokens
        initial_budget = token_budget
        scheduled_timestamp = time.time()
        # Read straight off the config, in both loops (never copied onto the scheduler).
        threshold = self.scheduler_config.long_prefill_token_threshold
        partial = (_PartialPrefillCounter(self.scheduler_config)
                   if self.scheduler_config.max_num_partial_prefills > 1 else None)
        kv_cache_manager = self.kv_cache_manager
        running = self.running
        # The adapters of the requests scheduled so far this pass (LoRA slot accounting), and those
        # of requests the max_loras cap held back (in an earlier pass too, while they still wait).
        scheduled_loras: set[int] = set()
        max_loras = self.max_loras
        held_back_loras = self._waiting_held_back_loras() if self._held_back_loras else set()
        encoder_pass = _EncoderPass(self.max_num_encoder_input_tokens)

        # Running loop first, indexed by hand: preemption mutates self.running while we walk it.
        req_index = 0
        while req_index < len(running) and token_budget > 0:
            request = running[req_index]
            # The known tokens only: drafts (num_tokens_with_spec - num_tokens) are added by
            # _schedule_drafts once every running request has its own tokens, so that no draft ever
            # costs another request its place (no output placeholders here).
            num_new_tokens = len(request.all_token_ids) - request.num_computed_tokens
            # Per-request clamp; "0 <" is the on/off switch (0 disables).
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            # Running requests are clamped by the budget, never rejected: chunked prefill is this min().
            num_new_tokens = min(num_new_tokens, token_budget)
            encoder_inputs: list[int] = []
            found = 0
            if request.mm_features and num_new_tokens:
                # A chunk reaching an image its encoder budget (or cache) cannot take stops before it.
                encoder_inputs, num_new_tokens, encoder_budget, found = self._try_schedule_encoder_inputs(
                    request, request.num_computed_tokens, num_new_tokens, encoder_pass.budget, first_chunk=False)
            if num_new_tokens == 0:
                # Skip, don't stop: requests behind a stuck one still get scheduled (not strict FCFS).
                # (Nor does it hold its adapter's place: a request whose pass is still in flight.)
                req_index += 1
                continue
            if (max_loras and request.lora_request is not None and len(scheduled_loras) >= max_loras
                    and request.lora_request.lora_int_id not in scheduled_loras):
                # Another adapter would exceed max_loras in this batch: it waits for a later pass.
                held_back_loras.add(request.lora_request.lora_int_id)
                req_index += 1
                continue

            # allocate_slots returns None (never raises) when the pool cannot satisfy the request;
            # that sentinel selects the preemption branch, retried until allocation succeeds.
            while True:
                new_blocks = kv_cache_manager.allocate_slots(
                    request, num_new_tokens, num_lookahead_tokens=self.num_lookahead_tokens)
                if new_blocks is not None:
                    break
                if self.policy == SchedulingPolicy.PRIORITY:
                    # Priority victim: worst priority, latest arrival.
                    preempted_req = max(running, key=lambda r: (r.priority, r.arrival_time))
                    running.remove(preempted_req)
                    if preempted_req in scheduled_running_reqs:
                        # Victim already scheduled this pass: give its tokens back and step back.
                        preempted_req_id = preempted_req.request_id
                        scheduled_running_reqs.remove(preempted_req)
                        token_budget += num_scheduled_tokens.pop(preempted_req_id)
                        req_to_new_blocks.pop(preempted_req_id)
                        # Blocks cached for tokens that will now not be computed must not be hit.
                        kv_cache_manager.uncache_uncomputed_blocks(preempted_req)
                        req_index -= 1
                else:
                    # FCFS victim: the last of running, i.e. the most recently admitted.
                    preempted_req = running.pop()
                self._preempt_request(preempted_req, scheduled_timestamp)
                preempted_reqs.append(preempted_req)
                if preempted_req is request:
                    # Self-eviction: nothing left to preempt but the request itself.
                    break
            if new_blocks is None:
                # This pass stops growing: nothing further in the running loop.
                break

            if partial is not None and request.num_computed_tokens < request.num_prompt_tokens:
                # Running prefill chunks count against the partial-prefill caps (never refused by them).
                partial.add(request.num_prompt_tokens - request.num_computed_tokens)
            scheduled_running_reqs.append(request)
            req_to_new_blocks[request.request_id] = new_blocks
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            if encoder_inputs or found:
                self._commit_encoder_inputs(request, encoder_inputs, encoder_budget, encoder_pass, found)
            if request.lora_request is not None:
                scheduled_loras.add(request.lora_request.lora_int_id)
            req_index += 1

        if self.num_spec_tokens and scheduled_running_reqs:
            token_budget = self._schedule_drafts(scheduled_running_reqs, token_budget, threshold, num_scheduled_tokens,
                                                 req_to_new_blocks, scheduled_spec_decode_tokens)

        # Admission loop second, and only if nothing was preempted this pass and we are unpaused:
        # one preemption cancels every admission of the pass.
        if not preempted_reqs and self._pause_state == PauseState.UNPAUSED:
            token_budget = self._schedule_waiting(
                token_budget, threshold, partial, num_scheduled_tokens, scheduled_new_reqs,
                scheduled_resumed_reqs, req_to_new_blocks, scheduled_timestamp, scheduled_loras, held_back_loras,
                encoder_pass)

        self._held_back_loras = held_back_loras - scheduled_loras

        # Tripwires, not the mechanism: the arithmetic above is what holds the line.
        total_num_scheduled_tokens = sum(num_scheduled_tokens.values())
        assert token_budget >= 0
        assert total_num_scheduled_tokens <= self.max_num_scheduled_tokens
        assert len(self.running) <= self.max_num_running_reqs

        scheduler_output = SchedulerOutput(
            scheduled_new_reqs=[self._make_new_request_data(r) for r in scheduled_new_reqs],
            scheduled_cached_reqs=self._make_cached_request_data(
                scheduled_running_reqs, scheduled_resumed_reqs, num_scheduled_tokens, req_to_new_blocks),
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total_num_scheduled_tokens,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted_reqs},
            scheduled_spec_decode_tokens=scheduled_spec_decode_tokens,
            scheduled_encoder_inputs=self._encoder_work(encoder_pass, num_scheduled_tokens),
            free_encoder_mm_hashes=self.encoder_cache_manager.get_freed_mm_hashes(),
        )
        if kv_cache_manager.offload is not None:
            scheduler_output.kv_offload_stores, scheduler_output.kv_offload_loads = \
                kv_cache_manager.take_offload_copies()
        self.finished_req_ids = set()
        self._last_step_budget = initial_budget
        self._update_after_schedule(scheduler_output, scheduled_running_reqs, scheduled_new_reqs,
                                    scheduled_resumed_reqs)
        return scheduler_output

    def _schedule_drafts(self, scheduled: list[Request], token_budget: int, threshold: int,
                         num_scheduled_tokens: dict[str, int], req_to_new_blocks: dict[str, KVCacheBlocks],
                         scheduled_spec_decode_tokens: dict[str, list[int]]) -> int:
        """Add the drafts of the decodes just scheduled, from what is left of the budget and of the
        pool, before any admission. A draft whose slots do not fit shrinks to the slots its request
        already holds (or to nothing): drafts never preempt. Returns what is left of the token budget."""
        kv_cache_manager = self.kv_cache_manager
        for request in scheduled:
            draft = request.spec_token_ids
            if not draft:
                continue
            request.spec_token_ids = []  # spent, scheduled or not; the drafter proposes afresh next pass
            req_id = request.request_id
            num_new_tokens = num_scheduled_tokens[req_id]
            if token_budget <= 0 or request.num_computed_tokens + num_new_tokens != request.num_tokens:
                continue  # no budget left, or not a decode that reaches its last token
            # The input positions must stay inside max_model_len, and the threshold clamps the total.
            num_draft = min(len(draft), token_budget, self.max_model_len - request.num_tokens)
            if threshold > 0:
                num_draft = min(num_draft, threshold - num_new_tokens)
            if num_draft <= 0:
                continue
            new_blocks = kv_cache_manager.allocate_slots(request, num_new_tokens + num_draft,
                                                         num_lookahead_tokens=self.num_lookahead_tokens)
            if new_blocks is None:
                # The pool cannot take them all: keep those that fit in the request's own blocks.
                room = (len(kv_cache_manager.req_to_blocks[req_id]) * self.block_size - request.num_computed_tokens
                        - num_new_tokens - self.num_lookahead_tokens)
                num_draft = min(num_draft, room)
                if num_draft <= 0:
                    continue
                new_blocks = kv_cache_manager.allocate_slots(request, num_new_tokens + num_draft,
                                                             num_lookahead_tokens=self.num_lookahead_tokens)
                if new_blocks is None:
                    continue
            if new_blocks:
                req_to_new_blocks[req_id] = req_to_new_blocks[req_id] + new_blocks
            num_scheduled_tokens[req_id] = num_new_tokens + num_draft
            scheduled_spec_decode_tokens[req_id] = draft[:num_draft]
            token_budget -= num_draft
        return token_budget

    def _schedule_waiting(self, token_budget: int, threshold: int,
                          partial: _PartialPrefillCounter | None,
                          num_scheduled_tokens: dict[str, int], scheduled_new_reqs: list[Request],
                          scheduled_resumed_reqs: list[Request], req_to_new_blocks: dict[str, KVCacheBlocks],
                          scheduled_timestamp: float, scheduled_loras: set[int], held_back_loras: set[int],
                          encoder_pass: _EncoderPass) -> int:
        """The admission loop. Returns what is left of the token budget."""
        kv_cache_manager = self.kv_cache_manager
        step_skipped_waiting = create_request_queue(self.policy)
        enable_chunked_prefill = self.scheduler_config.enable_chunked_prefill
        while (self.waiting or self.skipped_waiting) and token_budget > 0:
            # Paused streaming sessions hold slots too: the cap is on running + waiting-for-streaming.
            if len(self.running) + self.num_waiting_for_streaming_input >= self.max_num_running_reqs:
                break
            request_queue = self._select_waiting_queue_for_scheduling()
            request = request_queue.peek_request()

            if request.status in BLOCKED_WAITING_STATUSES:
                # Still blocked (grammar, remote KVs, idle session): set aside for this pass.
                request_queue.pop_request()
                step_skipped_waiting.prepend_request(request)
                continue
            if self._can_never_fit(request):
                request_queue.pop_request()
                self._finish_outside_pass(request, RequestStatus.FINISHED_IGNORED)
                continue
            if (self.connector is not None and request.kv_transfer_params is not None
                    and request.num_computed_tokens == 0 and self.connector.waits_for_sibling(request)):
                # Another choice of its prompt reads the same prefill's KV here: this one waits to find
                # it in the prefix cache (one read, one copy of the blocks).
                request_queue.pop_request()
                step_skipped_waiting.prepend_request(request)
                continue
            lora = request.lora_request
            if lora is not None and self.max_loras:
                # Admitting it would put one adapter too many in this batch: skipped, not a stop.
                over_cap = len(scheduled_loras) >= self.max_loras and lora.lora_int_id not in scheduled_loras
                # And while a request of another adapter is held back by the cap, no request of a
                # different adapter is admitted (even of one in the batch): the batch's adapters drain
                # and the one held back gets its slot. (vLLM lets it wait as long as the others have
                # traffic.) Base-model requests hold no slot and still go in.
                behind = bool(held_back_loras) and lora.lora_int_id not in held_back_loras
                if over_cap or behind:
                    if over_cap:
                        held_back_loras.add(lora.lora_int_id)
                    request_queue.pop_request()
                    step_skipped_waiting.prepend_request(request)
                    continue

            if partial is not None and partial.full and request.num_computed_tokens < request.num_prompt_tokens:
                # The partial-prefill cap is full: no prompt goes in this pass, whatever it finds
                # cached (skipped before its lookup, which would count in the prefix-cache stats).
                request_queue.pop_request()
                step_skipped_waiting.prepend_request(request)
                continue

            offloaded = kv_cache_manager.no_offloaded_blocks
            looked_up = request.num_computed_tokens == 0
            if looked_up:
                # A prefix hit reaches the scheduler as one smaller local num_computed_tokens. (Under
                # the partial-prefill caps the lookup counts once the request passes them.)
                new_computed_blocks, num_new_local_computed_tokens = \
                    kv_cache_manager.get_computed_blocks(request, record=False)
                # And the blocks after it that the offloading tier holds (vLLM's external tokens):
                # computed once copied into new blocks, before the pass.
                offloaded = kv_cache_manager.get_offloaded_blocks(request, new_computed_blocks)
                num_computed_tokens = num_new_local_computed_tokens + len(offloaded) * kv_cache_manager.block_size
                # (The prefix cache's hit: under the KV cache groups the tier's longer hit may take device
                # blocks past where the device's own stopped.)
                num_device_hit_tokens = num_computed_tokens - offloaded.num_loaded_blocks * kv_cache_manager.block_size
            else:
                # A continued streaming session keeps its blocks and its computed tokens.
                new_computed_blocks = kv_cache_manager.empty_kv_cache_blocks()
                num_new_local_computed_tokens = num_device_hit_tokens = 0
                num_computed_tokens = request.num_computed_tokens
            num_external_tokens = num_computed_tokens - num_new_local_computed_tokens if offloaded else 0

            remote = looked_up and self.connector is not None and request.kv_transfer_params is not None
            block_size = kv_cache_manager.block_size
            if remote and offloaded and request.num_prompt_tokens - 1 - num_computed_tokens >= block_size:
                # The host tier holds only part of the rest: the producer's blocks (all of it) are read.
                offloaded, num_computed_tokens, num_external_tokens = \
                    kv_cache_manager.no_offloaded_blocks, num_new_local_computed_tokens, 0
                num_device_hit_tokens = num_new_local_computed_tokens
            if looked_up and partial is None:
                kv_cache_manager.record_lookup(request, num_device_hit_tokens)
            if remote:
                # Prefill/decode disaggregation: the rest of the prompt is read from the engine that
                # computed it. Blocks now, no pass: the request waits for the data (WAITING_FOR_REMOTE_KVS).
                assert self.connector is not None
                if offloaded:  # (the host tier holds the rest: read from there, not remotely)
                    self.connector.decline(request)
                num_remote_tokens = 0 if offloaded else \
                    self.connector.get_num_new_matched_tokens(request, num_new_local_computed_tokens)
                if num_remote_tokens:
                    if not self._admit_for_remote_kvs(request, request_queue, num_new_local_computed_tokens,
                                                      num_remote_tokens, new_computed_blocks, partial is not None):
                        break  # (the pool cannot take it: admission stops here, as below)
                    step_skipped_waiting.prepend_request(request)
                    continue

            num_new_tokens = request.num_tokens - num_computed_tokens
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            # Without chunked prefill a waiting request that does not fit is refused outright.
            if not enable_chunked_prefill and num_new_tokens > token_budget:
                break
            num_new_tokens = min(num_new_tokens, token_budget)
            encoder_inputs: list[int] = []
            found = 0
            if request.mm_features:
                encoder_inputs, num_new_tokens, encoder_budget, found = self._try_schedule_encoder_inputs(
                    request, num_computed_tokens, num_new_tokens, encoder_pass.budget, first_chunk=True)
                if num_new_tokens == 0:
                    break  # (the encoder budget or cache cannot take its next image this pass)

            if partial is not None:
                prompt_left = request.num_prompt_tokens - num_computed_tokens
                if prompt_left > 0 and partial.refuses_long(prompt_left):
                    # Refused by the long-prefill cap (the count cap refused before the lookup):
                    # skipped, not a reason to stop admitting.
                    request_queue.pop_request()
                    step_skipped_waiting.prepend_request(request)
                    continue
                if looked_up:
                    kv_cache_manager.record_lookup(request, num_device_hit_tokens)

            # (With blocks from the tier, the device hit as they leave it: a hybrid model's windowed groups'
            # blocks from the window of the first token computed.)
            new_blocks = kv_cache_manager.allocate_slots(
                request, num_new_tokens + num_external_tokens, num_new_local_computed_tokens,
                offloaded.computed if offloaded else new_computed_blocks,
                num_lookahead_tokens=self.num_lookahead_tokens)
            if new_blocks is None:
                # The pool cannot take it: admission stops here (the request keeps its place).
                break
            if offloaded:
                kv_cache_manager.load_offloaded_blocks(request, offloaded)
            if looked_up:  # (recurrent layers: their state at the hit's end is restored)
                kv_cache_manager.plan_state_restore(request, num_new_local_computed_tokens)

            request = request_queue.pop_request()
            # The only append to self.running anywhere: max_num_seqs guards the door, not the room.
            self.running.append(request)
            if request.status == _PREEMPTED:
                scheduled_resumed_reqs.append(request)
            else:
                scheduled_new_reqs.append(request)
            if partial is not None and request.num_prompt_tokens > num_computed_tokens:
                partial.add(request.num_prompt_tokens - num_computed_tokens)
            req_to_new_blocks[request.request_id] = new_blocks
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            if encoder_inputs or found:
                self._commit_encoder_inputs(request, encoder_inputs, encoder_budget, encoder_pass, found)
            request.status = _RUNNING
            request.num_computed_tokens = num_computed_tokens
            if lora is not None:
                scheduled_loras.add(lora.lora_int_id)
            # (The tokens the tier's copies bring: under the KV cache groups a longer hit may also take
            # device blocks past where the device's own hit stopped, counted as the prefix cache's.)
            num_tier_tokens = offloaded.num_loaded_blocks * kv_cache_manager.block_size if offloaded else 0
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed_tokens
                request.num_external_computed_tokens = num_tier_tokens
            if looked_up:
                kv_cache_manager.record_offload_lookup(request, num_tier_tokens)
            if self.log_stats:
                request.record_event(EngineCoreEventType.SCHEDULED, scheduled_timestamp)

        # Requests declined this pass go back in one operation, at the head of skipped_waiting.
        if step_skipped_waiting:
            self.skipped_waiting.prepend_requests(step_skipped_waiting)
        return token_budget

    def _admit_for_remote_kvs(self, request: Request, request_queue: RequestQueue, num_local_computed_tokens: int,
                              num_remote_tokens: int, new_computed_blocks: KVCacheBlocks, record_lookup: bool) -> bool:
        """Give a request whose prompt another engine computed the blocks its KV is read into (they
        enter the prefix cache once the data is there), and park it until then; False when the pool
        cannot take it (it keeps its place)."""
        kv_cache_manager = self.kv_cache_manager
        num_tokens = num_local_computed_tokens + num_remote_tokens
        passed: list = []
        if kv_cache_manager.groups:  # (the windowed groups read only the window of the first token computed here)
            new_computed_blocks, passed = kv_cache_manager.cut_group_hits(new_computed_blocks, num_tokens)
        if kv_cache_manager.allocate_slots(request, num_remote_tokens, num_local_computed_tokens, new_computed_blocks,
                                           delay_cache_blocks=True) is None:
            return False
        kv_cache_manager.keep_passed(passed)
        request_queue.pop_request()
        if record_lookup:
            kv_cache_manager.record_lookup(request, num_local_computed_tokens)
        assert self.connector is not None
        self.connector.update_state_after_alloc(
            request, kv_cache_manager.get_block_ids(request.request_id), num_local_computed_tokens, num_remote_tokens,
            kv_cache_manager.get_group_block_ids_from(request.request_id, num_tokens))
        request.num_computed_tokens = num_tokens
        request.num_cached_tokens = request.num_computed_tokens
        request.num_external_computed_tokens = num_remote_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        return True

    def on_remote_kvs_failed(self, request_id: str) -> None:
        """The remote KV could not be read: the request computes its prompt here (its blocks go back;
        it is admitted again as a new request, with no remote parameters left)."""
        request = self.requests.get(request_id)
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            return
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.num_cached_tokens = -1
        request.num_external_computed_tokens = 0
        request.status = _WAITING

    def _waiting_held_back_loras(self) -> set[int]:
        """The held-back adapters that still have a request waiting (an aborted one holds nothing)."""
        waiting = {r.lora_request.lora_int_id for queue in (self.waiting, self.skipped_waiting) for r in queue
                   if r.lora_request is not None}
        waiting |= {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        return self._held_back_loras & waiting

    def _select_waiting_queue_for_scheduling(self) -> RequestQueue:
        if self.policy == SchedulingPolicy.FCFS:
            # skipped_waiting is drained first: its requests' dependencies may have resolved.
            return self.skipped_waiting if self.skipped_waiting else self.waiting
        if not self.skipped_waiting:
            return self.waiting
        if not self.waiting:
            return self.skipped_waiting
        a, b = self.skipped_waiting.peek_request(), self.waiting.peek_request()
        return self.skipped_waiting if (a.priority, a.arrival_time) <= (b.priority, b.arrival_time) \
            else self.waiting

    def _can_never_fit(self, request: Request) -> bool:
        if request.num_tokens > self.max_model_len:
            return True
        # Blocks behind a window are released: a windowed group holds at most the window's keys and one
        # pass's tokens, plus a block where they straddle block edges (every group's, under the hybrid
        # KV cache manager).
        return blocks_held_bound(request.num_tokens, self.cache_config.group_windows,
                                 self.max_num_scheduled_tokens + self.num_lookahead_tokens,
                                 self.block_size) > self.cache_config.num_blocks

    def _preempt_request(self, request: Request, timestamp: float) -> None:
        """The state transition only: the caller has already taken the request out of running."""
        assert request.status == _RUNNING
        self.kv_cache_manager.free(request)
        if request.mm_features:
            self.encoder_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        # This one assignment is why a preempted request re-prefills when readmitted.
        request.num_computed_tokens = 0
        if request.spec_token_ids:
            request.spec_token_ids = []
        request.num_preemptions += 1
        self._num_preemptions += 1
        if self.log_stats:
            request.record_event(EngineCoreEventType.PREEMPTED, timestamp)
        # Leaving running involuntarily puts you at the front of waiting.
        self.waiting.prepend_request(request)

    # ------------------------------------------------------------------ encoder inputs (images)

    def _try_schedule_encoder_inputs(self, request: Request, num_computed_tokens: int, num_new_tokens: int,
                                     encoder_budget: int, first_chunk: bool = False) -> tuple[list[int], int, int, int]:
        """The images (indexes) the workers must encode for ``request``'s tokens
        [num_computed_tokens, + num_new_tokens), with the token count cut to stop before the first
        image that neither the pass's encoder budget nor the encoder cache can take (0 when the
        chunk starts inside it), and what is left of the budget. Images already cached (the same
        one in another prompt, or this one's earlier chunk) are not encoded again; those wholly
        before the chunk are in the KV cache already. Last, how many images the request meets for the
        first time in this chunk that were encoded already (the encoder cache's hits): those the chunk
        starts, and for an admission (``first_chunk``) also one its prefix-cache hit ends inside."""
        to_schedule: list[int] = []
        found = 0
        identifiers: set[str] = set()
        num_embeds = 0
        manager = self.encoder_cache_manager
        whole_images = self.scheduler_config.disable_chunked_mm_input
        for i, feature in enumerate(request.mm_features):
            if feature.offset >= num_computed_tokens + num_new_tokens:
                break  # (not reached by this chunk)
            if feature.end <= num_computed_tokens:
                continue  # (its rows are in the KV cache)
            if self.whole_images and num_computed_tokens + num_new_tokens < feature.end:
                # (the chunk would end inside the image: it stops before it, or waits for a pass that
                # takes the rest of it whole when it starts inside it)
                num_new_tokens = max(0, feature.offset - num_computed_tokens)
                break
            if feature.identifier in identifiers or manager.check_and_update_cache(request, i):
                # (encoded already, or by this pass for an earlier copy in the prompt)
                found += first_chunk or feature.offset >= num_computed_tokens
                continue
            if whole_images and num_computed_tokens < feature.offset < num_computed_tokens + num_new_tokens \
                    < feature.end:
                # (--disable-chunked-mm-input, after the cache checks as vLLM's: the chunk would end
                # inside an image still to encode; it stops before it)
                num_new_tokens = feature.offset - num_computed_tokens
                break
            if not manager.can_allocate(request, i, encoder_budget, num_embeds):
                num_new_tokens = max(0, feature.offset - num_computed_tokens)
                break
            num_embeds += feature.length
            encoder_budget -= feature.length
            identifiers.add(feature.identifier)
            to_schedule.append(i)
        return to_schedule, num_new_tokens, encoder_budget, found

    def _commit_encoder_inputs(self, request: Request, inputs: list[int], budget_left: int,
                               encoder_pass: _EncoderPass, found: int = 0) -> None:
        """``request`` is scheduled: its images' rows are reserved (encoded in this pass); ``found``
        images it meets were encoded already."""
        if found:
            encoder_pass.found[request.request_id] = found
        for i in inputs:
            self.encoder_cache_manager.allocate(request, i)
            feature = request.mm_features[i]
            encoder_pass.allocated[feature.identifier] = feature.length
        encoder_pass.budget = budget_left

    def _encoder_work(self, encoder_pass: _EncoderPass, num_scheduled_tokens: dict[str, int]) -> dict[str, list[int]]:
        """The images the workers encode in this pass, by the request (of the pass) that does it:
        each image reserved this pass is encoded by the first scheduled request holding it (the one
        that reserved it, or another whose chunk found it reserved). An image whose requests were all
        preempted later in the pass is forgotten: nobody may find it cached unencoded."""
        scheduled: dict[str, list[int]] = {}
        manager = self.encoder_cache_manager
        for identifier, rows in encoder_pass.allocated.items():
            holders = manager.cached.get(identifier) or ()
            owner = next((req_id for req_id in num_scheduled_tokens if req_id in holders), None)
            if owner is None:
                manager.forget(identifier, rows)
                continue
            index = next(i for i, f in enumerate(self.requests[owner].mm_features) if f.identifier == identifier)
            scheduled.setdefault(owner, []).append(index)
            self.num_images_encoded += 1
        # (A request preempted later in the pass met nothing: its chunk did not run.)
        self.num_images_found_encoded += sum(n for req_id, n in encoder_pass.found.items()
                                             if req_id in num_scheduled_tokens)
        return scheduled

    def _free_encoder_inputs(self, request: Request) -> None:
        """The images whose placeholders are all computed (in the KV cache) need no encoder rows:
        their holds go (the rows stay cached, freeable, for another prompt with the same image)."""
        manager = self.encoder_cache_manager
        for i in manager.get_cached_input_ids(request):
            if request.mm_features[i].end <= request.num_computed_tokens:
                manager.free_encoder_input(request, i)

    def _make_new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            group_block_ids=self.kv_cache_manager.get_group_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
            eos_token_id=request.eos_token_id,
            lora_request=request.lora_request,
            prompt_embeds=request.prompt_embeds,
            mm_features=request.mm_features,
        )

    def _make_cached_request_data(self, running_reqs: list[Request], resumed_reqs: list[Request],
                                  num_scheduled_tokens: dict[str, int],
                                  req_to_new_blocks: dict[str, KVCacheBlocks]) -> CachedRequestData:
        # Built with comprehensions: this runs over every running request on every pass.
        req_ids = [r.request_id for r in running_reqs]
        num_computed = [r.num_computed_tokens for r in running_reqs]
        new_token_ids = [r.all_token_ids[start:start + num_scheduled_tokens[req_id]]
                         for r, req_id, start in zip(running_reqs, req_ids, num_computed)]
        new_block_ids: list[list[int] | None] = [
            blocks.get_block_ids() if blocks.blocks else None
            for blocks in map(req_to_new_blocks.__getitem__, req_ids)]
        num_outputs = [len(r.output_token_ids) for r in running_reqs]
        resumed = [False] * len(req_ids)
        # (The hybrid KV cache manager's further groups: their blocks at the same positions.)
        new_group_block_ids: list[list[list[int]] | None] = [
            blocks.get_group_block_ids() if blocks.blocks else None
            for blocks in map(req_to_new_blocks.__getitem__, req_ids)] if self.kv_cache_manager.groups else []
        for request in resumed_reqs:
            req_ids.append(request.request_id)
            resumed.append(True)
            new_token_ids.append(list(request.all_token_ids))
            new_block_ids.append(self.kv_cache_manager.get_block_ids(request.request_id))
            if self.kv_cache_manager.groups:
                new_group_block_ids.append(self.kv_cache_manager.get_group_block_ids(request.request_id))
            num_computed.append(request.num_computed_tokens)
            num_outputs.append(len(request.output_token_ids))
        return CachedRequestData(req_ids, resumed, new_token_ids, new_block_ids, num_computed, num_outputs,
                                 new_group_block_ids)

    def _update_after_schedule(self, scheduler_output: SchedulerOutput, *scheduled: list[Request]) -> None:
        # num_computed_tokens advances now, for the tokens just scheduled: a second schedule()
        # without an update schedules the next chunks.
        num_scheduled_tokens = scheduler_output.num_scheduled_tokens
        drafts = scheduler_output.scheduled_spec_decode_tokens
        for requests in scheduled:
            for request in requests:
                start = request.num_computed_tokens
                request.num_computed_tokens += num_scheduled_tokens[request.request_id]
                if request.mm_features:
                    self._free_encoder_inputs(request)
                if self.keeps_recurrent_states:
                    # Its states kept at block boundaries the pass crosses, before its drafts (a state
                    # after a draft the pass may reject is no prefix's).
                    end = request.num_computed_tokens - len(drafts.get(request.request_id, ()))
                    self.kv_cache_manager.plan_state_saves(request, start, end)
        if self.keeps_recurrent_states:
            scheduler_output.recurrent_state_restores, scheduler_output.recurrent_state_saves = \
                self.kv_cache_manager.take_state_copies()
        self._num_steps += 1
        self._num_scheduled_tokens += scheduler_output.total_num_scheduled_tokens
        self._last_step_tokens = scheduler_output.total_num_scheduled_tokens

    # ------------------------------------------------------------------ update_from_output (second half)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> dict[int, EngineCoreOutputs]:
        sampled_token_ids = model_runner_output.sampled_token_ids
        logprobs = model_runner_output.logprobs
        prompt_logprobs = model_runner_output.prompt_logprobs
        req_id_to_index = model_runner_output.req_id_to_index
        pooler_output = model_runner_output.pooler_output
        outputs: dict[int, list[EngineCoreOutput]] = defaultdict(list)
        stopped_running_reqs: set[Request] = set()
        requests = self.requests
        max_model_len = self.max_model_len
        scheduled_spec_decode_tokens = scheduler_output.scheduled_spec_decode_tokens

        # Iterate what the first half wrote, not self.running.
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is None or request.status > _PREEMPTED:
                continue  # aborted or finished since it was scheduled
            # Identity is re-attached to the worker's rows here.
            req_index = req_id_to_index[req_id]
            new_token_ids = sampled_token_ids[req_index] if sampled_token_ids else []
            status_before_stop = request.status
            stopped = False
            if scheduled_spec_decode_tokens and new_token_ids:
                draft = scheduled_spec_decode_tokens.get(req_id)
                if draft:
                    # The first len(new_token_ids) - 1 drafts were accepted; the rest were computed
                    # for nothing, and are computed again (with the right tokens) next pass.
                    num_accepted = len(new_token_ids) - 1
                    if request.status == _RUNNING:
                        request.num_computed_tokens -= len(draft) - num_accepted
                    if self._spec_stats is not None:
                        self._spec_stats.observe_draft(len(draft), num_accepted)
            embedding = pooler_output.get(req_id) if pooler_output else None
            if embedding is not None:  # an embedding request ends with its prefill
                request.status = RequestStatus.FINISHED_STOPPED
                stopped = True
            elif new_token_ids:
                if len(new_token_ids) == 1:  # the common case: one token per pass, checked inline
                    request.append_output_token_ids(new_token_ids[0])
                    stopped = check_stop(request, max_model_len)
                else:
                    new_token_ids, stopped = self._update_request_with_output(request, new_token_ids)
            finish_reason, stop_reason = None, request.stop_reason
            if stopped:
                # Read the reason first: a continued session's status (and stop reason) is reset just below.
                finish_reason, stop_reason = request.get_finished_reason(), request.stop_reason
                # status_before_stop picks the collection: a request preempted since its pass was
                # scheduled (pipeline stages: a later pass preempted it while this one was in flight)
                # leaves waiting, not running; at once, before a resumable session's continuation
                # puts it back there.
                if status_before_stop == _RUNNING:
                    stopped_running_reqs.add(request)
                else:
                    self.waiting.remove_requests((request,))
                # Stopped is not finished: a resumable session goes back to waiting, blocks kept.
                if self._handle_stopped_request(request):
                    self._free_request(request)
            # A mid-prefill chunk produced no token: it emits nothing.
            if new_token_ids or stopped:
                req_logprobs = logprobs[req_index] if logprobs else None
                outputs[request.client_index].append(EngineCoreOutput(
                    req_id, new_token_ids, finish_reason, stop_reason, req_logprobs,
                    request.num_cached_tokens, prompt_logprobs.get(req_id) if prompt_logprobs else None,
                    embedding, request.kv_transfer_params_out if stopped else None))

        # Removal is batched after the loop: running is rebuilt once instead of scanned per request.
        if stopped_running_reqs:
            self.running = remove_all(self.running, stopped_running_reqs)

        self._finish_grammar_failures()
        for request in self._finished_outside_pass:
            outputs[request.client_index].append(EngineCoreOutput(
                request_id=request.request_id, new_token_ids=[],
                finish_reason=request.get_finished_reason(), stop_reason=request.stop_reason))
        self._finished_outside_pass.clear()

        engine_core_outputs = {client_index: EngineCoreOutputs(outputs=outs)
                               for client_index, outs in outputs.items()}
        if self.finished_req_ids_dict:
            for client_index, finished_set in self.finished_req_ids_dict.items():
                eco = engine_core_outputs.get(client_index)
                if eco is None:
                    eco = engine_core_outputs[client_index] = EngineCoreOutputs()
                eco.finished_requests = finished_set
            self.finished_req_ids_dict.clear()
        stats = self.make_stats()
        if stats is not None:
            # The stats describe the engine, not a client: attached to exactly one entry.
            eco = next(iter(engine_core_outputs.values()), None)
            if eco is None:
                eco = engine_core_outputs[0] = EngineCoreOutputs()
            eco.scheduler_stats = stats
        return engine_core_outputs

    def _update_request_with_output(self, request: Request,
                                    new_token_ids: list[int]) -> tuple[list[int], bool]:
        """Append tokens one by one, checking stop after each; tokens after a stop are trimmed."""
        max_model_len = self.max_model_len
        for num_new, token_id in enumerate(new_token_ids, 1):
            request.append_output_token_ids(token_id)
            if check_stop(request, max_model_len):
                if num_new < len(new_token_ids):
                    # Accepted drafts after the stop are dropped: what counts as computed ends before
                    # the last token again (a streaming session continues from there).
                    request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
                    return new_token_ids[:num_new], True
                return new_token_ids, True
        return new_token_ids, False

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Give running requests the drafts the next pass verifies (speculative decoding)."""
        requests = self.requests
        for req_id, draft in draft_token_ids.items():
            request = requests.get(req_id)
            if request is not None and request.status == _RUNNING:
                request.spec_token_ids = draft[:self.num_spec_tokens]

    def _handle_stopped_request(self, request: Request) -> bool:
        """True when the request is done with; False for a streaming session that continues."""
        queue = request.streaming_queue
        if queue is None:
            return True
        if queue:
            update = queue.popleft()
            if update is None:
                return True  # a non-resumable continuation closed the session
            self._continue_session(request, update)
            request.status = _WAITING
            self.waiting.add_request(request)
        else:
            request.status = RequestStatus.WAITING_FOR_STREAMING_REQ
            self.num_waiting_for_streaming_input += 1
            self.skipped_waiting.add_request(request)
        return False

    def _continue_session(self, request: Request, update: StreamingUpdate) -> None:
        """A streaming session's next chunk. A LongRoPE model whose session now outgrows the
        pretrained length recomputes the whole of it (its KV was rotated with the short factors,
        which the prompt no longer takes), from blocks keyed as a long prompt's."""
        after = self.kv_cache_manager.long_rope_after
        was_short = after is not None and request.num_prompt_tokens <= after
        request.apply_streaming_update(update)
        if was_short and request.num_prompt_tokens > after:
            self.kv_cache_manager.free(request)
            request.block_hashes = []
            request.num_computed_tokens = 0

    def _free_request(self, request: Request) -> None:
        held = None
        if self.connector is not None and request.kv_transfer_params is not None:
            # A prefill for another engine keeps its blocks until that engine has read them.
            held = self.connector.request_finished(request, self.kv_cache_manager.get_block_ids(request.request_id),
                                                   self.kv_cache_manager.get_held_group_block_ids(request.request_id))
        if held is None:
            self.kv_cache_manager.free(request)
        else:
            request.kv_transfer_params_out = held
        if request.mm_features:
            self.encoder_cache_manager.free(request)
        del self.requests[request.request_id]
        if request.lora_request is not None:
            key = request.lora_request.cache_key
            count = self.lora_request_counts.pop(key, 0)
            if count > 1:
                self.lora_request_counts[key] = count - 1
            else:
                self.lora_adapters_version += 1
        self.finished_req_ids.add(request.request_id)
        if self.finished_req_ids_dict is not None:
            self.finished_req_ids_dict[request.client_index].add(request.request_id)

    def _finish_outside_pass(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self._free_request(request)
        self._finished_outside_pass.append(request)

    def _finish_grammar_failures(self) -> None:
        if not self._grammar_failures:
            return
        failures, self._grammar_failures = self._grammar_failures, {}
        for request_id, message in failures.items():
            request = self.requests.get(request_id)
            if request is None or request.is_finished():
                continue
            self._remove_from_collections([request])
            request.stop_reason = message
            self._finish_outside_pass(request, RequestStatus.FINISHED_ERROR)

    # ------------------------------------------------------------------ finishing, pausing, stats

    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus,
                        tell_clients: bool = False) -> None:
        """Finish requests from outside a pass (a client's abort: it knows, so by default nothing is
        sent; ``tell_clients``: each gets a final output, for an abort another client asked for)."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finished_status must be a FINISHED_* status, got {finished_status!r}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        to_finish = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished():
                to_finish.append(request)
        if not to_finish:
            return
        self._remove_from_collections(to_finish)
        for request in to_finish:
            if tell_clients:
                self._finish_outside_pass(request, finished_status)
                continue
            request.status = finished_status
            # Blocks go back to the pool; the id reaches the workers in the next finished_req_ids.
            self._free_request(request)

    def _remove_from_collections(self, requests: list[Request]) -> None:
        running = {r for r in requests if r.status == _RUNNING}
        queued = {r for r in requests if r.status != _RUNNING}
        if running:
            self.running = remove_all(self.running, running)
        if queued:
            self.waiting.remove_requests(queued)
            self.skipped_waiting.remove_requests(queued)
            self.num_waiting_for_streaming_input -= sum(
                1 for r in queued if r.status == RequestStatus.WAITING_FOR_STREAMING_REQ)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._finished_outside_pass) or bool(self._grammar_failures)

    def has_finished_requests(self) -> bool:
        return bool(self.finished_req_ids)

    def reset_prefix_cache(self) -> bool:
        # (Encoded images nobody holds go too: after new weights their rows would be stale.)
        self.encoder_cache_manager.evict_freeable()
        return self.kv_cache_manager.reset_prefix_cache()

    def abort_all_requests(self) -> list[str]:
        """Finish every live request as aborted, each with a final output that tells its client
        (the engine ends them itself, as a pause does; a client's own abort needs none)."""
        live = [request for request in self.requests.values() if not request.is_finished()]
        self._remove_from_collections(live)
        for request in live:
            self._finish_outside_pass(request, RequestStatus.FINISHED_ABORTED)
        return [request.request_id for request in live]

    @property
    def pause_state(self) -> PauseState:
        return self._pause_state

    def pause(self, mode: PauseState = PauseState.PAUSED_NEW) -> None:
        self._pause_state = PauseState(mode)

    def resume(self) -> None:
        self._pause_state = PauseState.UNPAUSED

    def make_stats(self) -> SchedulerStats | None:
        if not self.log_stats:
            return None
        pool = self.kv_cache_manager.block_pool
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            # Gauges: waiting excludes skipped_waiting, which is reported on its own.
            num_waiting_reqs=len(self.waiting),
            num_skipped_waiting_reqs=len(self.skipped_waiting),
            num_waiting_for_streaming_input=self.num_waiting_for_streaming_input,
            kv_cache_usage=pool.get_usage(),
            num_free_blocks=pool.get_num_free_blocks(),
            num_total_blocks=pool.num_blocks,
            prefix_cache_stats=self.kv_cache_manager.make_prefix_cache_stats(),
            num_preemptions=self._num_preemptions,
            num_scheduled_tokens=self._num_scheduled_tokens,
            num_steps=self._num_steps,
            step_num_scheduled_tokens=self._last_step_tokens,
            step_token_budget=self._last_step_budget,
            spec_decoding_stats=self._spec_stats,
        )
        if pool.residency is not None:
            stats.kv_block_residency = pool.residency.drain() or None
        offload = self.kv_cache_manager.offload
        if offload is not None:
            moved = offload.take_stats()
            stats.kv_offload_stored_blocks, stats.kv_offload_loaded_blocks = moved.stored_blocks, moved.loaded_blocks
            stats.kv_offload_num_blocks = len(offload)
            stats.connector_prefix_cache_stats = self.kv_cache_manager.make_connector_prefix_cache_stats()
        states = self.kv_cache_manager.recurrent_states
        if states is not None:
            kept = states.take_stats()
            stats.recurrent_states_saved, stats.recurrent_states_restored = kept.saved, kept.restored
            stats.recurrent_states_evicted, stats.recurrent_states_skipped = kept.evicted, kept.skipped
        if self.max_loras:
            stats.running_lora_adapters = _count_adapters(self.running)
            stats.waiting_lora_adapters = _count_adapters([*self.waiting, *self.skipped_waiting])
        if self._spec_stats is not None:
            self._spec_stats = SpecDecodingStats(self.num_spec_tokens,
                                                 num_accepted_tokens_per_pos=[0] * self.num_spec_tokens)
        # Counters are deltas: start counting afresh.
        self._num_preemptions = 0
        self._num_scheduled_tokens = 0
        self._num_steps = 0
        return stats
