"""Tensor- and pipeline-parallel process groups: a thin wrapper over torch.distributed.

An engine's workers are ``tp_size x pp_size`` ranks: pipeline stage ``s`` holds global ranks
``s * tp_size .. s * tp_size + tp_size - 1`` (vLLM's layout), which are that stage's tensor-parallel
group. Collectives (all-reduce, gathers) run within the stage's group; a stage hands its hidden
states to the same TP rank of the next stage (point to point).

Without ``init_distributed`` this process is rank 0 of a group of size 1 and every collective is a
no-op, so a TP=1 worker never touches torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """This rank's place: ``rank`` within its stage's tensor-parallel group of ``world_size``, and
    its pipeline stage ``pp_rank`` of ``pp_size``."""

    rank: int = 0
    world_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    # The stage's TP group (None: the whole world is one stage, or TP is 1).
    group: Any = None
    # The decoder layers of each stage (None: an even split; see pp_layer_range).
    layer_partition: tuple[int, ...] | None = None

    @property
    def global_rank(self) -> int:
        return self.pp_rank * self.world_size + self.rank


_group = TPGroup()


def init_distributed(rank: int, world_size: int, master_addr: str = "127.0.0.1", master_port: int = 29500,
                     backend: str | None = None, device: torch.device | str = "cpu",
                     tp_size: int | None = None, layer_partition: tuple[int, ...] | None = None) -> TPGroup:
    """Join the world group of ``world_size`` ranks (``rank``: this one's global rank), split into
    pipeline stages of ``tp_size`` ranks (default: one stage). gloo on CPU, nccl on CUDA unless
    ``backend`` says otherwise."""
    global _group
    tp_size = world_size if tp_size is None else tp_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank={rank} world_size={world_size}")
    if tp_size < 1 or world_size % tp_size:
        raise ValueError(f"tp_size must divide world_size, got tp_size={tp_size} world_size={world_size}")
    pp_size = world_size // tp_size
    group = None
    if world_size > 1:
        device = torch.device(device)
        if backend is None:
            backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}",
                                    rank=rank, world_size=world_size)
        if pp_size > 1 and tp_size > 1:
            # (Every rank creates every stage's group, in the same order, as torch.distributed requires.)
            for stage in range(pp_size):
                stage_group = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)))
                if stage == rank // tp_size:
                    group = stage_group
    _group = TPGroup(rank % tp_size, tp_size, rank // tp_size, pp_size, group, layer_partition)
    return _group


def destroy_distributed() -> None:
    global _group
    if dist.is_initialized():
        dist.destroy_process_group()
    _group = TPGroup()


def get_tp_group() -> TPGroup:
    return _group


def get_tp_rank() -> int:
    return _group.rank


def get_tp_world_size() -> int:
    return _group.world_size


def get_pp_rank() -> int:
    return _group.pp_rank


def get_pp_world_size() -> int:
    return _group.pp_size


def is_first_stage() -> bool:
    return _group.pp_rank == 0


def is_last_stage() -> bool:
    return _group.pp_rank == _group.pp_size - 1


def pp_layer_range(num_layers: int, pp_rank: int | None = None, pp_size: int | None = None,
                   partition: tuple[int, ...] | None = None) -> tuple[int, int]:
    """The decoder layers [start, end) stage ``pp_rank`` of ``pp_size`` holds: ``partition``'s count
    (vLLM's VLLM_PP_LAYER_PARTITION; by default this rank's group's), or an even split, the layers
    left over going one each to the stages before the last, from the last but one back (the first
    holds the embedding, the last the norm and LM head; vLLM splits the same way)."""
    pp_rank = _group.pp_rank if pp_rank is None else pp_rank
    pp_size = _group.pp_size if pp_size is None else pp_size
    if partition is None and pp_size == _group.pp_size:
        partition = _group.layer_partition
    if num_layers < pp_size:
        raise ValueError(f"the model has {num_layers} layers, fewer than pipeline_parallel_size {pp_size}")
    if partition is not None and pp_size > 1:
        if len(partition) != pp_size or sum(partition) != num_layers or min(partition) < 1:
            raise ValueError(f"the layer partition {list(partition)} must give each of the {pp_size} pipeline "
                             f"stages at least one of the model's {num_layers} layers, {num_layers} in all")
        sizes = list(partition)
    else:
        sizes = [num_layers // pp_size] * pp_size
        for i in range(num_layers % pp_size):
            sizes[(pp_size - 2 - i) % pp_size] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


def send_to_next_stage(tensors: list[torch.Tensor]) -> None:
    """Hand a pass's hidden states to the same TP rank of the next pipeline stage."""
    dst = _group.global_rank + _group.world_size
    for tensor in tensors:
        dist.send(tensor.contiguous(), dst=dst)


def recv_from_previous_stage(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                             count: int) -> list[torch.Tensor]:
    """The ``count`` tensors the previous stage's same TP rank sent (send_to_next_stage)."""
    src = _group.global_rank - _group.world_size
    out = []
    for _ in range(count):
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(tensor, src=src)
        out.append(tensor)
    return out


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over the group, in place; returns the tensor for chaining."""
    if _group.world_size > 1:
        dist.all_reduce(tensor, group=_group.group)
    return tensor


def all_gather(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's tensor along ``dim`` (all ranks get the result)."""
    if _group.world_size == 1:
        return tensor
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(_group.world_size)]
    dist.all_gather(parts, tensor, group=_group.group)
    return torch.cat(parts, dim=dim)


def gather(tensor: torch.Tensor, dim: int = -1, dst: int = 0) -> torch.Tensor | None:
    """Concatenate every rank's tensor along ``dim`` on ``dst`` only; other ranks get None.

    Used for logits: only rank 0 samples, so the others need not receive the full vocab.
    (``dst`` is a rank within the stage's TP group.)
    """
    if _group.world_size == 1:
        return tensor
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(_group.world_size)] if _group.rank == dst else None
    dist.gather(tensor, parts, dst=_group.pp_rank * _group.world_size + dst, group=_group.group)
    return torch.cat(parts, dim=dim) if parts is not None else None


def all_reduce_min(value: int, device: torch.device | str = "cpu") -> int:
    """The smallest ``value`` over every rank of every stage (e.g. KV blocks every rank can hold)."""
    if _group.world_size * _group.pp_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
