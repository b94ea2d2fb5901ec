"""Types that cross the router <-> engine and worker -> engine boundaries.

Router -> engine: ``EngineCoreRequest``. Engine -> router: ``EngineCoreOutputs`` per client_index.
Worker rank 0 -> engine: ``ModelRunnerOutput``. All are msgspec structs: cheap to build on the
per-step hot path and cheap to pickle across Ray actor calls.
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine_core.multimodal import MultiModalFeature
from engine_core.prompt_embeds import PromptEmbeds
from engine_core.request import FinishReason
from engine_core.sampling_params import SamplingParams


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    """A LoRA adapter as requests name it (vLLM's ``LoRARequest``): its name (what clients put in
    ``model``), its id (what the scheduler and the workers key on; 0 is the base model) and the
    directory of its PEFT checkpoint."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    @property
    def cache_key(self) -> tuple[int, str]:
        """What keys the prefix-cache blocks computed under this adapter (engine and router alike)."""
        return (self.lora_int_id, self.lora_name)

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1 (0 is the base model), got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")


class EngineCoreRequest(msgspec.Struct, kw_only=True):
    """A tokenised request as the router hands it to an engine."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float | None = None
    priority: int = 0
    client_index: int = 0
    resumable: bool = False
    cache_salt: str | None = None
    # The LoRA adapter to run under; None: the base model.
    lora_request: LoRARequest | None = None
    # A prompt given as embeddings (--enable-prompt-embeds): prompt_token_ids are as many placeholders.
    prompt_embeds: PromptEmbeds | None = None
    # A prompt's images (vision-language models): placeholders' positions and encoder inputs, in order.
    mm_features: list[MultiModalFeature] | None = None
    # The client request's choices (its n) on its first choice, 0 on the others: the metrics observe
    # a request's parameters once, as vLLM's do per parent request.
    num_choices: int = 1
    # Prefill/decode disaggregation, vLLM's parameters (engine_core.kv_transfer).
    kv_transfer_params: dict[str, Any] | None = None


class LogprobsEntry(msgspec.Struct, array_like=True, gc=False):
    """Logprob of each sampled token of a request, plus the top-N alternatives for it."""

    sampled_logprobs: list[float]
    # One list per sampled token: (token_id, logprob) pairs, best first.
    top_logprobs: list[list[tuple[int, float]]]
    # Each sampled (or scored prompt) token's rank in the model's distribution, 1 = the most likely
    # (vLLM's Logprob.rank); None from senders that do not compute it.
    ranks: list[int] | None = None

    def ranked(self, token_ids: list[int], k: int | None = None) -> list[list[tuple[int, float, int | None]]]:
        """vLLM's {token id: Logprob} rows as (token, logprob, rank) triples: per token, the token
        itself first, then its (at most ``k``) best alternatives not already listed, ranked 1..k."""
        rows = []
        for i, tid in enumerate(token_ids[:len(self.sampled_logprobs)]):
            row = [(tid, self.sampled_logprobs[i], self.ranks[i] if self.ranks else None)]
            row += [(alt, lp, position) for position, (alt, lp) in enumerate(self.top_logprobs[i][:k], start=1)
                    if alt != tid]
            rows.append(row)
        return rows


class ModelRunnerOutput(msgspec.Struct, array_like=True):
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # One list per request, [] for a request whose prefill is still incomplete.
    sampled_token_ids: list[list[int]]
    # Aligned with req_ids; None where the request asked for no logprobs.
    logprobs: list[LogprobsEntry | None] | None = None
    # Complete prompt logprobs of requests whose prefill finished this step (positions 1..n-1).
    prompt_logprobs: dict[str, LogprobsEntry] | None = None
    # The embeddings of embedding requests (SamplingParams.embed) whose prefill finished this step.
    pooler_output: dict[str, list[float]] | None = None
    # A draft model's proposals (speculative decoding, method draft_model) for the requests that
    # sampled this step, to verify next step.
    draft_token_ids: dict[str, list[int]] | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    new_logprobs: LogprobsEntry | None = None
    # Prompt tokens this request found in the prefix cache when first admitted.
    num_cached_tokens: int = 0
    # With the first output of a request that asked for them: the prompt's logprobs, positions 1..n-1.
    new_prompt_logprobs: LogprobsEntry | None = None
    # An embedding request's embedding, with its (only, finishing) output.
    pooling_output: list[float] | None = None
    # A finished prefill for another engine: the parameters that name its held KV blocks.
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class PrefixCacheStats(msgspec.Struct):
    """Deltas since the previous ``make_stats()``: requests looked up, tokens queried, tokens hit."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    # Re-admissions after preemption are counted apart so they do not inflate the hit rate.
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class SpecDecodingStats(msgspec.Struct):
    """Speculative decoding since the previous make_stats() (counters, as vLLM's)."""

    num_spec_tokens: int = 0
    # Requests whose drafts a pass verified, the draft tokens verified, and those accepted.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [num_spec_tokens]: accepted drafts at each draft position (position 0 = the first draft token).
    num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1


class SchedulerStats(msgspec.Struct):
    # Gauges: instantaneous at make_stats() time.
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_skipped_waiting_reqs: int = 0
    num_waiting_for_streaming_input: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    # Counters: deltas since the previous make_stats().
    prefix_cache_stats: PrefixCacheStats = msgspec.field(default_factory=PrefixCacheStats)
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0
    num_steps: int = 0
    # The last pass: tokens scheduled out of the budget it started with.
    step_num_scheduled_tokens: int = 0
    step_token_budget: int = 0
    # Present when the engine drafts (speculative decoding).
    spec_decoding_stats: SpecDecodingStats | None = None
    # With LoRA on: requests per adapter name, running and waiting (vLLM's lora_requests_info).
    running_lora_adapters: dict[str, int] | None = None
    waiting_lora_adapters: dict[str, int] | None = None
    # With --kv-cache-metrics: the followed blocks evicted since the last stats, each (lifetime s,
    # idle before eviction s, gaps between its reuses s).
    kv_block_residency: list[tuple[float, float, list[float]]] | None = None
    # With KV offloading (--kv-offloading-size): blocks saved to the host-memory tier and loaded
    # back from it since the previous stats, and the blocks it holds now.
    kv_offload_stored_blocks: int = 0
    kv_offload_loaded_blocks: int = 0
    kv_offload_num_blocks: int = 0
    # With KV offloading: its tier's lookups since the previous stats (vLLM's name: its offloading is
    # a KV connector's), counted as prefix_cache_stats is.
    connector_prefix_cache_stats: PrefixCacheStats | None = None
    # With recurrent layers' states kept for the prefix cache (--mamba-cache-mode align), since the
    # previous stats: states kept (copied into a slot), requests started from one, kept states whose
    # slot a newer one took, and states not kept (every slot was its pass's).
    recurrent_states_saved: int = 0
    recurrent_states_restored: int = 0
    recurrent_states_evicted: int = 0
    recurrent_states_skipped: int = 0


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    # Ids finished since the last send, so a client learns of a finish even with no token this pass.
    finished_requests: set[str] | None = None
    scheduler_stats: SchedulerStats | None = None
    engine_index: int = 0
    timestamp: float = 0.0
    # KV cache events since the last frame, for clients that asked for them (prefix-aware routers):
    # (kind, block hashes) in order, kinds as in engine_core.core.block_pool (stored, removed, cleared).
    kv_events: list[tuple[int, list[bytes]]] | None = None
    # The LoRA adapters (id, name) the engine's requests, running or waiting, are under, sent to
    # every client when they change (and to a client when it connects): routers keep an adapter on
    # the engines running it, whichever router sent its requests. None: unchanged.
    lora_adapters: list[tuple[int, str]] | None = None


class EngineStats(msgspec.Struct, kw_only=True):
    """An engine's report (``get_stats``): the flags in effect, the pool, and totals since start."""

    engine_index: int
    healthy: bool
    scheduler_config: dict[str, Any]
    num_blocks: int
    block_size: int
    last: SchedulerStats
    num_steps: int = 0
    num_free_blocks: int = 0
    num_unfinished_requests: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_requests_added: int = 0
    num_requests_finished: int = 0
    max_step_num_scheduled_tokens: int = 0
    # Speculative decoding since start: passes that verified a request's drafts, drafts, accepted.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    # KV offloading since start: blocks saved to the host-memory tier, blocks loaded back (prompt
    # blocks that skipped their compute), and the tier's size in blocks.
    kv_offload_stored_blocks: int = 0
    kv_offload_loaded_blocks: int = 0
    num_offload_blocks: int = 0
    # KV offloading's tier since start: tokens looked up there, tokens found (vLLM's external prefix cache).
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    # Recurrent layers' kept states (--mamba-cache-mode align) since start: kept, restored, evicted,
    # not kept (SchedulerStats'); the slots, and the states kept now.
    recurrent_states_saved: int = 0
    recurrent_states_restored: int = 0
    recurrent_states_evicted: int = 0
    recurrent_states_skipped: int = 0
    num_recurrent_state_slots: int = 0
    recurrent_states_held: int = 0
    # Prefill/decode disaggregation since start: KV blocks other engines read from here, blocks read
    # from other engines, reads that failed; and the prefills holding blocks for a reader now.
    kv_transfer_sent_blocks: int = 0
    kv_transfer_received_blocks: int = 0
    kv_transfer_failures: int = 0
    kv_transfer_held_requests: int = 0
    # Producers' parameters this engine declined (the prompt computed here after all, or the request
    # gone before it read them): each producer was told to free the blocks.
    kv_transfer_declined: int = 0
    # Requests refused since start because the waiting queue was full (--max-waiting-requests).
    num_requests_refused_full: int = 0
    # A vision-language model's images since start: encoded by the workers, and found encoded
    # already (the encoder cache's hits).
    num_images_encoded: int = 0
    num_images_found_encoded: int = 0
    # The share of the encoder cache's rows holding encoded images (0 for a text model).
    encoder_cache_usage: float = 0.0
