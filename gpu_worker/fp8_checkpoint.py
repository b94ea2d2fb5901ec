"""Checkpoints whose linear weights are stored in fp8 (transformers' FineGrainedFP8, quant_method
"fp8": the Qwen3-*-FP8 releases and others): each such weight is float8_e4m3fn, with a float32
``weight_scale_inv`` per block of ``weight_block_size`` (rows x columns; the last blocks of a
dimension that the block does not divide are partial) or one for the whole weight, and
W = fp8 value x its block's scale.

They are served dequantized: every fp8 weight becomes the model's dtype as it is loaded, so the
checkpoint loads and computes as its unquantized original would, but in that dtype's memory (vLLM
keeps the weights in fp8 on GPUs that have fp8 matmuls). Activation scales (``input_scale``, a
static activation scheme's) are not needed then, and are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from gpu_worker.layers.weight_utils import WeightLike, materialize

_SCALE = "_scale_inv"
_FP8_NAMES = ("F8_E4M3", "F8_E5M2")


def fp8_weight_block(quantization: dict[str, Any] | None) -> tuple[int, int] | None:
    """The block of a checkpoint's ``quantization_config`` for fp8 weights ((0, 0): one scale per
    weight), or None for a checkpoint that is not quantized; ValueError, naming what, for one that
    is quantized in a way not served."""
    if not quantization:
        return None
    method = str(quantization.get("quant_method", "")).lower()
    if method != "fp8":
        raise ValueError(f"quantized checkpoints of quant_method {method!r} are not served (fp8 ones are): serve "
                         "the unquantized checkpoint, or a GGUF file of it")
    for key, served in (("fmt", "e4m3"), ("scale_fmt", "float"), ("expert_dtype", "fp8")):
        if quantization.get(key, served) != served:
            raise ValueError(f"fp8 checkpoints with {key}={quantization[key]!r} are not served (only {served!r})")
    block = quantization.get("weight_block_size")
    if block is None:
        return (0, 0)
    if not isinstance(block, (list, tuple)) or len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"weight_block_size must be two positive integers, got {block!r}")
    return int(block[0]), int(block[1])


def _read(tensor: WeightLike) -> torch.Tensor:
    """The whole tensor (a scale may be a 0-d one, which ``materialize`` cannot narrow)."""
    if isinstance(tensor, torch.Tensor):
        return tensor
    return tensor._slice[...] if len(tensor.shape) == 0 else materialize(tensor)  # type: ignore[attr-defined]


def _is_fp8(tensor: WeightLike) -> bool:
    if isinstance(tensor, torch.Tensor):
        return tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    get_dtype = getattr(getattr(tensor, "_slice", None), "get_dtype", None)  # (a LazyTensor: not read yet)
    return get_dtype is not None and get_dtype() in _FP8_NAMES


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``weight`` (fp8, [rows, cols] or stacked [..., rows, cols]) times its blocks' scales, in
    float32: each scale covers ``block`` (the last blocks partial), or the whole weight for (0, 0)."""
    values = weight.to(torch.float32)
    scale = scale_inv.to(torch.float32)
    if block == (0, 0) or scale.numel() == 1:
        return values * scale.reshape(-1)[0] if scale.numel() == 1 else values * scale
    rows, cols = values.shape[-2:]
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape[-2:]) != grid:
        raise ValueError(f"a weight of {rows} x {cols} in blocks of {block[0]} x {block[1]} needs a {grid[0]} x "
                         f"{grid[1]} grid of scales, got {tuple(scale.shape)}")
    full = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return values * full[..., :rows, :cols]


def dequantized(weights: Iterable[tuple[str, WeightLike]], block: tuple[int, int]) -> Iterator[tuple[str, WeightLike]]:
    """The checkpoint's tensors with every fp8 weight dequantized (by the ``X_scale_inv`` beside it,
    in whichever order the files hold them) and the scales and activation scales left out; other
    tensors as they are. ValueError for an fp8 weight without its scale, or a scale without its
    weight."""
    weights_waiting: dict[str, WeightLike] = {}
    scales_waiting: dict[str, WeightLike] = {}
    for name, tensor in weights:
        if name.endswith(".input_scale"):
            continue
        if name.endswith(_SCALE):
            weight_name = name[: -len(_SCALE)]
            if weight_name in weights_waiting:
                yield weight_name, dequantize(_read(weights_waiting.pop(weight_name)), _read(tensor), block)
            else:
                scales_waiting[weight_name] = tensor
        elif _is_fp8(tensor):
            if name in scales_waiting:
                yield name, dequantize(_read(tensor), _read(scales_waiting.pop(name)), block)
            else:
                weights_waiting[name] = tensor
        else:
            yield name, tensor
    if weights_waiting or scales_waiting:
        raise ValueError(f"fp8 checkpoint: weights without their weight_scale_inv {sorted(weights_waiting)[:3]}, "
                         f"scales without their weight {sorted(scales_waiting)[:3]}")
