"""What a layer's weight loader accepts: a torch.Tensor, or a lazy checkpoint slice.

A lazy slice (see ``gpu_worker.weights.LazyTensor``, and an fp8 checkpoint's
``gpu_worker.fp8_checkpoint.DequantizedFP8``) reads only the rows a TP rank asks for, so a rank
never materialises tensors it does not own (a compressed-tensors layer is the exception: its packed
values are decompressed whole). Both kinds offer ``shape`` and ``narrow``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class WeightLike(Protocol):
    @property
    def shape(self) -> torch.Size: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...


def materialize(weight: WeightLike) -> torch.Tensor:
    if isinstance(weight, torch.Tensor):
        return weight
    return weight.narrow(0, 0, weight.shape[0])


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def copy_into(param: torch.Tensor, loaded: torch.Tensor, name: str = "") -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape mismatch loading {name or 'weight'}: parameter {tuple(param.shape)}, "
                         f"checkpoint {tuple(loaded.shape)}")
    if (loaded.dtype in _FP8 or not loaded.dtype.is_floating_point) and param.dtype.is_floating_point \
            and param.dtype not in _FP8:
        # (Cast alone, quantized values would load as wrong weights without a word: their scale is
        # what a quantized checkpoint's quantization_config makes the loader apply.)
        raise ValueError(f"the checkpoint holds quantized ({loaded.dtype}) values without their scale for "
                         f"{name or 'a weight'}: its config.json lacks the quantization_config that says how they "
                         "are scaled")
    param.data.copy_(loaded)


def load_sharded(param: torch.Tensor, loaded: WeightLike, dim: int, rank: int) -> None:
    """Copy this rank's equal slice of ``loaded`` along ``dim`` into ``param``."""
    size = param.shape[dim]
    copy_into(param, loaded.narrow(dim, rank * size, size))
