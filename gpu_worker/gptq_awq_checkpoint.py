"""GPTQ and AWQ checkpoints (``quant_method`` "gptq": AutoGPTQ / GPTQModel / optimum; "awq": AutoAWQ's
GEMM layout), served dequantized: each quantized linear layer's packed integers, zero points and
scales become its dense ``weight`` as the checkpoint is read (there are no int4 kernels here: the
model runs in its dtype, as the other quantized checkpoints do).

GPTQ (bits 2, 4 or 8): ``qweight`` int32 [in x bits / 32, out], each int32 holding 32 / bits input rows
of one output column, the first in its lowest bits; ``qzeros`` int32 [groups, out x bits / 32], packed
along the output columns the same way, stored less one (the original "gptq" format: one subtracted
from each whole int32's every value, borrows included, as GPTQModel writes and reads it; "gptq_v2"
stores them as they are); ``scales`` [groups, out]; ``g_idx`` int32 [in], each input row's group
(act-order checkpoints, ``desc_act``; without it row // group_size). Old AutoGPTQ / optimum layers
carry an all-zero ``bias`` even where the model has none: the loader skips it (``load_weights``'
``zero_biases_optional``), as vLLM skips it.
W[row, col] = scales[g, col] x (q[row, col] - zero[g, col]), g = g_idx[row].

AWQ (4 bits, ``version`` "gemm"): ``qweight`` int32 [in, out / 8], packed along the output columns in
AutoAWQ's interleaved order (column c of each eight in nibble [0, 4, 1, 5, 2, 6, 3, 7][c]); ``qzeros``
[groups, out / 8] the same; ``scales`` [groups, out]; W[row, col] = scales[g, col] x (q - zero), g =
row // group_size. Both store [in, out]: the dense weight is its transpose, [out, in].
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from gpu_worker.layers.weight_utils import WeightLike, read_whole

# AutoAWQ's GEMM packing: output column c of each eight lies in this nibble of its int32.
AWQ_NIBBLE_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)
_PARTS = {"gptq": ("qweight", "qzeros", "scales"), "awq": ("qweight", "qzeros", "scales")}


def _layout(quantization: dict[str, Any]) -> str:
    """A GPTQ checkpoint's format (``checkpoint_format``, or GPTQModel's and transformers 5's ``format``)."""
    return str(quantization.get("checkpoint_format") or quantization.get("format") or "gptq").lower()


def check_gptq_awq(quantization: dict[str, Any]) -> None:
    """ValueError for a GPTQ or AWQ variant not served."""
    method = str(quantization.get("quant_method", "")).lower()
    bits = int(quantization.get("bits", quantization.get("w_bit", 4)))
    group = int(quantization.get("group_size", quantization.get("q_group_size", 128)))
    if group == 0 or group < -1:
        raise ValueError(f"{method} checkpoint: group_size must be positive or -1 (one group), got {group}")
    if method == "awq":
        version = str(quantization.get("version", "gemm")).lower()
        backend = str(quantization.get("backend") or "autoawq").lower()
        if bits != 4 or version != "gemm" or not quantization.get("zero_point", True) or backend == "llm-awq":
            raise ValueError(f"awq checkpoints of 4 bits with zero points in AutoAWQ's GEMM layout are served, not "
                             f"bits {bits}, version {version!r}, zero_point {quantization.get('zero_point')}, "
                             f"backend {backend!r}")
        return
    if bits not in (2, 4, 8):
        raise ValueError(f"gptq checkpoints of 2, 4 or 8 bits are served, not {bits}")
    layout = _layout(quantization)
    if layout not in ("gptq", "gptq_v2") or quantization.get("is_marlin_format"):
        raise ValueError(f"gptq checkpoints in the gptq or gptq_v2 format are served, not "
                         f"{'marlin' if quantization.get('is_marlin_format') else repr(layout)}")
    if str(quantization.get("pack_dtype") or "int32").removeprefix("torch.") != "int32":
        raise ValueError(f"gptq checkpoints packed in int32 are served, not {quantization['pack_dtype']}")
    overrides = [key for key in (quantization.get("dynamic") or {}) if not str(key).startswith("-:")]
    if overrides:
        raise ValueError(f"gptq checkpoints with GPTQModel's per-module overrides (dynamic {overrides}) are not "
                         "served")


def _unpacked(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The ``bits``-wide unsigned integers packed in ``packed``'s int32s along ``dim`` (the lowest
    bits first), that dimension 32 / bits times longer."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., n, per]
    if dim in (-1, packed.dim() - 1):
        return values.reshape(*packed.shape[:-1], packed.shape[-1] * per)
    # (along the rows: each int32's values are consecutive rows of its column)
    return values.permute(0, 2, 1).reshape(packed.shape[0] * per, packed.shape[1])


def _grouped(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor | None,
             group_size: int) -> torch.Tensor:
    """scales x (q - zeros) by each row's group ([in, out] -> [out, in], float32): rows in runs of
    ``group_size`` (``groups`` None; -1: one group) broadcast a group at a time, else row by row."""
    rows, columns = q.shape
    if groups is None:
        size = group_size if group_size > 0 else rows
        count = -(-rows // size)
        padded = torch.nn.functional.pad(q, (0, 0, 0, count * size - rows)).view(count, size, columns)
        weight = (padded.to(torch.float32) - zeros[:count, None].to(torch.float32)) * scales[:count, None].float()
        return weight.reshape(count * size, columns)[:rows].t().contiguous()
    return ((q.to(torch.float32) - zeros[groups].to(torch.float32)) * scales.to(torch.float32)[groups]).t().contiguous()


def gptq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                bits: int, group_size: int, v2: bool = False) -> torch.Tensor:
    """A GPTQ layer's dense weight [out, in], float32."""
    q = _unpacked(qweight, bits, dim=0)  # [in, out]
    if not v2:  # (one added back to each int32's every value, carries included, as GPTQModel reads them)
        ones = sum(1 << shift for shift in range(0, 32, bits))
        qzeros = ((qzeros.to(torch.int64) + ones) & 0xFFFFFFFF).to(torch.int64)
        qzeros = torch.where(qzeros >= 1 << 31, qzeros - (1 << 32), qzeros).to(torch.int32)
    zeros = _unpacked(qzeros, bits, dim=-1)[:, :q.shape[1]]  # [groups, out]
    rows = q.shape[0]
    if g_idx is not None:
        groups = g_idx.to(torch.long)
        if groups.shape != (rows,) or int(groups.max()) >= scales.shape[0] or int(groups.min()) < 0:
            raise ValueError(f"gptq layer: g_idx of shape {tuple(groups.shape)} does not name one of its "
                             f"{scales.shape[0]} groups for each of its {rows} input rows")
        return _grouped(q, zeros, scales, groups, group_size)
    return _grouped(q, zeros, scales, None, group_size)


def awq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """An AWQ (GEMM) layer's dense weight [out, in], float32."""
    order = torch.tensor(AWQ_NIBBLE_OF_COLUMN)

    def columns(packed: torch.Tensor) -> torch.Tensor:
        values = _unpacked(packed, 4, dim=-1)  # [rows, out] in nibble order
        index = (torch.arange(values.shape[-1]).view(-1, 8)[:, order]).reshape(-1)
        return values[:, index]

    return _grouped(columns(qweight), columns(qzeros), scales, None, group_size)


def dequantized(weights: Iterable[tuple[str, WeightLike]], quantization: dict[str, Any]
                ) -> Iterator[tuple[str, WeightLike]]:
    """The checkpoint's tensors with each quantized layer's (``qweight``, ``qzeros``, ``scales``,
    GPTQ's ``g_idx``) replaced by its dense ``weight``, the rest as they are. ValueError for a layer
    whose tensors are incomplete."""
    method = str(quantization["quant_method"]).lower()
    bits = int(quantization.get("bits", quantization.get("w_bit", 4)))
    group_size = int(quantization.get("group_size", quantization.get("q_group_size", 128)))
    v2 = _layout(quantization) == "gptq_v2"
    # (GPTQ's g_idx orders the groups only in act-order checkpoints; without desc_act, row // group_size)
    act_order = method == "gptq" and bool(quantization.get("desc_act"))
    needed = (*_PARTS[method], "g_idx") if act_order else _PARTS[method]
    waiting: dict[str, dict[str, WeightLike]] = {}
    for name, tensor in weights:
        module, _, param = name.rpartition(".")
        if param == "g_idx" and method == "gptq" and not act_order:
            continue
        if param not in needed:
            yield name, tensor
            continue
        held = waiting.setdefault(module, {})
        held[param] = tensor
        if not all(n in held for n in needed):
            continue
        del waiting[module]
        parts = {n: read_whole(t) for n, t in held.items()}
        if method == "awq":
            dense = awq_weight(parts["qweight"], parts["qzeros"], parts["scales"], group_size)
        else:
            dense = gptq_weight(parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"), bits,
                                group_size, v2)
        yield f"{module}.weight", dense
    if waiting:
        first = sorted(waiting)[:3]
        raise ValueError(f"{method} checkpoint: incomplete quantized layers {first} "
                         f"(holding {[sorted(waiting[m]) for m in first]})")

