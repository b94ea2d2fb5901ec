"""The model runner's memory of each request across steps, kept in step with SchedulerOutput diffs."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine_core.multimodal import MultiModalFeature
from engine_core.sampling_params import SamplingParams
from engine_core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from gpu_worker.block_table import BlockTable


@dataclass(slots=True)
class RequestState:
    req_id: str
    # Prompt, then every output token known so far (sampled here or sent by the scheduler).
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    # Its KV blocks: how many, and its row of RequestStates.block_table, which holds their ids.
    num_blocks: int
    table_row: int
    num_computed_tokens: int
    generator: torch.Generator | None
    # Tokens forbidden while the request is short of min_tokens: the EOS ids (under ignore_eos too) + stop ids.
    min_tokens_stop_ids: tuple[int, ...]
    # Prompt logprobs gathered chunk by chunk until the prefill ends (then sent once).
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_ranks: list[int] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # Draft tokens (speculative decoding) at the end of token_ids that the pass which computed them
    # did not resolve on this rank (ranks other than 0 never learn which were kept).
    num_draft_tokens: int = 0
    # The last pass that verified drafts for it, on every rank of a model with recurrent layers (set by
    # the model runner): (tokens computed before its drafts,
    # tokens computed after it). Its recurrent states then cover all of them; the next update puts
    # them back to the scheduler's count where that is less (rejected drafts, or a stop among the
    # accepted ones): RequestStates.rejected_drafts.
    verified_drafts: tuple[int, int] | None = None
    # allowed_token_ids as a [vocab] mask, and logit_bias as (ids, biases): built at the first step
    # that samples the request (on the runner's device), reused by every later one.
    allowed_mask: torch.Tensor | None = None
    logit_bias_tensors: tuple[torch.Tensor, torch.Tensor] | None = None
    # The LoRA adapter applied to this request's tokens (0: the base model).
    lora_int_id: int = 0
    # An embedding pooled over its prompt's chunks (SamplingParams.embed_pooling): MEAN's running
    # sum of hidden states, or CLS's first one (fp32, [hidden_size]); ALL / STEP's rows, chunk by
    # chunk (fp32 [tokens kept, row values] each, on TP rank 0 only).
    pooled: torch.Tensor | None = None
    pooled_rows: list[torch.Tensor] = field(default_factory=list)
    # A prompt given as embeddings ([num_prompt_tokens, hidden] in the model's dtype, in host memory,
    # page-locked beside a GPU): each pass copies the rows it runs where token_ids holds placeholders.
    prompt_embeds: torch.Tensor | None = None
    # A prompt's images (in prompt order): where their placeholders sit, and their encoder inputs
    # (the runner encodes those the scheduler names, and keeps the rows by identifier).
    mm_features: list[MultiModalFeature] | None = None
    # M-RoPE (Qwen2-VL) with images: the prompt's [3, prompt] positions and the shift of those past it.
    mrope: tuple[np.ndarray, int] | None = None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return (self.sampling_params.prompt_logprobs is not None and not self.prompt_logprobs_sent
                and self.num_computed_tokens < self.num_prompt_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


class RequestStateAtDraft:
    """A request's state as one of its draft rows sees it (speculative decoding): the tokens before
    that row's position only. Penalties and bad words look at the tokens before the one drawn at a
    row, and a row after draft j must not see drafts j + 1 on. Everything else is the state's own
    (what is set goes to the state: the per-request caches such as ``allowed_mask``)."""

    __slots__ = ("_num_tokens", "_state")

    def __init__(self, state: RequestState, num_tokens: int) -> None:
        object.__setattr__(self, "_state", state)
        object.__setattr__(self, "_num_tokens", num_tokens)

    def __getattr__(self, name: str):
        return getattr(self._state, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._state, name, value)

    @property
    def token_ids(self) -> list[int]:
        return self._state.token_ids[:self._num_tokens]

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def num_output_tokens(self) -> int:
        return self._num_tokens - self._state.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self._state.token_ids[self._state.num_prompt_tokens:self._num_tokens]


def reads_earlier_tokens(params: SamplingParams) -> bool:
    """Whether a request's next-token distribution depends on the tokens before it (penalties, bad
    words): its draft rows each see only the tokens before them (``RequestStateAtDraft``)."""
    return (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
            or bool(params.bad_words_token_ids))


@dataclass(slots=True)
class _Parked:
    """What a preempted request keeps: the scheduler resends tokens and blocks on resumption, but
    not its sampling parameters, and a seeded request must continue its random stream."""

    sampling_params: SamplingParams
    generator: torch.Generator | None
    min_tokens_stop_ids: tuple[int, ...]
    prompt_logprobs_sent: bool
    lora_int_id: int
    prompt_embeds: torch.Tensor | None
    mm_features: list[MultiModalFeature] | None


class RequestStates:
    def __init__(self, eos_token_ids: tuple[int, ...], device: torch.device,
                 dtype: torch.dtype = torch.float32) -> None:
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.dtype = dtype  # (the model's: prompt embeddings are kept in it)
        self.states: dict[str, RequestState] = {}
        self._parked: dict[str, _Parked] = {}
        # Embedding requests held (SamplingParams.embed): a pass looks for them only while there are some.
        self.embedding_ids: set[str] = set()
        # The block ids of every held request (a row each); parked requests hold none.
        self.block_table = BlockTable()
        # Under the hybrid KV cache manager, each KV cache group's after group 0 (block_table's), in its rows.
        self.group_tables: list[BlockTable] = []
        # Held requests whose last verifying pass computed tokens the scheduler did not keep (drafts it
        # rejected, or accepted drafts after a stop), as this update says: table row -> the drafts kept
        # (the model runner puts their recurrent states back to after those).
        self.rejected_drafts: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, req_id: str) -> RequestState:
        return self.states[req_id]

    def _make_generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None:
            return None
        gen = torch.Generator(device=self.device)
        gen.manual_seed(params.seed)
        return gen

    def _stop_ids(self, params: SamplingParams, request_eos: int | None = None) -> tuple[int, ...]:
        """What min_tokens keeps out of a request's first tokens: its stop ids and the EOS ids, the
        latter under ignore_eos too (as vLLM's min-tokens processor masks all of its stop ids)."""
        if params.min_tokens <= 0:
            return ()
        eos = (*self.eos_token_ids, *(() if request_eos is None else (request_eos,)))
        return tuple(dict.fromkeys((*eos, *params.stop_token_ids)))

    def _drop(self, req_id: str) -> RequestState | None:
        state = self.states.pop(req_id, None)
        if state is not None:
            self.block_table.free(state.table_row)
        return state

    def _hold(self, state: RequestState, block_ids: list[int], group_block_ids: list[list[int]]) -> None:
        """Hold ``state``, its blocks in a row of the table (and the hybrid KV cache manager's further
        groups' blocks in that row of theirs). One replacing a held request of the same
        id (a streaming session's next turn) keeps its row: a Mamba-2 layer's state for the tokens
        computed so far lives in that row of its state tensors (gpu_worker.layers.mamba; the other
        recurrent layers' likewise)."""
        held = self.states.pop(state.req_id, None)
        if held is None:
            state.table_row = self.block_table.add(block_ids)
        else:
            if held.verified_drafts is not None:  # (its last turn ended in a verifying pass)
                self._note_rejected_drafts(held, state.num_computed_tokens)
            state.table_row = held.table_row
            self.block_table.table[held.table_row] = 0
            self.block_table.write(held.table_row, 0, block_ids)
        self.states[state.req_id] = state
        while len(self.group_tables) < len(group_block_ids):
            self.group_tables.append(BlockTable())
        for table, ids in zip(self.group_tables, group_block_ids, strict=False):
            table.put(state.table_row, ids)

    def _note_rejected_drafts(self, state: RequestState, kept: int) -> None:
        """``state``'s last pass verified drafts, and the scheduler keeps ``kept`` of its tokens
        computed: where that is fewer than the pass computed, its recurrent states go back to after
        the drafts kept (rejected_drafts). (Fewer than the tokens before the drafts: a session's turn
        computed again from the start, or from a state the prefix cache restores, writes the row anew.)"""
        before, after = state.verified_drafts
        state.verified_drafts = None
        if before <= kept < after:
            self.rejected_drafts[state.table_row] = kept - before

    def update(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self._drop(req_id)
            self._parked.pop(req_id, None)
            self.embedding_ids.discard(req_id)
        for req_id in so.preempted_req_ids:
            self.embedding_ids.discard(req_id)
            state = self._drop(req_id)
            if state is not None:
                self._parked[req_id] = _Parked(state.sampling_params, state.generator, state.min_tokens_stop_ids,
                                               state.prompt_logprobs_sent, state.lora_int_id, state.prompt_embeds,
                                               state.mm_features)
        for new in so.scheduled_new_reqs:
            self._add_new(new)
        self._apply_cached(so.scheduled_cached_reqs)

    def _add_new(self, new: NewRequestData) -> None:
        # A new request (or a continued streaming session) replaces whatever we held for its id.
        self._parked.pop(new.req_id, None)
        params = new.sampling_params
        # Outputs a continued session already generated are the tail of prompt_token_ids.
        num_outputs = len(new.output_token_ids)
        if params.embed:
            self.embedding_ids.add(new.req_id)
        self._hold(RequestState(
            req_id=new.req_id, token_ids=list(new.prompt_token_ids),
            num_prompt_tokens=len(new.prompt_token_ids) - num_outputs, sampling_params=params,
            num_blocks=len(new.block_ids), table_row=-1, num_computed_tokens=new.num_computed_tokens,
            generator=self._make_generator(params), min_tokens_stop_ids=self._stop_ids(params, new.eos_token_id),
            lora_int_id=new.lora_request.lora_int_id if new.lora_request is not None else 0,
            prompt_embeds=None if new.prompt_embeds is None else self._host_rows(new.prompt_embeds.to_tensor()),
            mm_features=new.mm_features), list(new.block_ids), new.group_block_ids)

    def _host_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Prompt embeddings kept off the device (they are not in its memory budget): in the model's
        dtype, page-locked beside a GPU so a pass's slice copies without staging."""
        rows = rows.to(self.dtype)
        return rows.pin_memory() if self.device.type == "cuda" else rows

    def _apply_cached(self, cached: CachedRequestData) -> None:
        for i, req_id in enumerate(cached.req_ids):
            start = cached.num_computed_tokens[i]
            tokens = cached.new_token_ids[i]
            blocks = cached.new_block_ids[i]
            if cached.resumed_from_preemption[i]:
                parked = self._parked.pop(req_id, None) or self.states.get(req_id)
                if parked is None:
                    raise KeyError(f"resumed request {req_id!r} was never seen by this worker")
                params = parked.sampling_params
                if params.embed:
                    self.embedding_ids.add(req_id)
                block_ids = list(blocks or ())
                self._hold(RequestState(
                    req_id=req_id, token_ids=list(tokens),
                    num_prompt_tokens=len(tokens) - cached.num_output_tokens[i], sampling_params=params,
                    num_blocks=len(block_ids), table_row=-1, num_computed_tokens=start, generator=parked.generator,
                    min_tokens_stop_ids=parked.min_tokens_stop_ids,
                    # Resumed after its prompt logprobs went out: recomputing the prompt sends nothing.
                    prompt_logprobs_sent=parked.prompt_logprobs_sent, lora_int_id=parked.lora_int_id,
                    prompt_embeds=parked.prompt_embeds, mm_features=parked.mm_features), block_ids,
                    (cached.new_group_block_ids[i] or []) if cached.new_group_block_ids else [])
                continue
            state = self.states.get(req_id)
            if state is None:
                raise KeyError(f"cached request {req_id!r} is unknown to this worker")
            if start > len(state.token_ids):
                raise ValueError(f"request {req_id!r}: scheduled tokens start at {start} but only "
                                 f"{len(state.token_ids)} tokens are known")
            if state.verified_drafts is not None:
                self._note_rejected_drafts(state, start)
            if state.num_draft_tokens:
                # Drafts of the last pass: those before ``start`` were accepted; the rest are stale.
                del state.token_ids[start:]
                state.num_draft_tokens = 0
            # The scheduler's tokens are authoritative (a sampled token we remembered is resent).
            state.token_ids[start:start + len(tokens)] = tokens
            state.num_computed_tokens = start
            if blocks:
                self.block_table.write(state.table_row, state.num_blocks, blocks)
                if cached.new_group_block_ids:
                    for table, group_blocks in zip(self.group_tables, cached.new_group_block_ids[i] or (), strict=True):
                        table.write(state.table_row, state.num_blocks, group_blocks)
                state.num_blocks += len(blocks)
