"""Speculative decoding with a drafter that reads the target's hidden states: the model's own
multi-token-prediction layer (vLLM's ``mtp`` method: gpu_worker/models/mtp.py) or an EAGLE / EAGLE-3
head (methods ``eagle``, ``eagle3``: gpu_worker/models/eagle.py).

The drafter runs on the target's workers, sharded as the target is, with a KV cache of its own laid
out on the target's block table (as a draft model's: gpu_worker/draft_model.py). Its input at
position p is the token at p + 1 and a feature of the target at p (the MTP layer and EAGLE: the last
hidden state; EAGLE-3: three inner ones, projected by its ``combine_hidden_states``), so after each
pass:

1. **Follow**: it computes the pass's positions whose hidden states stand: each request's rows up
   to its last accepted token (the rows of rejected drafts are left out), each with the token after
   it: the pass's next input, at the end of a prompt chunk the prompt's next token, and at the last
   row the token just sampled. Its cache then holds what the target's holds (a slot written for a
   rejected draft is written again when its position is computed again).
2. **Propose**: each sampled request's last row gives its first draft; each further draft is one
   more pass, the draft before it in and the drafter's own output as the feature, writing the
   lookahead slots the scheduler reserved for it (which the next follow writes again).

Drafts are greedy, so speculative decoding stays exact (gpu_worker/rejection_sampler.py). Only the TP
rank that samples knows the new tokens and what was accepted; it shares them with the other ranks.
A block the prefix cache hands to another request keeps the drafter's row for its last position as
the request that filled it computed it (from the token that followed there): a draft may be the
worse for it, never an output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from engine_core.spec_decode import draft_room
from gpu_worker import distributed
from gpu_worker.draft_model import DraftModel, PassInputs

if TYPE_CHECKING:
    from torch import nn

    from gpu_worker.block_table import BlockTable
    from gpu_worker.model_runner import ModelRunner
    from gpu_worker.request_state import RequestState


class HiddenStateDrafter(DraftModel):
    reads_hidden_states = True

    def __init__(self, runner: ModelRunner, num_speculative_tokens: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...] = ()) -> None:
        super().__init__(runner, num_speculative_tokens, max_model_len, eos_token_ids)
        # EAGLE-3: the target's decoder stack, which keeps the inputs of the layers the head reads
        # (its aux_layer_ids) at each pass; None: the drafter reads the target's last hidden states.
        self.target_stack: nn.Module | None = None

    def after_pass(self, inputs: PassInputs, hidden: torch.Tensor | None, states: list[RequestState],
                   sample_rows: list[int], block_table: BlockTable) -> dict[str, list[int]]:
        assert hidden is not None
        runner, device = self.runner, self.runner.device
        qsl, starts = inputs.query_start_loc, inputs.starts
        features = self._target_features(hidden)
        info = self._rows_kept(states, sample_rows, qsl, starts)
        counts, rooms = info[:, 0].cpu().numpy(), info[:, 2].cpu().numpy()
        # The rows followed: request i's first counts[i] rows of the pass.
        kept_qsl = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        request_of_row = np.repeat(np.arange(len(states)), counts)
        rows = qsl[request_of_row] + np.arange(int(kept_qsl[-1])) - kept_qsl[request_of_row]
        rows_t = torch.from_numpy(rows).to(device)
        # Each row's next token: the pass's next input, and at each request's last row the one after it.
        next_rows = torch.from_numpy(np.minimum(rows + 1, len(inputs.input_ids) - 1)).to(device)
        token_ids = inputs.input_ids.index_select(0, next_rows)
        last_rows = torch.from_numpy(kept_qsl[1:] - 1).to(device)
        token_ids[last_rows] = info[:, 1]
        meta = runner.attention_metadata(inputs.block_table, inputs.num_blocks, kept_qsl, starts, inputs.num_decodes,
                                         inputs.slot_mapping[rows], runner.block_size, runner.decode_in_place)
        out = runner.model(token_ids, inputs.positions.index_select(0, rows_t), meta,
                           previous_hidden=runner.model.combine_hidden_states(features.index_select(0, rows_t)))
        # Drafts: within what the request may still take and the slots it holds (the scheduler's
        # lookahead); the next token's position is the last row's plus one.
        next_positions = starts + counts
        slots = np.fromiter((s.num_blocks for s in states), dtype=np.int64, count=len(states)) * runner.block_size
        rooms = np.minimum(rooms, slots - next_positions)
        active = np.flatnonzero(rooms > 0)
        drafts: dict[str, list[int]] = {}
        if not active.size:
            return drafts
        layer_out = out.index_select(0, last_rows[torch.from_numpy(active).to(device)])
        picked = self._greedy(layer_out)
        for step in range(int(rooms.max())):
            if step:  # (the draft before in, at the position after the last one's)
                keep = rooms[active] > step
                if not keep.any():
                    break
                keep_t = torch.from_numpy(keep).to(device)
                active, layer_out, picked = active[keep], layer_out[keep_t], picked[keep_t]
                positions = next_positions[active] - 1 + step
                meta = self._decode_metadata([states[i] for i in active.tolist()], positions, block_table)
                layer_out = runner.model(picked, torch.from_numpy(positions).to(device), meta,
                                         previous_hidden=layer_out)
                picked = self._greedy(layer_out)
            for i, token in zip(active.tolist(), picked.tolist(), strict=True):
                drafts.setdefault(states[i].req_id, []).append(token)
        return drafts

    def _target_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the drafter reads of the target's pass, a row per token: its last hidden states, or
        (EAGLE-3) the inner ones its stack kept, side by side (taken: the stack keeps them no longer)."""
        stack = self.target_stack
        if stack is None:
            return hidden
        kept, stack.aux_hidden_states = stack.aux_hidden_states, []
        return torch.cat(kept, dim=-1)

    def _rows_kept(self, states: list[RequestState], sample_rows: list[int], qsl: np.ndarray, starts: np.ndarray
                   ) -> torch.Tensor:
        """Per request of the pass, on every rank: how many of its rows stand (through its last
        accepted token: all of a chunk that sampled nothing), the token after the last of them, and
        how many drafts it may get (0 unless it sampled). Known on the sampling rank, which holds the
        sampled and accepted tokens at the end of each token list."""
        n = len(states)
        info = torch.zeros((n, 3), dtype=torch.int64, device=self.runner.device)
        if distributed.get_tp_rank() == 0:
            sampling = set(sample_rows)
            values = []
            for i, state in enumerate(states):
                tokens = state.token_ids
                if i in sampling:  # (its list ends with the accepted drafts and the new token)
                    room = 0 if self._ends(state) else draft_room(state.sampling_params, state.num_output_tokens,
                                                                  state.num_tokens, self.k, self.max_model_len)
                    values.append((state.num_tokens - 1 - int(starts[i]), tokens[-1], room))
                else:  # (a prompt chunk before the prompt's end; or a prompt that pooled, with no token after it)
                    end = int(starts[i] + qsl[i + 1] - qsl[i])
                    values.append((end - int(starts[i]), tokens[end] if end < len(tokens) else 0, 0))
            info = torch.tensor(values, dtype=torch.int64, device=self.runner.device)
        if distributed.get_tp_world_size() > 1:
            info = distributed.all_reduce(info)
        return info
