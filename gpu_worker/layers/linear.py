"""Tensor-parallel linear layers (Megatron split: column = output dim, row = input dim).

Weights keep the HF ``[out_features, in_features]`` layout so checkpoints load without transposes.
Every parameter carries a ``weight_loader(param, loaded, shard_id)`` that slices on load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker import distributed
from gpu_worker.layers.weight_utils import WeightLike, copy_into, load_sharded


def divide_for_tp(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) must be divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator


def new_weight(out_features: int, in_features: int) -> nn.Parameter:
    """An [out, in] weight parameter. On CPU its storage is [in, out] (a transposed view): MKL
    multiplies by a row-major [in, out] right operand 5-20% faster than by the transpose of an
    [out, in] one (measured for decode-sized inputs), and loaders see the same logical shape."""
    if torch.get_default_device().type == "cpu":
        weight = torch.empty(in_features, out_features).t()
    else:
        weight = torch.empty(out_features, in_features)
    return nn.Parameter(weight, requires_grad=False)


def fake_quantize_per_token(x: torch.Tensor) -> torch.Tensor:
    """BitNet's activation quantization, as transformers computes it: each row rounded to 8 bits by its
    own largest magnitude (round(x * 127 / max|x|) clamped to [-128, 127], times max|x| / 127), in fp32,
    returned in the input's dtype."""
    values = x.float()
    scale = 127.0 / values.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)
    return (values * scale).round_().clamp_(-128, 127).div_(scale).to(x.dtype)


def tp_rank_and_size(tp_rank: int | None, tp_size: int | None) -> tuple[int, int]:
    return (distributed.get_tp_rank() if tp_rank is None else tp_rank,
            distributed.get_tp_world_size() if tp_size is None else tp_size)


class ColumnParallelLinear(nn.Module):
    """Y = X A^T with A split by rows (output features): each rank computes its slice of Y.
    ``quantize_input``: marked where X is rounded per token to 8 bits first (BitNet's checkpoints:
    gpu_worker.bitnet_checkpoint.quantize_linear_inputs wraps the layer's forward)."""

    quantize_input = False

    def __init__(self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False,
                 tp_rank: int | None = None, tp_size: int | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_rank, tp_size)
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_partition = self._partition_size()
        self.gather_output = gather_output
        self.weight = new_weight(self.output_size_per_partition, input_size)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size_per_partition), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _partition_size(self) -> int:
        return divide_for_tp(self.output_size, self.tp_size, "output_size")

    def weight_loader(self, param: nn.Parameter, loaded: WeightLike, shard_id: int | str | None = None) -> None:
        load_sharded(param, loaded, 0, self.tp_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            out = distributed.all_gather(out, dim=-1)
        return out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (gate + up).

    Rank r holds ``[shard_0 rows of rank r; shard_1 rows of rank r; ...]``, so the split after the
    matmul is local.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 tp_rank: int | None = None, tp_size: int | None = None) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, False, tp_rank, tp_size)

    def _partition_size(self) -> int:
        return sum(divide_for_tp(s, self.tp_size, "output size") for s in self.output_sizes)

    def weight_loader(self, param: nn.Parameter, loaded: WeightLike, shard_id: int | str | None = None) -> None:
        if shard_id is None:
            raise ValueError("MergedColumnParallelLinear loads one shard at a time (shard_id required)")
        idx = int(shard_id)
        size = self.output_sizes[idx] // self.tp_size
        offset = sum(s // self.tp_size for s in self.output_sizes[:idx])
        copy_into(param.data.narrow(0, offset, size), loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused. Query heads are split across ranks; when there are fewer KV
    heads than ranks, each KV head is replicated on the ranks whose query heads use it."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 tp_rank: int | None = None, tp_size: int | None = None) -> None:
        rank, size = tp_rank_and_size(tp_rank, tp_size)
        self.head_dim = head_dim
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
        self.num_heads = divide_for_tp(num_heads, size, "num_attention_heads")
        if num_kv_heads >= size:
            self.num_kv_heads = divide_for_tp(num_kv_heads, size, "num_key_value_heads")
        else:
            divide_for_tp(size, num_kv_heads, "tensor-parallel size over num_key_value_heads")
            self.num_kv_heads = 1
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias, False, rank, size)

    def _partition_size(self) -> int:
        return self.q_size + 2 * self.kv_size

    def _kv_head_start(self) -> int:
        if self.total_num_kv_heads >= self.tp_size:
            return self.tp_rank * self.num_kv_heads
        # Replicated KV: rank r serves query heads of KV head r // (tp / num_kv_heads).
        return self.tp_rank // (self.tp_size // self.total_num_kv_heads)

    def weight_loader(self, param: nn.Parameter, loaded: WeightLike, shard_id: int | str | None = None) -> None:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp_rank * self.q_size
        elif shard_id == "k":
            offset, size, start = self.q_size, self.kv_size, self._kv_head_start() * self.head_dim
        elif shard_id == "v":
            offset, size, start = self.q_size + self.kv_size, self.kv_size, self._kv_head_start() * self.head_dim
        else:
            raise ValueError(f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        copy_into(param.data.narrow(0, offset, size), loaded.narrow(0, start, size))


class RowParallelLinear(nn.Module):
    """Y = X A^T with A split by columns (input features): partial sums are all-reduced.

    The bias is added once, after the reduction, so it is not counted tp_size times. With
    ``reduce_results=False`` the caller all-reduces (a MoE block: routed + shared expert).
    ``quantize_input``: as ColumnParallelLinear's (BitNet's checkpoints, one rank).
    """

    quantize_input = False

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True,
                 tp_rank: int | None = None, tp_size: int | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_rank, tp_size)
        self.input_size_per_partition = divide_for_tp(input_size, self.tp_size, "input_size")
        self.output_size = output_size
        self.reduce_results = reduce_results
        self.weight = new_weight(output_size, self.input_size_per_partition)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self._bias_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: WeightLike, shard_id: int | str | None = None) -> None:
        load_sharded(param, loaded, 1, self.tp_rank)

    def _bias_loader(self, param: nn.Parameter, loaded: WeightLike, shard_id: int | str | None = None) -> None:
        copy_into(param, loaded.narrow(0, 0, loaded.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.linear(x, self.weight, self.bias)
        out = F.linear(x, self.weight)
        if self.reduce_results:
            distributed.all_reduce(out)
        return self.add_bias_once(out)

    def add_bias_once(self, out: torch.Tensor) -> torch.Tensor:
        """The bias, added after the all-reduce; without one here (the caller reduces a sum of
        partial outputs) only rank 0 adds it, so the reduction counts it once."""
        if self.bias is None or not (self.reduce_results or self.tp_rank == 0):
            return out
        return out + self.bias
