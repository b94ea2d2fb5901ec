"""Rotary position embedding (HF "rotate_half" layout), with linear and Llama-3 frequency scaling.

cos/sin are precomputed for every position once, so a step only indexes them by ``positions``;
that is what lets one flat batch mix requests at arbitrary offsets.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths are divided by ``factor``, short ones kept, the band between
    interpolated smoothly."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = _inv_freq(head_dim, theta)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = compute_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        dtype = dtype or torch.get_default_dtype()
        # [max_position, head_dim // 2] each; buffers so .to(device) moves them with the model.
        self.register_buffer("cos_cache", freqs.cos().to(dtype), persistent=False)
        self.register_buffer("sin_cache", freqs.sin().to(dtype), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens, 1, head_dim // 2] each: looked up once per step, shared by every layer."""
        return (self.cos_cache.index_select(0, positions).unsqueeze(1),
                self.sin_cache.index_select(0, positions).unsqueeze(1))

    @staticmethod
    def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` of shape [num_tokens, num_heads, head_dim] in place; returns it.

        Queries and keys are passed together as one head axis, so the rotation runs once per layer.
        """
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        r1 = x1 * cos - x2 * sin
        r2 = x2 * cos + x1 * sin
        x1.copy_(r1)
        x2.copy_(r2)
        return x

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos_sin(positions)
        return self.rotate_(x, cos, sin)
