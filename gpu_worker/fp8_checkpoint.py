"""Checkpoints whose linear weights are stored in fp8 (quant_method "fp8": transformers'
FineGrainedFP8 and vLLM's fp8 exports, the Qwen3-*-FP8 releases and others): each such weight is
float8_e4m3fn with a float32 scale, W = fp8 value x scale. The scale is ``weight_scale_inv``, one
per block of ``weight_block_size`` (rows x columns; the last blocks of a dimension the block does
not divide are partial), or ``weight_scale``, one for the whole weight (per-tensor exports).

They are served dequantized: every fp8 weight becomes the model's dtype as it is loaded, so the
checkpoint computes as its unquantized original would, but in that dtype's memory (vLLM keeps the
weights in fp8 on GPUs that have fp8 matmuls). A weight is dequantized lazily, slice by slice as
the loaders read it, so a tensor-parallel rank reads and converts only its own shard. Activation
and KV-cache scales (``input_scale``, ``k_scale``, ...) are not needed then, and are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from gpu_worker.layers.weight_utils import WeightLike, is_activation_scale, materialize, read_whole, stored_dtype

_SCALES = ("_scale_inv", "_scale")


def fp8_weight_block(quantization: dict[str, Any]) -> tuple[int, int]:
    """The block an fp8 checkpoint's ``quantization_config`` scales its weights by ((0, 0): one scale
    per weight); ValueError, naming what, for a variant not served."""
    for key, served in (("fmt", "e4m3"), ("scale_fmt", "float"), ("expert_dtype", "fp8")):
        if quantization.get(key, served) != served:
            raise ValueError(f"fp8 checkpoints with {key}={quantization[key]!r} are not served (only {served!r})")
    block = quantization.get("weight_block_size")
    if block is None:
        return (0, 0)
    if not isinstance(block, (list, tuple)) or len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"weight_block_size must be two positive integers, got {block!r}")
    return int(block[0]), int(block[1])


def _expanded(scale: torch.Tensor, block: tuple[int, int], rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The scale of each (row, col) of a weight's slice: the scale grid's rows and columns for them."""
    if block == (0, 0) or scale.numel() == 1:
        return scale.reshape(-1)[0] if scale.numel() == 1 else scale
    return scale.index_select(-2, rows // block[0]).index_select(-1, cols // block[1])


class DequantizedFP8:
    """An fp8 weight and its scale, read as float32 values one slice at a time (a ``WeightLike``)."""

    __slots__ = ("_block", "_scale", "_weight", "shape")

    def __init__(self, weight: WeightLike, scale: torch.Tensor, block: tuple[int, int]) -> None:
        self._weight, self._scale, self._block = weight, scale.to(torch.float32), block
        self.shape = torch.Size(weight.shape)
        if block == (0, 0) and scale.numel() > 1:
            # Not block-wise: one scale per weight, per stacked expert ([E]) or per row ([rows, 1]),
            # broadcast over the values it scales.
            if scale.dim() == 1 and len(self.shape) == 3 and scale.numel() == self.shape[0]:
                scale = scale.reshape(-1, 1, 1)
            scale = scale.reshape((1,) * (len(self.shape) - scale.dim()) + tuple(scale.shape))
            try:
                fits = torch.broadcast_shapes(scale.shape, self.shape) == self.shape
            except RuntimeError:
                fits = False
            if not fits:
                raise ValueError(f"a weight of shape {tuple(self.shape)} cannot take scales of shape "
                                 f"{tuple(scale.shape)}")
            self._scale = scale.to(torch.float32)
        elif block != (0, 0) and scale.numel() > 1:
            rows, cols = self.shape[-2:]
            grid = (-(-rows // block[0]), -(-cols // block[1]))
            if tuple(scale.shape[-2:]) != grid:
                raise ValueError(f"a weight of {rows} x {cols} in blocks of {block[0]} x {block[1]} needs a "
                                 f"{grid[0]} x {grid[1]} grid of scales, got {tuple(scale.shape)}")

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        dim = dim % len(self.shape)
        values = self._weight.narrow(dim, start, length).to(torch.float32)
        if self._block == (0, 0):  # (one scale, or scales broadcast over the weight: the same slice of them)
            scale = self._scale
            return values * (scale.narrow(dim, start, length) if scale.dim() and scale.shape[dim] > 1 else scale)
        rows = torch.arange(self.shape[-2]) if len(self.shape) >= 2 else torch.arange(1)
        cols = torch.arange(self.shape[-1])
        scale = self._scale
        if dim == len(self.shape) - 1:
            cols = cols[start:start + length]
        elif dim == len(self.shape) - 2:
            rows = rows[start:start + length]
        elif scale.dim() == len(self.shape):  # (stacked experts: each its own grid)
            scale = scale.narrow(dim, start, length)
        return values * _expanded(scale, self._block, rows, cols)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``weight`` (fp8, [rows, cols] or stacked [..., rows, cols]) times its scales, in float32."""
    return materialize(DequantizedFP8(weight, scale, block))


def dequantized(weights: Iterable[tuple[str, WeightLike]], block: tuple[int, int]) -> Iterator[tuple[str, WeightLike]]:
    """The checkpoint's tensors with every fp8 weight paired with its scale (``X_scale_inv`` or
    ``X_scale`` beside it, in whichever order or files the checkpoint holds them) as a lazily
    dequantized weight, and the activation and KV-cache scales left out; other tensors as they
    are. ValueError for an fp8 weight without its scale, or a scale without its weight."""
    weights_waiting: dict[str, WeightLike] = {}
    scales_waiting: dict[str, WeightLike] = {}
    for name, tensor in weights:
        if is_activation_scale(name.rpartition(".")[2]):
            continue
        suffix = next((s for s in _SCALES if name.endswith(s)), None)
        if suffix is not None:
            weight_name = name[: -len(suffix)]
            if weight_name in weights_waiting:
                yield weight_name, DequantizedFP8(weights_waiting.pop(weight_name), read_whole(tensor), block)
            else:
                scales_waiting[weight_name] = tensor
        elif stored_dtype(tensor) == "F8_E4M3":
            if name in scales_waiting:
                yield name, DequantizedFP8(tensor, read_whole(scales_waiting.pop(name)), block)
            else:
                weights_waiting[name] = tensor
        else:
            yield name, tensor
    if weights_waiting or scales_waiting:
        raise ValueError(f"fp8 checkpoint: weights without their scale {sorted(weights_waiting)[:3]}, "
                         f"scales without their weight {sorted(scales_waiting)[:3]}")
