"""Mamba-2 layers in llama.cpp's GGUF files (Granite 4.0-H's, Nemotron-H's, Falcon-H1's), back to the
checkpoints' tensors and geometry, and the hybrids' tensor renaming. Used by gpu_worker.gguf_granite,
gguf_nemotron_h, gguf_falcon_h1 and gguf_loader.

llama.cpp's Mamba2Model converter writes A_log as A = -exp(A_log) with a trailing unit dimension
(``ssm_a``, no suffix), D likewise (``ssm_d``), dt_bias as ``ssm_dt.bias``, the convolution's
[channels, 1, taps] weight squeezed to [channels, taps], and the gated norm's weight as [groups,
channels / groups]; its geometry as ssm.* keys (the heads as ssm.time_step_rank, their total width
as ssm.inner_size).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class HybridNames:
    """A family's checkpoint names for llama.cpp's: its top-level tensors (token_embd ...), its layers'
    prefix ("model.layers"), its recurrent mixer's name within a layer, its layers' other parts
    (attn_q ...), the family's name for messages, and how its mixer's reshaped tensors are undone
    (None: Mamba-2's, undo_mamba2)."""

    top_level: dict[str, str]
    layers: str
    mixer: str
    block: dict[str, str]
    family: str
    undo: Callable[[str, str, np.ndarray], tuple[str, np.ndarray] | None] | None = None


# llama.cpp's names for the mixer's projections -> the checkpoints' (under the mixer's own prefix).
_PROJECTIONS = {"ssm_in": "in_proj", "ssm_conv1d": "conv1d", "ssm_out": "out_proj"}


def undo_mamba2(part: str, kind: str, array: np.ndarray) -> tuple[str, np.ndarray] | None:
    """A Mamba-2 tensor of a layer (``part``: its llama.cpp name, ``kind``: "weight", "bias" or "" for
    the bare ssm_a / ssm_d) as the checkpoint holds it, named within the mixer ("A_log",
    "conv1d.weight", ...); None: not a Mamba-2 tensor."""
    if part == "ssm_a":  # (A = -exp(A_log), [heads, 1])
        return "A_log", np.log(-array.reshape(-1)).astype(np.float32)
    if part == "ssm_d":
        return "D", array.reshape(-1)
    if part == "ssm_dt":
        return "dt_bias", array
    if part == "ssm_conv1d" and kind == "weight":
        return "conv1d.weight", array[:, None, :]
    if part == "ssm_norm":
        return "norm.weight", array.reshape(-1)
    if part in _PROJECTIONS:
        return f"{_PROJECTIONS[part]}.{kind}", array
    return None


def mamba2_geometry(meta: dict[str, Any], arch: str, tensor_names: set[str]) -> dict[str, Any]:
    """The mixer's heads, their width, groups, state size, convolution taps, biases, and total width."""
    inner, heads = int(meta[f"{arch}.ssm.inner_size"]), int(meta[f"{arch}.ssm.time_step_rank"])
    if inner % heads:
        raise ValueError(f"GGUF {arch} file: ssm.inner_size {inner} is not a whole multiple of ssm.time_step_rank "
                         f"({heads})")
    return {"num_heads": heads, "head_dim": inner // heads, "num_groups": int(meta[f"{arch}.ssm.group_count"]),
            "state_size": int(meta[f"{arch}.ssm.state_size"]), "conv_kernel": int(meta[f"{arch}.ssm.conv_kernel"]),
            "conv_bias": any(name.endswith(".ssm_conv1d.bias") for name in tensor_names),
            "proj_bias": any(name.endswith(".ssm_in.bias") for name in tensor_names), "inner_size": inner}


def per_layer(value: Any, layers: int, key: str) -> list[int]:
    """A per-layer metadata list (or one value for every layer), checked against the layer count."""
    values = [int(v) for v in value] if isinstance(value, list) else [int(value)] * layers
    if len(values) != layers:
        raise ValueError(f"GGUF {key} lists {len(values)} layers, the file has {layers}")
    return values


def rename_hybrid_tensor(name: str, array: np.ndarray, names: HybridNames) -> Iterator[tuple[str, np.ndarray]]:
    """One tensor of a hybrid's file (dequantised, q/k rows un-permuted where they were permuted) under
    its checkpoint's name: the Mamba-2 mixer's undone as above, the others' from ``names``."""
    parts = name.split(".")
    if parts[0] != "blk":
        if parts[0] not in names.top_level:
            raise ValueError(f"unexpected GGUF tensor {name!r}: no {names.family} equivalent")
        yield f"{names.top_level[parts[0]]}.{parts[1]}", array
        return
    layer, part, kind = parts[1], parts[2], ".".join(parts[3:])
    prefix = f"{names.layers}.{layer}"
    if (mamba := (names.undo or undo_mamba2)(part, kind, array)) is not None:
        yield f"{prefix}.{names.mixer}.{mamba[0]}", mamba[1]
    elif part in names.block:
        yield f"{prefix}.{names.block[part]}.{kind}", array
    else:
        raise ValueError(f"unexpected GGUF tensor {name!r}: unknown {names.family} block component {part!r}")
