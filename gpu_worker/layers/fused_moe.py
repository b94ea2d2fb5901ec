"""Mixture-of-experts feed-forward: top-k routing and the experts' SwiGLU MLPs.

Every expert's weights live stacked in two parameters, as vLLM's FusedMoE holds them:
``w13_weight`` [experts, 2 * intermediate, hidden] (gate rows, then up rows) and ``w2_weight``
[experts, hidden, intermediate]. Tensor parallelism splits every expert the way a dense MLP is
split: each rank holds its slice of each expert's intermediate dimension (gate/up rows, down
columns), so its output is a partial sum that the block all-reduces once, together with a shared
expert's partial sum where the model has one.

The forward pass groups the batch's (token, expert) pairs by expert and runs one pair of matmuls
per expert that any token chose, over exactly those tokens; the results, scaled by each token's
routing weight, are scattered back with ``index_add_``. That costs one host read of the per-expert
counts per layer (a device sync on CUDA); there is no fused grouped-GEMM kernel here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.layers.linear import divide_for_tp, tp_rank_and_size
from gpu_worker.layers.weight_utils import WeightLike, copy_into

# Shard ids of one expert's projections within the stacked parameters.
GATE, UP, DOWN = 0, 1, 2


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, top_k] in fp32, expert ids [tokens, top_k]): the softmax over all experts'
    logits, its top k, renormalised to sum to one where the model does so (Mixtral, most Qwen3-MoE)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _new_expert_weight(num_experts: int, out_features: int, in_features: int) -> nn.Parameter:
    """[experts, out, in]; on the CPU each expert's matrix is stored [in, out] (a transposed view),
    the layout MKL multiplies fastest, as ``linear.new_weight`` does for dense projections."""
    if torch.get_default_device().type == "cpu":
        weight = torch.empty(num_experts, in_features, out_features).transpose(1, 2)
    else:
        weight = torch.empty(num_experts, out_features, in_features)
    return nn.Parameter(weight, requires_grad=False)


class FusedMoE(nn.Module):
    """The routed experts of one layer. ``forward`` returns this rank's partial sum (not reduced)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 tp_rank: int | None = None, tp_size: int | None = None) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={num_experts}], got {top_k}")
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_rank, tp_size)
        self.num_experts = num_experts
        self.top_k = top_k
        self.intermediate_size_per_partition = divide_for_tp(intermediate_size, self.tp_size, "moe_intermediate_size")
        size = self.intermediate_size_per_partition
        self.w13_weight = _new_expert_weight(num_experts, 2 * size, hidden_size)
        self.w2_weight = _new_expert_weight(num_experts, hidden_size, size)
        for param, projections in ((self.w13_weight, (GATE, UP)), (self.w2_weight, (DOWN,))):
            param.weight_loader = self.weight_loader
            # What the checkpoint must provide before the loader counts the parameter as loaded.
            param.expected_shards = {(e, p) for e in range(num_experts) for p in projections}

    def weight_loader(self, param: nn.Parameter, loaded: WeightLike, shard_id: int | str | None = None) -> None:
        if not isinstance(shard_id, tuple) or len(shard_id) != 2:
            raise ValueError(f"FusedMoE loads one expert's projection at a time, shard_id (expert, proj), "
                             f"got {shard_id!r}")
        expert, projection = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint expert {expert} is out of range: the model has {self.num_experts}")
        size = self.intermediate_size_per_partition
        start = self.tp_rank * size
        if projection == DOWN:
            copy_into(param.data[expert], loaded.narrow(1, start, size), "down_proj")
        else:
            copy_into(param.data[expert].narrow(0, projection * size, size), loaded.narrow(0, start, size),
                      "gate_proj" if projection == GATE else "up_proj")

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        flat_ids = topk_ids.reshape(-1)
        # Each (token, choice) pair, grouped by expert; a stable sort keeps tokens in order within one.
        order = torch.argsort(flat_ids, stable=True)
        tokens = order // self.top_k
        weights = topk_weights.reshape(-1)[order].to(hidden.dtype).unsqueeze(1)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        out = torch.zeros_like(hidden)
        w13, w2 = self.w13_weight, self.w2_weight
        end = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            start, end = end, end + count
            rows = tokens[start:end]
            gate_up = F.linear(hidden.index_select(0, rows), w13[expert])
            gate, up = gate_up.chunk(2, dim=-1)
            expert_out = F.linear(F.silu(gate).mul_(up), w2[expert])
            out.index_add_(0, rows, expert_out.mul_(weights[start:end]))
        return out
