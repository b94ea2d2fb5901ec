"""Which quantized checkpoints load, and the weights they load as: a checkpoint's
``quantization_config`` names its method, and the served ones are dequantized into the model's
dtype as the weights are read (gpu_worker.fp8_checkpoint, gpu_worker.compressed_tensors_checkpoint,
gpu_worker.gptq_awq_checkpoint, gpu_worker.mxfp4_checkpoint, gpu_worker.bitnet_checkpoint); any other
method is refused by name before anything loads."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from gpu_worker.layers.weight_utils import WeightLike, materialize

SERVED_METHODS = ("fp8", "compressed-tensors", "gptq", "awq", "mxfp4", "bitnet")


def _expanded(scale: torch.Tensor, block: tuple[int, int], rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The scale of each (row, col) of a weight's slice: the scale grid's rows and columns for them."""
    if block == (0, 0) or scale.numel() == 1:
        return scale.reshape(-1)[0] if scale.numel() == 1 else scale
    return scale.index_select(-2, rows // block[0]).index_select(-1, cols // block[1])


class ScaledWeight:
    """A quantized weight (fp8 or int8 values) and its scales, read as float32 values one slice at a
    time (a ``WeightLike``): W = value x the scale of its block of ``block`` (rows x columns, the last
    blocks partial), or with ``block`` (0, 0) one scale, or scales broadcast over the weight."""

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
            return values * (scale.narrow(dim, start, length) if scale.numel() > 1 and scale.shape[dim] > 1
                             else scale.reshape(-1)[0] if scale.numel() == 1 else scale)
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
    """``weight`` ([rows, cols] or stacked [..., rows, cols]) times its scales, whole, in float32."""
    return materialize(ScaledWeight(weight, scale, block))


def weight_quantization(quantization: dict[str, Any] | None) -> tuple[str | None, tuple[int, int] | None]:
    """(method, fp8 block) of a checkpoint's ``quantization_config``: (None, None) when it has none;
    ValueError for a method or variant that is not served."""
    if not quantization:
        return None, None
    method = str(quantization.get("quant_method", "")).lower()
    if method == "fp8":
        from gpu_worker.fp8_checkpoint import fp8_weight_block

        return method, fp8_weight_block(quantization)
    if method == "compressed-tensors":
        from gpu_worker.compressed_tensors_checkpoint import check_compressed_tensors

        check_compressed_tensors(quantization)
        return method, None
    if method in ("gptq", "awq"):
        from gpu_worker.gptq_awq_checkpoint import check_gptq_awq

        check_gptq_awq(quantization)
        return method, None
    if method == "mxfp4":
        from gpu_worker.mxfp4_checkpoint import check_mxfp4

        check_mxfp4(quantization)
        return method, None
    if method == "bitnet":
        from gpu_worker.bitnet_checkpoint import check_bitnet

        check_bitnet(quantization)
        return method, None
    raise ValueError(f"quantized checkpoints of quant_method {method!r} are not served (those of "
                     f"{', '.join(SERVED_METHODS)} are): serve the unquantized checkpoint, or a GGUF file of it")


def dequantized_weights(weights: Iterable[tuple[str, WeightLike]], method: str,
                        quantization: dict[str, Any], fp8_block: tuple[int, int] | None
                        ) -> Iterator[tuple[str, WeightLike]]:
    """The checkpoint's tensors with every quantized weight dense (``method`` as weight_quantization
    gave it)."""
    if method == "fp8":
        from gpu_worker.fp8_checkpoint import dequantized

        return dequantized(weights, fp8_block or (0, 0))
    if method in ("gptq", "awq"):
        from gpu_worker.gptq_awq_checkpoint import dequantized as gptq_awq_dequantized

        return gptq_awq_dequantized(weights, quantization)
    if method == "mxfp4":
        from gpu_worker.mxfp4_checkpoint import dequantized as mxfp4_dequantized

        return mxfp4_dequantized(weights)
    if method == "bitnet":
        from gpu_worker.bitnet_checkpoint import dequantized as bitnet_dequantized

        return bitnet_dequantized(weights, quantization)
    from gpu_worker.compressed_tensors_checkpoint import decompressed

    return decompressed(weights, quantization)
