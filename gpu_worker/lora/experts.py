"""LoRA on a layer's routed experts: each adapter's per-expert low-rank deltas, added inside FusedMoE.

An adapter holds, for one layer's experts, two pairs of stacks in the experts' own layout
([local experts, out, in], as ``w13_weight`` and ``w2_weight``): the gate/up projection's
(A [E, R, hidden], B [E, 2 x width, R]) and the down projection's (A [E, R', width], B [E, hidden, R'])
(gpu_worker.lora.manager builds them, sharded as the experts are). FusedMoE adds each delta where
its own product is computed: a row routed to expert e gets ``(x A_e^T) B_e^T`` on its gate/up
pre-activation and on its down output, in the same grouped GEMM layout (rows sorted by expert,
one grouped_mm for A and one for B) or per expert where grouped_mm does not run. Rows of tokens
under another adapter, or none, are zeroed between the two products by a mask over this pass's
rows; on the CPU, where reading back which rows they are costs nothing, the grouped GEMMs take the
adapter's rows alone instead (a pass mixing adapters then costs each adapter its own rows' share,
not every row: on CUDA the mask keeps the pass free of host reads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.lora.layers import LoRABatch

# An adapter's (A, B) stacks of one expert projection, [E, R, in] and [E, out, R].
ExpertsPair = tuple[torch.Tensor, torch.Tensor]


@dataclass
class ExpertsDelta:
    """One adapter's deltas on one layer's experts in this pass (None: it trains neither projection of
    that name), and which of the layer's (token, expert) rows run under it (None: every row)."""

    gate_up: ExpertsPair | None
    down: ExpertsPair | None
    row_mask: torch.Tensor | None  # [rows, 1] of 0 / 1
    # Or the adapter's rows themselves (still sorted by expert) and where each expert's of them end.
    row_index: torch.Tensor | None = None
    index_offsets: torch.Tensor | None = None

    def add_grouped(self, out: torch.Tensor, x: torch.Tensor, pair: ExpertsPair | None,
                    offsets: torch.Tensor) -> None:
        """``out += (x A_e^T) B_e^T`` for every row, e its expert (rows sorted by expert, group ends ``offsets``)."""
        if pair is None:
            return
        a, b = pair
        if self.row_index is not None:
            low = F.grouped_mm(x.index_select(0, self.row_index), a.transpose(1, 2), offs=self.index_offsets)
            out.index_add_(0, self.row_index, F.grouped_mm(low, b.transpose(1, 2), offs=self.index_offsets))
            return
        low = F.grouped_mm(x, a.transpose(1, 2), offs=offsets)
        if self.row_mask is not None:
            low.mul_(self.row_mask)
        out += F.grouped_mm(low, b.transpose(1, 2), offs=offsets)

    def add_one_expert(self, out: torch.Tensor, x: torch.Tensor, pair: ExpertsPair | None, expert: int,
                       part: slice) -> None:
        """``out += (x A^T) B^T`` for the rows ``part`` (``out`` and ``x`` are those rows) of ``expert``."""
        if pair is None:
            return
        a, b = pair
        low = F.linear(x, a[expert])
        if self.row_mask is not None:
            low.mul_(self.row_mask[part])
        out.addmm_(low, b[expert].t())


class ExpertsLoRA:
    """The adapters' deltas on one FusedMoE (its ``lora``): found in the pass's adapters by the
    experts' parameter names (``<path>.w13_weight``, ``<path>.w2_weight``)."""

    # Whether an adapter's grouped GEMMs take its rows alone (None: where the device is the CPU); else
    # every row, masked. (Tests set it.)
    rows_alone: bool | None = None

    def __init__(self, path: str, batch: LoRABatch) -> None:
        self.path = path
        self.gate_up_key = f"{path}.w13_weight"
        self.down_key = f"{path}.w2_weight"
        self.batch = batch

    def deltas(self, tokens: torch.Tensor, num_tokens: int, dtype: torch.dtype, sorted_ids: torch.Tensor,
               ends: torch.Tensor | None) -> list[ExpertsDelta]:
        """``tokens``: the token (row of the pass's flat batch) of each of the layer's rows, sorted by
        their local expert ``sorted_ids``; ``ends``: 1 ... local experts, where the grouped GEMMs run
        (None: per expert)."""
        out = []
        for adapter, rows in self.batch.groups:
            gate_up = adapter.layers.get(self.gate_up_key)
            down = adapter.layers.get(self.down_key)
            if gate_up is None and down is None:
                continue
            if rows is None:
                out.append(ExpertsDelta(gate_up, down, None))
                continue
            mask = self.batch.token_mask(adapter.lora_int_id, rows, num_tokens, dtype, tokens.device)
            mask = mask.index_select(0, tokens)
            alone = self.rows_alone if self.rows_alone is not None else tokens.device.type == "cpu"
            if ends is not None and alone:
                index = mask.squeeze(1).nonzero().squeeze(1)
                offsets = torch.searchsorted(sorted_ids.index_select(0, index), ends, out_int32=True)
                out.append(ExpertsDelta(gate_up, down, None, index, offsets))
            else:
                out.append(ExpertsDelta(gate_up, down, mask))
        return out
