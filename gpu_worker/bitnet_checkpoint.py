"""BitNet b1.58 checkpoints (``quant_method`` "bitnet": Microsoft's bitnet-b1.58-2B-4T and its bf16 master
weights, TII's Falcon3 1.58-bit models), served as transformers computes them: each converted linear layer
(the decoder layers' attention and MLP projections) multiplies ternary weights, {-1, 0, 1} times a scale,
by its input rounded per token to 8 bits (symmetric: x -> round(x * 127 / max|x|) * max|x| / 127).

* ``linear_class`` "autobitlinear", ``quantization_mode`` "offline" (bitnet-b1.58-2B-4T as released): each
  weight ternary, packed four values a byte (``X.weight`` uint8 [out / 4, in]; value = 2-bit code - 1;
  byte row r holds rows r, r + out/4, r + out/2, r + 3 out/4 in its bit pairs from the lowest) or stored
  as it is, beside ``X.weight_scale``, which multiplies the output: W = ternary x weight_scale; inputs
  rounded in fp32 (transformers' ActQuant).
* ``linear_class`` "bitlinear" (Falcon3's): packed alike, its ``weight_scale`` dividing the output:
  W = ternary / weight_scale; inputs rounded in fp32 (BitLinear's activation_quant, compiled).
* ``linear_class`` "autobitlinear", ``quantization_mode`` "online" (master weights): each weight W
  becomes round(W / m).clamp(-1, 1) x m, m = mean |W| over the whole tensor, as it is read; inputs
  rounded in fp32.

The weights are dequantized into the model's dtype as they are read (no ternary kernels here: the
matmuls are dense, as for the other quantized checkpoints); the per-token rounding of the inputs is
ColumnParallelLinear's and RowParallelLinear's ``quantize_input``. Served on one tensor-parallel rank (the
rounding needs each token's whole row) and without LoRA adapters; ``use_rms_norm``, and converting or
keeping other modules than transformers does by default (all linear layers but lm_head), are refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from gpu_worker.layers.linear import ColumnParallelLinear, RowParallelLinear, fake_quantize_per_token
from gpu_worker.layers.weight_utils import WeightLike, read_whole

# The architectures whose layers' projections are read by these names (BitNet's, and Llama's: Falcon3's).
BITNET_ARCHITECTURES = ("BitNetForCausalLM", "LlamaForCausalLM")
_CONVERTED = tuple(f".self_attn.{p}_proj.weight" for p in "qkvo") + tuple(
    f".mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
_PACKED_PER_BYTE = 4


def check_bitnet(quantization: dict[str, Any]) -> None:
    """ValueError for a BitNet variant not served."""
    linear_class = quantization.get("linear_class", "bitlinear")
    mode = quantization.get("quantization_mode", "offline")
    if linear_class not in ("bitlinear", "autobitlinear") or mode not in ("offline", "online"):
        raise ValueError(f"bitnet checkpoints of linear_class 'bitlinear' or 'autobitlinear' (quantization_mode "
                         f"'offline' or 'online') are served, not {linear_class!r} / {mode!r}")
    if quantization.get("use_rms_norm"):
        raise ValueError("bitnet checkpoints with use_rms_norm (a norm inside each linear layer) are not served")
    kept = quantization.get("modules_to_not_convert")
    if kept is not None and set(kept) != {"lm_head"}:  # (None: transformers' default, lm_head alone kept)
        raise ValueError(f"bitnet checkpoints are served with lm_head alone unconverted (modules_to_not_convert "
                         f"null or [\"lm_head\"]), not {sorted(kept)}")


def check_bitnet_model(architecture: str, tensor_parallel_size: int, lora: bool) -> None:
    """ValueError where a BitNet checkpoint cannot be served as asked."""
    if architecture not in BITNET_ARCHITECTURES:
        raise ValueError(f"bitnet checkpoints are served for {', '.join(BITNET_ARCHITECTURES)}, not {architecture}")
    if tensor_parallel_size > 1:
        raise ValueError("bitnet checkpoints are served on one tensor-parallel rank: each token's input is rounded "
                         "by its whole row's largest value")
    if lora:
        raise ValueError("LoRA adapters are not served on bitnet checkpoints")


def unpack_ternary(packed: torch.Tensor) -> torch.Tensor:
    """[out, in] float32 values in {-1, 0, 1} of a packed uint8 [out / 4, in] weight."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"a packed bitnet weight is uint8, got {packed.dtype}")
    rows = packed.shape[0]
    out = torch.empty(rows * _PACKED_PER_BYTE, *packed.shape[1:], dtype=torch.float32)
    for i in range(_PACKED_PER_BYTE):
        out[i * rows:(i + 1) * rows] = ((packed >> (2 * i)) & 3).to(torch.float32)
    return out.sub_(1.0)


def ternary_weight(weight: torch.Tensor) -> torch.Tensor:
    """Online quantization of a master weight: round(W / m).clamp(-1, 1) x m, m = mean |W| (at least
    1e-5), in float32 as transformers computes it."""
    w = weight.float()
    scale = 1.0 / w.abs().mean().clamp(min=1e-5)
    return (w * scale).round_().clamp_(-1, 1).div_(scale)


def _stored_dtype(tensor: WeightLike) -> str:
    if isinstance(tensor, torch.Tensor):
        return "U8" if tensor.dtype == torch.uint8 else str(tensor.dtype)
    get_dtype = getattr(getattr(tensor, "_slice", None), "get_dtype", None)
    return get_dtype() if get_dtype is not None else ""


def dequantized(weights: Iterable[tuple[str, WeightLike]], quantization: dict[str, Any]
                ) -> Iterator[tuple[str, WeightLike]]:
    """The checkpoint's tensors with every converted weight dense: stored ones (packed, or ternary as they
    are) with their ``weight_scale`` (dividing for "bitlinear", multiplying for "autobitlinear"), master
    weights (autobitlinear online) rounded to ternary."""
    autobitlinear = quantization.get("linear_class", "bitlinear") == "autobitlinear"
    if autobitlinear and quantization.get("quantization_mode", "offline") == "online":
        for name, tensor in weights:
            yield name, (ternary_weight(read_whole(tensor)) if name.endswith(_CONVERTED) else tensor)
        return
    waiting: dict[str, dict[str, WeightLike]] = {}
    for name, tensor in weights:
        if name.endswith(".weight_scale"):
            base, part = name.removesuffix("_scale"), "scale"
        elif name.endswith(".weight") and (_stored_dtype(tensor) == "U8" or name.endswith(_CONVERTED)):
            base, part = name, "packed"
        else:
            yield name, tensor
            continue
        held = waiting.setdefault(base, {})
        held[part] = tensor
        if len(held) < 2:
            continue
        del waiting[base]
        scale = read_whole(held["scale"]).float().reshape(-1)
        if scale.numel() != 1:
            raise ValueError(f"bitnet checkpoint: {base}_scale holds {scale.numel()} values, one expected")
        stored = read_whole(held["packed"])
        ternary = unpack_ternary(stored) if stored.dtype == torch.uint8 else stored.float()
        yield base, ternary.mul_(scale[0]) if autobitlinear else ternary.div_(scale[0])
    if waiting:
        first = sorted(waiting)[:3]
        raise ValueError(f"bitnet checkpoint: incomplete quantized tensors {first} "
                         f"(holding {[sorted(waiting[m]) for m in first]})")


def quantize_linear_inputs(model: nn.Module) -> None:
    """Marks the decoder layers' attention and MLP projections to round their inputs per token, in fp32 for
    both layer classes (AutoBitLinear's ActQuant computes in fp32; BitLinear's activation_quant is
    torch.compile'd, and inductor computes its bf16 arithmetic in fp32 without rounding between the steps);
    the embedding and the LM head stay as they are."""
    layers = model.model.layers
    for module in layers.modules():
        if isinstance(module, ColumnParallelLinear | RowParallelLinear):
            _round_inputs(module)


def _round_inputs(module: ColumnParallelLinear | RowParallelLinear) -> None:
    """The layer's forward, its input rounded first (an instance's own: other models' layers pay nothing)."""
    forward = module.forward
    module.forward = lambda x: forward(fake_quantize_per_token(x))
    module.quantize_input = True
