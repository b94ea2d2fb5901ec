"""Speculative decoding with a draft model (vLLM's ``draft_model`` method): a smaller model of the
same vocabulary proposes the next tokens, which the target verifies in its next pass.

The draft runs on the target's workers, sharded as the target is, with a KV cache of its own laid
out on the target's block table (the same block ids, its own tensors). Each step:

1. **Mirror**: the draft computes the same tokens at the same positions as the target's pass, so
   its cache holds what the target's holds: prompt chunks, the last token, drafts that will be
   rejected (their slots are overwritten when those positions are computed again, as the target's
   are), and blocks the prefix cache later hands to other requests.
2. **Propose**: for each request that sampled and may be drafted for, the draft reads its newest
   token at its position and picks the next token greedily, and so on, one pass per draft token.
   Those passes write the draft's cache at the positions after the last token, in the lookahead
   slots the scheduler reserves for them (``num_lookahead_tokens``); the next mirror writes them again.

Greedy drafts keep speculative decoding exact: the rejection sampler accepts a draft token with the
target's probability of it (gpu_worker/rejection_sampler.py). Only the TP rank that samples knows
the new tokens; it shares them (and each draft token) with the other ranks, which run every pass too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine_core.spec_decode import draft_room
from gpu_worker import distributed
from gpu_worker.attn_metadata import compute_slot_mapping

if TYPE_CHECKING:
    from gpu_worker.attn_metadata import AttentionMetadata
    from gpu_worker.block_table import BlockTable
    from gpu_worker.model_runner import ModelRunner, WeightSource
    from gpu_worker.request_state import RequestState


@dataclass
class PassInputs:
    """The target's pass as the draft repeats it (positions as the model numbers them, before any
    LongRoPE remapping)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    block_table: np.ndarray
    num_blocks: np.ndarray
    query_start_loc: np.ndarray
    starts: np.ndarray
    num_decodes: int
    slot_mapping: np.ndarray


class DraftModel:
    # Whether after_pass needs the target's hidden states (an MTP layer's input).
    reads_hidden_states = False

    def __init__(self, runner: ModelRunner, num_speculative_tokens: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...] = ()) -> None:
        # The draft's own runner: its model, its KV cache and its attention metadata (never its requests).
        self.runner = runner
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        # A request whose new token ends it gets no draft (the engine would drop it).
        self.eos_token_ids = frozenset(eos_token_ids)
        # A draft vocabulary smaller than the target's (the target's padded for its shards, say):
        # target tokens beyond it reach the draft as token 0, and its drafts are then rejected.
        self.vocab_size = self.target_vocab_size = runner.config.vocab_size
        # Its checkpoint (a directory), read again when it wakes from sleep level 2.
        self.weights: WeightSource | None = None

    def check_pairs_with(self, target: ModelRunner, loaded: bool) -> None:
        """ValueError unless the draft can propose for ``target``: a decoder whose vocabulary is the
        target's or its beginning (checked before its weights load), with plain rotary positions,
        attending no further back than a windowed target keeps blocks (after)."""
        draft, config = self.runner, self.runner.config
        if not loaded:
            name = config.architecture
            if config.encoder_only or config.embedding_only:
                raise ValueError(f"the draft model ({name}) must be a decoder with an LM head")
            if config.mamba is not None:  # (its proposals would advance its states past rejected tokens)
                raise ValueError(f"the draft model ({name}) has recurrent layers, whose per-request states a "
                                 "draft model's proposals are not rolled back from: choose one of attention "
                                 "layers alone, or n-gram speculative decoding")
            self.target_vocab_size = target.config.vocab_size
            if config.vocab_size > target.config.vocab_size:
                raise ValueError(f"the draft model's vocabulary ({config.vocab_size} tokens) is larger than the "
                                 f"target's ({target.config.vocab_size}): its token ids must be the target's")
            return
        if draft.rope_short_offset is not None or target.rope_short_offset is not None:
            raise ValueError("a draft model is not paired with LongRoPE models (their positions are remapped "
                             "per request)")
        # A target whose every layer is windowed releases the blocks behind the window (the engine's
        # cache config): the draft must not read them (nor may a draft of full or chunked attention).
        window = target.config.uniform_sliding_window
        draft_windows = {layer.sliding_window for layer in draft.model.attention_layers()}
        if window is not None and any(not isinstance(w, int) or w > window for w in draft_windows):
            widths = ", ".join(sorted(map(str, draft_windows)))
            raise ValueError(f"the target attends through a sliding window of {window} tokens and frees the blocks "
                             f"behind it; the draft model attends further back (windows {widths}): choose a draft "
                             "whose layers are windowed no wider")

    def initialize_kv_cache(self, num_blocks: int, block_size: int, num_offload_blocks: int | None = None) -> None:
        self.runner.initialize_kv_cache(num_blocks, block_size, num_offload_blocks)

    def after_pass(self, inputs: PassInputs, hidden: torch.Tensor | None, states: list[RequestState],
                   sample_rows: list[int], block_table: BlockTable) -> dict[str, list[int]]:
        """Every rank, after the target's pass (``inputs``: the pass's ``states``, in its order, and
        their ``hidden`` states, given where ``reads_hidden_states``; the sampling rank's token lists
        end with the tokens it kept and sampled): the drafts of the requests at ``sample_rows``. The
        draft model repeats the pass, then proposes."""
        del hidden  # (it reads the token lists only)
        self.mirror(inputs)
        return self.proposals([states[i] for i in sample_rows], block_table) if sample_rows else {}

    def mirror(self, inputs: PassInputs) -> None:
        """Compute the target's pass in the draft's cache (every rank)."""
        runner = self.runner
        meta = runner.attention_metadata(inputs.block_table, inputs.num_blocks, inputs.query_start_loc,
                                         inputs.starts, inputs.num_decodes, inputs.slot_mapping, runner.block_size,
                                         runner.decode_in_place)
        runner.model(self._in_vocab(inputs.input_ids), inputs.positions, meta)

    def _in_vocab(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.vocab_size >= self.target_vocab_size:
            return token_ids
        return torch.where(token_ids < self.vocab_size, token_ids, 0)

    def proposals(self, states: list[RequestState], block_table: BlockTable) -> dict[str, list[int]]:
        """The drafts of the requests that sampled this step (``states``, whose token lists end with
        the sampled tokens on the sampling rank). Every rank calls this."""
        n = len(states)
        device = self.runner.device
        # Per request: its newest token, that token's position, and how many drafts it may get.
        info = torch.zeros((n, 3), dtype=torch.int64, device=device)
        if distributed.get_tp_rank() == 0:
            info = torch.tensor([[s.token_ids[-1], s.num_tokens - 1,
                                  0 if self._ends(s) else draft_room(s.sampling_params, s.num_output_tokens,
                                                                     s.num_tokens, self.k, self.max_model_len)]
                                 for s in states], dtype=torch.int64, device=device)
        if distributed.get_tp_world_size() > 1:
            info = distributed.all_reduce(info)
        tokens, positions, rooms = (info[:, 0], info[:, 1].cpu().numpy(), info[:, 2].cpu().numpy())
        # No further than the slots the request holds (the scheduler's lookahead: the same on every rank).
        slots = np.fromiter((s.num_blocks for s in states), dtype=np.int64, count=n) * self.runner.block_size
        rooms = np.minimum(rooms, slots - positions)
        drafts: dict[str, list[int]] = {}
        active = np.flatnonzero(rooms > 0)
        for j in range(int(rooms.max()) if n else 0):
            active = active[rooms[active] > j]
            if not active.size:
                break
            batch = [states[i] for i in active.tolist()]
            picked = self._next_tokens(batch, tokens[torch.from_numpy(active).to(device)], positions[active] + j,
                                       block_table)
            tokens = tokens.clone()
            tokens[torch.from_numpy(active).to(device)] = picked
            for state, token in zip(batch, picked.tolist(), strict=True):
                drafts.setdefault(state.req_id, []).append(token)
        return drafts

    def _ends(self, state: RequestState) -> bool:
        """Whether the request's newest token ends it (a stop id or, unless ignored, an EOS)."""
        token, params = state.token_ids[-1], state.sampling_params
        return token in params.stop_token_set or (not params.ignore_eos and token in self.eos_token_ids)

    def _next_tokens(self, states: list[RequestState], tokens: torch.Tensor, positions: np.ndarray,
                     block_table: BlockTable) -> torch.Tensor:
        """One decode pass of the draft: each request's token at its position in, its greedy next token out."""
        runner = self.runner
        meta = self._decode_metadata(states, positions, block_table)
        hidden = runner.model(self._in_vocab(tokens), torch.from_numpy(positions).to(runner.device), meta)
        return self._greedy(hidden)

    def _decode_metadata(self, states: list[RequestState], positions: np.ndarray, block_table: BlockTable
                         ) -> AttentionMetadata:
        """Attention metadata of a drafting pass: one token per request, at ``positions``."""
        runner = self.runner
        n = len(states)
        num_blocks = np.fromiter((s.num_blocks for s in states), dtype=np.int64, count=n)
        rows = np.fromiter((s.table_row for s in states), dtype=np.int64, count=n)
        table = block_table.gather(rows, int(num_blocks.max()))
        query_start_loc = np.arange(n + 1, dtype=np.int64)
        slots = compute_slot_mapping(table, np.arange(n), positions, runner.block_size)
        return runner.attention_metadata(table, num_blocks, query_start_loc, positions, n, slots, runner.block_size,
                                         runner.decode_in_place)

    def _greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's most likely next token, on every rank."""
        logits = self.runner.model.compute_logits(hidden)  # (a collective: on TP rank 0 only)
        picked = (logits.argmax(dim=-1) if logits is not None
                  else torch.zeros(hidden.shape[0], dtype=torch.int64, device=self.runner.device))
        if distributed.get_tp_world_size() > 1:
            picked = distributed.all_reduce(picked)
        return picked
