"""KV cache sizing, allocation, and the storage dtype (vLLM's ``--kv-cache-dtype``).

An fp8 cache stores each K/V element in one byte: the pool holds two (bf16 models) or four (fp32)
times the blocks for the same memory. Values are stored unscaled (vLLM's default scales of 1.0
when a checkpoint brings none) and saturate at the format's largest finite value, as vLLM's
saturating conversion does. Attention reads them back into the model's dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from gpu_worker.config import ModelConfig

# vLLM's names: "fp8" is e4m3 (more mantissa), as on CUDA in vLLM.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def resolve_kv_cache_dtype(name: str | torch.dtype | None, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's storage dtype: ``auto`` (or None) is the model's."""
    if isinstance(name, torch.dtype):
        return name
    if name is None:
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES[name] or model_dtype


def store_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
    """Write x [T, num_kv_heads, head_dim] into the cache slots ``slot_mapping`` [T], converting to
    the cache's dtype (fp8 saturates). torch has no index_copy_ for fp8, so fp8 goes in as bytes."""
    rows = cache.view(-1, *x.shape[1:])
    if cache.dtype == x.dtype:
        rows.index_copy_(0, slot_mapping, x)
    elif cache.dtype in FP8_DTYPES:
        limit = torch.finfo(cache.dtype).max
        packed = x.clamp(-limit, limit).to(cache.dtype).view(torch.uint8)
        rows.view(torch.uint8).index_copy_(0, slot_mapping, packed)
    else:
        rows.index_copy_(0, slot_mapping, x.to(cache.dtype))


def num_kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    # With fewer KV heads than ranks each rank keeps one (replicated) KV head.
    return max(1, num_kv_heads // tp_size)


def kv_cache_bytes_per_block(num_layers: int, block_size: int, num_kv_heads_per_rank: int, head_dim: int,
                             dtype: torch.dtype) -> int:
    """K and V, every layer, one block, on one rank."""
    return 2 * num_layers * block_size * num_kv_heads_per_rank * head_dim * dtype.itemsize


def model_bytes_per_block(config: ModelConfig, block_size: int, tp_size: int, dtype: torch.dtype,
                          num_layers: int | None = None) -> int:
    """``num_layers``: the layers one pipeline stage holds, or the hybrid KV cache manager's shared tensors
    (default: all that attend; recurrent layers keep no KV). A model whose layers' caches differ
    (ModelConfig.attention_layer_geometry) sums each's."""
    geometry = config.attention_layer_geometry
    if len(set(geometry)) > 1:
        return sum(kv_cache_bytes_per_block(1, block_size, num_kv_heads_per_rank(heads, tp_size), head_dim, dtype)
                   for heads, head_dim in geometry)
    heads, head_dim = geometry[0] if geometry else (config.num_key_value_heads, config.head_dim)
    if num_layers is None:
        num_layers = len(geometry) if geometry else config.num_attention_layers
    return kv_cache_bytes_per_block(num_layers, block_size, num_kv_heads_per_rank(heads, tp_size), head_dim, dtype)


def num_blocks_for_budget(budget_bytes: int, bytes_per_block: int) -> int:
    num_blocks = int(budget_bytes) // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"KV cache budget of {budget_bytes} bytes is less than one block "
                         f"({bytes_per_block} bytes)")
    return num_blocks


def read_kv(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows (already gathered) as ``dtype``: a no-op when the cache holds that dtype."""
    return blocks if blocks.dtype == dtype else blocks.to(dtype)


def copy_kv_blocks(src: list[tuple[torch.Tensor, torch.Tensor]], dst: list[tuple[torch.Tensor, torch.Tensor]],
                   src_blocks: list[int], dst_blocks: list[int]) -> None:
    """Copy blocks ``src_blocks`` of every layer's (K, V) in ``src`` to blocks ``dst_blocks`` of ``dst``
    (KV offloading: the device cache and the host-memory tier, either way)."""
    if not src_blocks:
        return
    src_device, dst_device = src[0][0].device, dst[0][0].device
    src_index = torch.tensor(src_blocks, device=src_device)
    dst_index = torch.tensor(dst_blocks, device=dst_device)
    to_pinned_host = src_device.type == "cuda" and dst_device.type == "cpu"
    rows: list[torch.Tensor] = []
    for cache in src:
        for tensor in cache:
            gathered = tensor.index_select(0, src_index)
            if to_pinned_host:  # (queued into page-locked memory; waited for once, below)
                staged = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
                rows.append(staged.copy_(gathered, non_blocking=True))
            else:  # (host to device reads pageable rows: the copy is done before the pass's kernels)
                rows.append(gathered.to(dst_device))
    if to_pinned_host:
        # A device-to-host copy is only in the host's memory once the stream has run it.
        torch.cuda.current_stream(src_device).synchronize()
    for i, cache in enumerate(dst):
        for j, tensor in enumerate(cache):
            tensor[dst_index] = rows[2 * i + j]  # (index_put: index_copy_ has no fp8 kernel on the CPU)


def allocate_layer_kv_caches(layers: list[Any], num_blocks: int, block_size: int, dtype: torch.dtype,
                             device: torch.device, pin_memory: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A cache for each attention layer, of its own heads and width (``num_kv_heads``, ``head_dim``:
    Gemma 4's full layers' differ from its windowed ones')."""
    return [allocate_kv_cache(1, num_blocks, block_size, layer.num_kv_heads, layer.head_dim, dtype, device,
                              pin_memory)[0] for layer in layers]


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device,
                      pin_memory: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``pin_memory``: page-locked host memory (KV offloading's tier beside a CUDA cache)."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # Zeroed, not empty: padded key slots are masked, but NaN garbage times a zero weight is still NaN.
    return [(torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory),
             torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory))
            for _ in range(num_layers)]
