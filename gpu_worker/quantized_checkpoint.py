"""Which quantized checkpoints load, and the weights they load as: a checkpoint's
``quantization_config`` names its method, and the served ones are dequantized into the model's
dtype as the weights are read (gpu_worker.fp8_checkpoint, gpu_worker.compressed_tensors_checkpoint);
any other method is refused by name before anything loads."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from gpu_worker.layers.weight_utils import WeightLike

SERVED_METHODS = ("fp8", "compressed-tensors")


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
    raise ValueError(f"quantized checkpoints of quant_method {method!r} are not served (those of "
                     f"{' and '.join(SERVED_METHODS)} are): serve the unquantized checkpoint, or a GGUF file of it")


def dequantized_weights(weights: Iterable[tuple[str, WeightLike]], method: str,
                        quantization: dict[str, Any], fp8_block: tuple[int, int] | None
                        ) -> Iterator[tuple[str, WeightLike]]:
    """The checkpoint's tensors with every quantized weight dense (``method`` as weight_quantization
    gave it)."""
    if method == "fp8":
        from gpu_worker.fp8_checkpoint import dequantized

        return dequantized(weights, fp8_block or (0, 0))
    from gpu_worker.compressed_tensors_checkpoint import decompressed

    return decompressed(weights, quantization)
