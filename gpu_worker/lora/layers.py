"""Linear layers that add each token's LoRA delta: ``y = x W^T + (x A^T) B^T`` per adapter.

A ``LoRALinear`` wraps one of the model's (tensor-parallel) projections after its weights are
loaded. Every wrapper of a model shares one ``LoRABatch``: which rows of this step's flat batch run
under which adapter. A step mixes at most ``max_loras`` adapters, so the delta is one pair of small
matmuls per adapter present, over that adapter's rows only: the model runner lays each adapter's
decodes side by side, and its prefill chunks, so they are at most two slices of the batch (no
gather). Rows of base-model requests get nothing added.

Tensor parallelism follows the base layer. A column-parallel projection holds A whole and the rows
of B for its output slice; a row-parallel one holds the columns of A for its input slice and B
whole, and its partial delta joins the partial product before the all-reduce, which sums both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker import distributed
from gpu_worker.layers.linear import ColumnParallelLinear, RowParallelLinear


@dataclass
class AdapterShard:
    """One adapter on one rank: per wrapped layer, (A^T [in, R], B^T [R, out]) with the scaling in B;
    per routed experts' projection (``<experts>.w13_weight`` / ``.w2_weight``: gpu_worker.lora.experts),
    (A [E, R, in], B [E, out, R]) stacks in the experts' layout, the scaling in B."""

    lora_int_id: int
    lora_name: str
    lora_path: str
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]


Rows = list[slice] | None  # None: every row of the batch


@dataclass
class LoRABatch:
    groups: list[tuple[AdapterShard, Rows]] = field(default_factory=list)
    # Per adapter of the pass with some of its rows: a [rows, 1] mask of those rows (routed experts
    # read it per layer, gpu_worker.lora.experts), made once a pass.
    _token_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def set_groups(self, groups: list[tuple[AdapterShard, Rows]]) -> None:
        self.groups = groups
        self._token_masks = {}

    def token_mask(self, lora_int_id: int, rows: list[slice], num_tokens: int, dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
        mask = self._token_masks.get(lora_int_id)
        if mask is None or mask.shape[0] != num_tokens or mask.dtype != dtype:
            mask = torch.zeros(num_tokens, 1, dtype=dtype)
            for part in rows:
                mask[part] = 1
            mask = self._token_masks[lora_int_id] = mask.to(device, non_blocking=True)
        return mask


# The attribute holding the wrapped projection: its parameters are named "<path>.base.<name>".
LORA_BASE = "base"


class LoRALinear(nn.Module):
    def __init__(self, base: ColumnParallelLinear | RowParallelLinear | nn.Linear, path: str, batch: LoRABatch) -> None:
        """``base`` a plain ``nn.Linear``: a layer every rank holds whole (an MoE router), computed as
        a column-parallel one of one rank is."""
        super().__init__()
        self.base = base
        self.path = path
        self.batch = batch
        self.row_parallel = isinstance(base, RowParallelLinear)
        self.gather_output = getattr(base, "gather_output", False)

    def __getattr__(self, name: str):
        """What the model reads of the wrapped layer besides its forward (a router's
        e_score_correction_bias) is the wrapped layer's."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if LORA_BASE not in self._modules:
                raise
            return getattr(self._modules[LORA_BASE], name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        groups = self.batch.groups
        if not groups:
            return self.base.forward(x)
        base = self.base
        if self.row_parallel:
            split = base.tp_size > 1
            out = F.linear(x, base.weight, None if split else base.bias)
            self._add_deltas(x, out, groups)
            if split:
                if base.reduce_results:
                    distributed.all_reduce(out)
                out = base.add_bias_once(out)
            return out
        out = F.linear(x, base.weight, base.bias)
        self._add_deltas(x, out, groups)
        if self.gather_output:
            out = distributed.all_gather(out, dim=-1)
        return out

    def _add_deltas(self, x: torch.Tensor, out: torch.Tensor, groups: list[tuple[AdapterShard, Rows]]) -> None:
        path = self.path
        for adapter, rows in groups:
            pair = adapter.layers.get(path)
            if pair is None:  # (this adapter does not train this projection)
                continue
            a_t, b_t = pair
            if rows is None:
                out.addmm_(x @ a_t, b_t)
            else:
                for part in rows:
                    out[part].addmm_(x[part] @ a_t, b_t)
