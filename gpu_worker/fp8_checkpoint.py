"""Checkpoints whose linear weights are stored in fp8 (quant_method "fp8": transformers'
FineGrainedFP8 and vLLM's fp8 exports, the Qwen3-*-FP8 releases and others): each such weight is
float8_e4m3fn with a float32 scale, W = fp8 value x scale. The scale is ``weight_scale_inv``, one
per block of ``weight_block_size`` (rows x columns; the last blocks of a dimension the block does
not divide are partial), or ``weight_scale``, one for the whole weight (per-tensor exports).

They are served dequantized: every fp8 weight becomes the model's dtype as it is loaded, so the
checkpoint computes as its unquantized original would, but in that dtype's memory (vLLM keeps the
weights in fp8 on GPUs that have fp8 matmuls). A weight is dequantized lazily, slice by slice as
the loaders read it (``quantized_checkpoint.ScaledWeight``), so a tensor-parallel rank reads and converts
only its own shard. Activation
and KV-cache scales (``input_scale``, ``k_scale``, ...) are not needed then, and are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from gpu_worker.layers.weight_utils import WeightLike, is_activation_scale, read_whole, stored_dtype
from gpu_worker.quantized_checkpoint import ScaledWeight

_SCALES = ("_scale_inv", "_scale")


def fp8_weight_block(quantization: dict[str, Any]) -> tuple[int, int]:
    """The block an fp8 checkpoint's ``quantization_config`` scales its weights by ((0, 0): one scale
    per weight); ValueError, naming what, for a variant not served."""
    for key, served in (("fmt", "e4m3"), ("scale_fmt", "float"), ("expert_dtype", "fp8")):
        value = quantization.get(key, served)
        if key == "fmt" and value == "float8_e4m3fn":  # (MiniMax-M2's name for it)
            value = "e4m3"
        if value != served:
            raise ValueError(f"fp8 checkpoints with {key}={quantization[key]!r} are not served (only {served!r})")
    block = quantization.get("weight_block_size")
    if block is None:
        return (0, 0)
    if not isinstance(block, (list, tuple)) or len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"weight_block_size must be two positive integers, got {block!r}")
    return int(block[0]), int(block[1])


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
                yield weight_name, ScaledWeight(weights_waiting.pop(weight_name), read_whole(tensor), block)
            else:
                scales_waiting[weight_name] = tensor
        elif stored_dtype(tensor) == "F8_E4M3":
            if name in scales_waiting:
                yield name, ScaledWeight(tensor, read_whole(scales_waiting.pop(name)), block)
            else:
                weights_waiting[name] = tensor
        else:
            yield name, tensor
    if weights_waiting or scales_waiting:
        raise ValueError(f"fp8 checkpoint: weights without their scale {sorted(weights_waiting)[:3]}, "
                         f"scales without their weight {sorted(scales_waiting)[:3]}")
