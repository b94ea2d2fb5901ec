"""KV cache sizing and allocation."""

from __future__ import annotations

import torch

from gpu_worker.config import ModelConfig


def num_kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    # With fewer KV heads than ranks each rank keeps one (replicated) KV head.
    return max(1, num_kv_heads // tp_size)


def kv_cache_bytes_per_block(num_layers: int, block_size: int, num_kv_heads_per_rank: int, head_dim: int,
                             dtype: torch.dtype) -> int:
    """K and V, every layer, one block, on one rank."""
    return 2 * num_layers * block_size * num_kv_heads_per_rank * head_dim * dtype.itemsize


def model_bytes_per_block(config: ModelConfig, block_size: int, tp_size: int, dtype: torch.dtype) -> int:
    return kv_cache_bytes_per_block(config.num_hidden_layers, block_size,
                                    num_kv_heads_per_rank(config.num_key_value_heads, tp_size),
                                    config.head_dim, dtype)


def num_blocks_for_budget(budget_bytes: int, bytes_per_block: int) -> int:
    num_blocks = int(budget_bytes) // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"KV cache budget of {budget_bytes} bytes is less than one block "
                         f"({bytes_per_block} bytes)")
    return num_blocks


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # Zeroed, not empty: padded key slots are masked, but NaN garbage times a zero weight is still NaN.
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]
