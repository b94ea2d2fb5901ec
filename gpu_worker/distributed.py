"""Tensor-parallel process group: a thin wrapper over torch.distributed.

Without ``init_distributed`` this process is rank 0 of a group of size 1 and every collective is a
no-op, so a TP=1 worker never touches torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1


_group = TPGroup()


def init_distributed(rank: int, world_size: int, master_addr: str = "127.0.0.1", master_port: int = 29500,
                     backend: str | None = None, device: torch.device | str = "cpu") -> TPGroup:
    """Join the world group. gloo on CPU, nccl on CUDA unless ``backend`` says otherwise."""
    global _group
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank={rank} world_size={world_size}")
    if world_size > 1:
        device = torch.device(device)
        if backend is None:
            backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}",
                                    rank=rank, world_size=world_size)
    _group = TPGroup(rank, world_size)
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


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over the group, in place; returns the tensor for chaining."""
    if _group.world_size > 1:
        dist.all_reduce(tensor)
    return tensor


def all_gather(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's tensor along ``dim`` (all ranks get the result)."""
    if _group.world_size == 1:
        return tensor
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(_group.world_size)]
    dist.all_gather(parts, tensor)
    return torch.cat(parts, dim=dim)


def gather(tensor: torch.Tensor, dim: int = -1, dst: int = 0) -> torch.Tensor | None:
    """Concatenate every rank's tensor along ``dim`` on ``dst`` only; other ranks get None.

    Used for logits: only rank 0 samples, so the others need not receive the full vocab.
    """
    if _group.world_size == 1:
        return tensor
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(_group.world_size)] if _group.rank == dst else None
    dist.gather(tensor, parts, dst=dst)
    return torch.cat(parts, dim=dim) if parts is not None else None


def all_reduce_min(value: int, device: torch.device | str = "cpu") -> int:
    """The smallest ``value`` over the group (e.g. KV blocks every rank can hold)."""
    if _group.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
