"""Checkpoints in the compressed-tensors format (quant_method "compressed-tensors", written by
llm-compressor: the "-FP8-dynamic", "-quantized.w4a16", "-quantized.w8a8" releases): each
quantized linear layer is stored compressed (fp8 or int8 values with their ``weight_scale``, or
int4/int8 values packed into int32 ``weight_packed`` with per-group scales), as its config's
``config_groups`` say for the modules their ``targets`` match and ``ignore`` does not.

They are served dequantized, as the fp8 checkpoints are (gpu_worker.fp8_checkpoint): each layer's
tensors are gathered as the files yield them and decompressed by the compressed-tensors library's
own compressor for the group's scheme, into one dense ``weight``. Activation and KV-cache scales
(``input_scale``, ``k_scale``, ...) are not needed then, and are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from gpu_worker.layers.weight_utils import (
    QUANTIZED_DTYPES,
    WeightLike,
    is_activation_scale,
    read_whole,
    stored_dtype,
)
from gpu_worker.quantized_checkpoint import ScaledWeight

# The weight's stored dtypes in the formats that keep the "weight" name (fp8 and int8 values).
_QUANTIZED_WEIGHT_DTYPES = tuple(QUANTIZED_DTYPES.values())


class _Schemes:
    """The config's groups: for a module name, the (scheme, compressor, its tensor names) that
    compressed it, or None; the group chosen as compressed-tensors chooses one (a target naming the
    module exactly, then a regex target, then a class target such as "Linear")."""

    def __init__(self, quantization: dict[str, Any]) -> None:
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.compressors.format import infer_module_format
        from compressed_tensors.config import CompressionFormat
        from compressed_tensors.quantization import QuantizationConfig

        for key, what in (("sparsity_config", "sparsity (2:4 and bitmask)"),
                          ("transform_config", "rotations (QuIP, SpinQuant)")):
            if quantization.get(key):
                raise ValueError(f"compressed-tensors checkpoints with {what} ({key}) are not served")
        config = QuantizationConfig.model_validate(quantization)
        declared = quantization.get("format")
        self.ignore = list(config.ignore or [])
        self.groups = []
        for name, scheme in config.config_groups.items():
            if getattr(scheme.weights, "actorder", None) == "group":
                raise ValueError(f"compressed-tensors config group {name!r}: weights in activation order (actorder "
                                 "group, weight_g_idx) are not served")
            if scheme.format is None:  # (the group's own, else the checkpoint's, else what its scheme implies)
                formats = {f.value for f in CompressionFormat} - {"mixed-precision"}
                scheme.format = CompressionFormat(declared if declared in formats
                                                  else infer_module_format(torch.nn.Linear, scheme))
            compressor = BaseCompressor.get_value_from_registry(scheme.format)
            try:
                names = tuple(compressor.compression_param_names(scheme))
            except NotImplementedError:
                raise ValueError(f"compressed-tensors checkpoints in the {scheme.format.value!r} format (config group "
                                 f"{name!r}) are not served") from None
            self.groups.append((scheme, compressor, names))
        self._cache: dict[str, Any] = {}

    def for_module(self, module: str) -> Any:
        if module not in self._cache:
            from compressed_tensors.utils.match import match_name

            found = None
            if not any(match_name(module, pattern) for pattern in self.ignore):
                ranked = []
                for group in self.groups:
                    targets = group[0].targets
                    rank = (0 if module in targets else 1 if any(t.startswith("re:") and match_name(module, t)
                                                                  for t in targets)
                            else 2 if "Linear" in targets else None)
                    if rank is not None:
                        ranked.append((rank, len(ranked), group))
                found = min(ranked)[2] if ranked else None
            self._cache[module] = found
        return self._cache[module]


def _scaled_block(scheme: Any, names: tuple[str, ...]) -> tuple[int, int] | None:
    """For a layer stored as plain values and their scales (fp8 or int8, symmetric: per tensor,
    channel or block), the block its scales cover ((0, 0): one, or one per row); None for the
    formats only the library's compressor reads (packed values, zero points, groups, ...)."""
    weights = scheme.weights
    if names != ("weight", "weight_scale") or not weights.symmetric or weights.num_bits != 8:
        return None
    if weights.strategy in ("tensor", "channel"):
        return (0, 0)
    if weights.strategy == "block" and weights.block_structure:
        return int(weights.block_structure[0]), int(weights.block_structure[1])
    return None


def check_compressed_tensors(quantization: dict[str, Any]) -> None:
    """ValueError, naming what, for a compressed-tensors config this cannot decompress (or for a
    missing or too old compressed-tensors package)."""
    try:
        from compressed_tensors.compressors import BaseCompressor
    except ImportError:
        raise ValueError("compressed-tensors checkpoints need the compressed-tensors package, 0.20.1 or later "
                         "(pip install 'llm-cluster[compressed]')") from None
    if not isinstance(BaseCompressor.__dict__.get("decompress"), classmethod):
        raise ValueError("compressed-tensors checkpoints need compressed-tensors 0.20.1 or later (its per-layer "
                         "decompress API)")
    _Schemes(quantization)


def decompressed(weights: Iterable[tuple[str, WeightLike]], quantization: dict[str, Any]
                 ) -> Iterator[tuple[str, WeightLike]]:
    """The checkpoint's tensors with every compressed layer's tensors replaced by its dense
    ``weight`` (float32, as the compressor gives it), activation and KV-cache scales left out,
    the rest as they are. ValueError for a layer whose tensors are incomplete."""
    schemes = _Schemes(quantization)
    waiting: dict[str, dict[str, WeightLike]] = {}
    for name, tensor in weights:
        module, _, param = name.rpartition(".")
        group = schemes.for_module(module)
        if (group is None or param not in group[2]) and is_activation_scale(param):
            continue  # (an activation or KV-cache scale, unless the layer's decompression reads it)
        stored_quantized = param == "weight" and stored_dtype(tensor) in _QUANTIZED_WEIGHT_DTYPES
        if group is None and stored_quantized:
            raise ValueError(f"compressed-tensors checkpoint: {name} is stored quantized, but no config group "
                             "targets its layer")
        if group is None or param not in group[2] or (param == "weight" and not stored_quantized):
            yield name, tensor
            continue
        held = waiting.setdefault(module, {})
        held[param] = tensor
        scheme, compressor, names = group
        if all(n in held for n in names):
            del waiting[module]
            block = _scaled_block(scheme, names)
            if block is not None:  # (values x scales: read per slice, each TP rank its own shard)
                yield f"{module}.weight", ScaledWeight(held["weight"], read_whole(held["weight_scale"]), block)
                continue
            state = {n: read_whole(held[n]) for n in names}
            yield f"{module}.weight", compressor.decompress(state, scheme)["weight"].to(torch.float32)
    if waiting:
        first = sorted(waiting)[:3]
        raise ValueError(f"compressed-tensors checkpoint: incomplete compressed layers {first} "
                         f"(holding {[sorted(waiting[m]) for m in first]})")
