"""MXFP4 checkpoints (``quant_method`` "mxfp4": gpt-oss-20b and gpt-oss-120b as OpenAI released them),
served dequantized: the routed experts' packed 4-bit values and their shared exponents become dense
weights as the checkpoint is read (no MXFP4 kernels here: the model runs in its dtype, as the other
quantized checkpoints do). The attention, router, embedding and head are stored unquantized.

A quantized expert projection is two tensors: ``<name>_blocks`` uint8 [experts, out, in / 32, 16], each
byte two FP4 (e2m1) values of one 32-value block of a row, the first in its low nibble, and
``<name>_scales`` uint8 [experts, out, in / 32], each block's exponent biased by 127 (E8M0):
W[e, o, 32 b + i] = FP4(code) x 2^(scale - 127). The dense tensor is yielded under ``<name>`` in the
layout of an unquantized GPT-OSS checkpoint, [experts, in, out] (a transposed view: no copy).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from gpu_worker.layers.weight_utils import WeightLike, read_whole

# The 16 values of an e2m1 code (sign bit 3, two exponent bits, one mantissa bit).
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_PARTS = ("blocks", "scales")


def check_mxfp4(quantization: dict[str, Any]) -> None:
    """ValueError for an MXFP4 variant not served (the only one released stores 32-value blocks)."""
    block = quantization.get("block_size", quantization.get("group_size", 32))
    if int(block) != 32:
        raise ValueError(f"mxfp4 checkpoints of 32-value blocks are served, not {block}")


def mxfp4_weight(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The dense weight [..., out, in] of packed ``blocks`` [..., out, groups, 16] (uint8) and ``scales``
    [..., out, groups] (uint8, biased by 127), in bfloat16: every FP4 value times a power of two is
    exact there (one mantissa bit; bfloat16's exponents are float32's), in half float32's memory. Made
    one leading slice (an expert) at a time, so the float32 working set is one expert's."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != 16:
        raise ValueError(f"mxfp4 blocks [..., groups, 16] must match their scales [..., groups]: got "
                         f"{tuple(blocks.shape)} and {tuple(scales.shape)}")
    table = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    *lead, rows, groups, _ = blocks.shape
    out = torch.empty(*lead, rows, groups * 32, dtype=torch.bfloat16)
    flat_blocks, flat_scales = blocks.reshape(-1, rows, groups, 16), scales.reshape(-1, rows, groups)
    for i, dense in enumerate(out.view(-1, rows, groups * 32)):
        part = flat_blocks[i]
        # [rows, groups, 16, 2]: each byte's low value first, then its high one.
        values = torch.stack((table[(part & 0x0F).long()], table[(part >> 4).long()]), dim=-1).flatten(-2)
        exponents = flat_scales[i].to(torch.int32).sub(127).unsqueeze(-1)
        dense.copy_(torch.ldexp(values, exponents.to(torch.float32)).flatten(-2))
    return out


def dequantized(weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
    """The checkpoint's tensors with each (``X_blocks``, ``X_scales``) pair replaced by the dense ``X``
    [experts, in, out], the rest as they are. ValueError for a pair left incomplete."""
    waiting: dict[str, dict[str, WeightLike]] = {}
    for name, tensor in weights:
        base, _, part = name.rpartition("_")
        if part not in _PARTS or not base:
            yield name, tensor
            continue
        held = waiting.setdefault(base, {})
        held[part] = tensor
        if len(held) < len(_PARTS):
            continue
        del waiting[base]
        dense = mxfp4_weight(read_whole(held["blocks"]), read_whole(held["scales"]))
        yield base, dense.transpose(-1, -2)
    if waiting:
        first = sorted(waiting)[:3]
        raise ValueError(f"mxfp4 checkpoint: incomplete quantized tensors {first} "
                         f"(holding {[sorted(waiting[m]) for m in first]})")
