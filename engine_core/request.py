"""The engine's view of one request: its tokens, its progress and where it is in its life."""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine_core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine_core.multimodal import MultiModalFeature
    from engine_core.outputs import LoRARequest
    from engine_core.prompt_embeds import PromptEmbeds


class RequestStatus(enum.IntEnum):
    # Seed order. Everything after PREEMPTED is a finished state.
    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


# The three statuses the enqueue helper routes to skipped_waiting: the request cannot be looked at yet.
BLOCKED_WAITING_STATUSES = frozenset({
    RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
    RequestStatus.WAITING_FOR_REMOTE_KVS,
    RequestStatus.WAITING_FOR_STREAMING_REQ,
})


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class EngineCoreEventType(enum.IntEnum):
    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


@dataclass(frozen=True)
class StreamingUpdate:
    """The next input chunk of a streaming-input session (a repeat ``add_request`` of a live id)."""

    prompt_token_ids: list[int]
    sampling_params: SamplingParams

    @classmethod
    def from_request(cls, request: Request) -> StreamingUpdate | None:
        # A non-resumable continuation carries no update: it ends the session.
        if not request.resumable:
            return None
        return cls(list(request.prompt_token_ids), request.sampling_params)


class Request:
    __slots__ = (
        "all_token_ids",
        "arrival_time",
        "block_hashes",
        "cache_salt",
        "client_index",
        "eos_token_id",
        "events",
        "kv_transfer_params",
        "kv_transfer_params_out",
        "lora_request",
        "mm_features",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_external_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "output_token_ids",
        "priority",
        "prompt_embeds",
        "prompt_token_ids",
        "request_id",
        "resumable",
        "sampling_params",
        "spec_token_ids",
        "status",
        "stop_reason",
        "streaming_queue",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        client_index: int = 0,
        resumable: bool = False,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        prompt_embeds: PromptEmbeds | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        mm_features: list[MultiModalFeature] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.client_index = client_index
        self.resumable = resumable
        self.cache_salt = cache_salt
        # The LoRA adapter this request runs under (None: the base model).
        self.lora_request = lora_request
        # A prompt given as embeddings (its token ids are placeholders); they key its KV blocks.
        self.prompt_embeds = prompt_embeds
        # A prompt's images (in prompt order; None: none): the scheduler has the workers encode each
        # when a chunk first reaches its placeholders; their identifiers key the KV blocks they reach.
        self.mm_features = mm_features or None
        # Prefill/decode disaggregation (engine_core.kv_transfer): do_remote_decode on a prefill for
        # another engine; do_remote_prefill and the producer's blocks on the decode engine's request
        # (cleared once its load is planned). And what a finished prefill answers with.
        self.kv_transfer_params = kv_transfer_params
        self.kv_transfer_params_out: dict[str, Any] | None = None
        self.num_prompt_tokens = len(self.prompt_token_ids)
        # Plain attributes (hot path): callers must not mutate them; use append_output_token_ids.
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Draft tokens (speculative decoding) the next pass verifies after the last known token.
        self.spec_token_ids: list[int] = []
        # Prompt tokens found in the prefix cache at first admission (-1: not admitted yet), and how
        # many of them KV offloading's host tier supplied (vLLM's external tokens).
        self.num_cached_tokens = -1
        self.num_external_computed_tokens = 0
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.streaming_queue: deque[StreamingUpdate | None] | None = None
        # Chained hashes of this request's full blocks, extended lazily by the KV cache manager.
        self.block_hashes: list[bytes] = []
        self.events: list[tuple[EngineCoreEventType, float]] = []
        # The constructor, not the scheduler, blocks a structured-output request on its grammar.
        if sampling_params.structured_output is not None:
            self.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
        else:
            self.status = RequestStatus.WAITING

    @property
    def lora_key(self) -> tuple[int, str] | None:
        """(id, name) of the request's adapter, which keys its prefix-cache blocks; None for the base model."""
        return None if self.lora_request is None else self.lora_request.cache_key

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    def append_output_token_ids(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def trim_output_tokens(self, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` outputs (tokens sampled after a stop)."""
        if num_tokens > 0:
            del self.output_token_ids[-num_tokens:]
            del self.all_token_ids[-num_tokens:]

    def apply_streaming_update(self, update: StreamingUpdate) -> None:
        """Continue a session: what was generated so far becomes prompt, the update's tokens follow."""
        self.prompt_token_ids = self.all_token_ids + list(update.prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)
        self.output_token_ids = []
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.sampling_params = update.sampling_params
        self.stop_reason = None

    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def get_finished_reason(self) -> FinishReason | None:
        return _FINISHED_REASONS.get(self.status)

    def record_event(self, event_type: EngineCoreEventType, timestamp: float | None = None) -> None:
        self.events.append((event_type, time.time() if timestamp is None else timestamp))


    def __repr__(self) -> str:
        return (f"Request(id={self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
