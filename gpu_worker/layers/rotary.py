"""Rotary position embedding (HF "rotate_half" layout), with linear, Llama-3, YaRN and LongRoPE
frequency scaling, over whole heads or their first ``rotary_dim`` values (Phi-4-mini's partial rotary).

cos/sin are precomputed for every position once, so a step only indexes them by ``positions``;
that is what lets one flat batch mix requests at arbitrary offsets.

LongRoPE (Phi-3/3.5/4-mini 128k) rotates with its long factors once a sequence is longer than the
pretrained length, its short ones before, and scales cos/sin by an attention factor. The table
holds the long rows for every position, then the short rows for the pretrained positions, from
``short_offset`` on: the model runner picks a token's row (its position, or ``short_offset`` + its
position) per request, as transformers picks the factors for a sequence.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
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


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (Qwen2.5 / Qwen3 long context), as transformers' _compute_yarn_parameters: frequencies
    turning fewer than ``beta_slow`` times over the pretrained length are interpolated (divided by
    ``factor``), those turning more than ``beta_fast`` times kept, a linear ramp over the
    dimensions between."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose frequency turns num_rotations times over the pretrained length.
        return head_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    return interpolated * ramp + extrapolated * (1 - ramp)


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's magnitude scale for a context ``scale`` times the pretrained one (0.1 m ln(scale) + 1)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are scaled by: YaRN's attention factor (its config's, else from its mscale
    as transformers derives it), 1 otherwise. (LongRoPE's is applied with its tables.)"""
    if (scaling or {}).get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return yarn_mscale(factor, float(scaling["mscale"])) / yarn_mscale(factor, float(scaling["mscale_all_dim"]))
    return yarn_mscale(factor)


def compute_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = _inv_freq(head_dim, theta)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "proportional":
        # Gemma 4's full layers: the first partial_rotary_factor of the frequencies of a whole head's
        # RoPE (their exponents over the whole head_dim), the rest zero (those values do not turn).
        angles = int(float(scaling.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        rotated = 1.0 / theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim)
        return torch.cat((rotated, torch.zeros(head_dim // 2 - angles))) / float(scaling.get("factor", 1.0))
    if rope_type == "ntk":  # fixed NTK (GTE's own code; vLLM's NTKScalingRotaryEmbedding without mixed_b)
        factor = float(scaling["factor"])
        return _inv_freq(head_dim, theta * factor) / factor ** (2 / head_dim)
    if rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    return inv_freq


def _longrope_tables(rotary_dim: int, max_position: int, theta: float, scaling: dict[str, Any]
                     ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(cos, sin, original length): the long factors' rows for every position, then the short
    factors' rows for the pretrained positions, both scaled by the attention factor."""
    original = int(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or scaling["max_position_embeddings"] / original)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    rows = []
    for key, length in (("long_factor", max_position), ("short_factor", min(original, max_position))):
        factors = torch.tensor(scaling[key], dtype=torch.float32)
        if factors.shape != exponents.shape:
            raise ValueError(f"longrope {key} has {factors.numel()} values; the rotary width {rotary_dim} needs "
                             f"{exponents.numel()}")
        rows.append(torch.outer(torch.arange(length, dtype=torch.float32), 1.0 / (factors * theta ** exponents)))
    freqs = torch.cat(rows)
    return freqs.cos() * float(attention), freqs.sin() * float(attention), original


def longrope_rows(positions: np.ndarray, prompt_lens: np.ndarray, short_offset: int, original_len: int
                  ) -> np.ndarray:
    """Each token's row of a LongRoPE table, as transformers picks the factors for a sequence: the
    long ones once the sequence up to the token is longer than the pretrained length, a prompt
    counting whole however it is chunked (``prompt_lens``: each token's request's prompt length).
    Decided per token, so drafts, or a recompute after a preemption, rotate each token as its own
    decode step did, and a block's KV depends only on its tokens and on whether the prompt is long
    (what its prefix-cache key says)."""
    short = np.maximum(positions + 1, prompt_lens) <= original_len
    return positions + np.where(short, short_offset, 0)


def llama_4_query_scale(positions: torch.Tensor, beta: float, length: int, dtype: torch.dtype) -> torch.Tensor:
    """[num_tokens, 1, 1]: what each token's query heads are multiplied by after RoPE under Llama 4's
    attention temperature (Ministral 3): 1 + beta * log(1 + floor(position / length)), 1 within the
    pretrained ``length``; computed in fp32 and cast to the queries' dtype, as transformers does."""
    scale = 1 + beta * torch.log(1 + torch.floor(positions.to(torch.float32) / length))
    return scale.to(dtype)[:, None, None]


def pairs_to_halves_order(width: int) -> torch.Tensor:
    """Rotary values turned in pairs (0, 1), (2, 3), ... (GPT-J's, Cohere's, DeepSeek's interleaved
    RoPE) -> the evens, then the odds: the order in which Llama's rotation, by halves, turns the same
    pairs. (Reordering a query's and its keys' values alike leaves their dot products as they were.)"""
    return torch.cat((torch.arange(0, width, 2), torch.arange(1, width, 2)))


def head_rows_in_halves(rows: torch.Tensor, head_dim: int, rotary_dim: int | None = None) -> torch.Tensor:
    """A query or key projection's rows (its weight, bias, or a LoRA adapter's B), each head's first
    ``rotary_dim`` (all, by default) from rotary pairs into halves: checkpoints of interleaved RoPE
    (Cohere's, GLM-4's) then rotate as Llama's do."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    order = torch.cat((pairs_to_halves_order(rotary_dim), torch.arange(rotary_dim, head_dim))).to(rows.device)
    per_head = rows.reshape(-1, head_dim, *rows.shape[1:])
    return per_head.index_select(1, order).reshape(rows.shape)


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None = None, dtype: torch.dtype | None = None,
                 mrope_section: tuple[int, ...] | None = None, mrope_interleaved: bool = False) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        # M-RoPE (Qwen2-VL, Qwen3-VL): which of the (time, height, width) positions each frequency
        # turns with ([rotary_dim // 2] axis numbers; see cos_sin). Qwen2-VL gives the axes consecutive
        # sections of the frequencies; Qwen3-VL interleaves them (t h w t h w ..., the time axis taking
        # the frequencies past the others' sections).
        axis = None
        if mrope_section is not None:
            half = rotary_dim // 2
            if len(mrope_section) != 3 or sum(mrope_section) != half:
                raise ValueError(f"mrope_section must split the {half} rotary frequencies in three, "
                                 f"got {list(mrope_section)}")
            if mrope_interleaved:
                axis = [next((a for a in (1, 2) if i % 3 == a and i < 3 * mrope_section[a]), 0) for i in range(half)]
            else:
                axis = [a for a, count in enumerate(mrope_section) for _ in range(count)]
        self.mrope_axis: torch.Tensor | None
        self.register_buffer("mrope_axis", None if axis is None else torch.tensor(axis), persistent=False)
        # LongRoPE: where the short factors' rows start, and the length above which the long ones apply.
        self.short_offset: int | None = None
        self.original_max_position: int | None = None
        if (scaling or {}).get("rope_type") == "longrope":
            cos, sin, self.original_max_position = _longrope_tables(rotary_dim, max_position, theta, scaling)
            self.short_offset = max_position
        else:
            freqs = torch.outer(torch.arange(max_position, dtype=torch.float32),
                                compute_inv_freq(rotary_dim, theta, scaling))
            attention = rope_attention_factor(scaling)
            cos, sin = freqs.cos() * attention, freqs.sin() * attention
        dtype = dtype or torch.get_default_dtype()
        # [rows, rotary_dim // 2] each; buffers so .to(device) moves them with the model.
        self.register_buffer("cos_cache", cos.to(dtype), persistent=False)
        self.register_buffer("sin_cache", sin.to(dtype), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens, 1, rotary_dim // 2] each: looked up once per step, shared by every layer.
        ``positions`` are rows of the table (for LongRoPE, see the module's docstring); for M-RoPE
        they may be [3, num_tokens], each token's time, height and width positions."""
        if positions.dim() == 2:
            assert self.mrope_axis is not None, "three position axes need an M-RoPE model"
            num_tokens, half = positions.shape[1], self.cos_cache.shape[1]
            # ([3, tokens, half]: every axis' rows; each frequency then takes its own axis' value)
            axis = self.mrope_axis.view(1, 1, half).expand(1, num_tokens, half)
            cos = self.cos_cache.index_select(0, positions.reshape(-1)).view(3, num_tokens, half).gather(0, axis)
            sin = self.sin_cache.index_select(0, positions.reshape(-1)).view(3, num_tokens, half).gather(0, axis)
            return cos[0].unsqueeze(1), sin[0].unsqueeze(1)
        return (self.cos_cache.index_select(0, positions).unsqueeze(1),
                self.sin_cache.index_select(0, positions).unsqueeze(1))

    @staticmethod
    def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate the first 2 * cos.shape[-1] values of each head of ``x`` [num_tokens, num_heads,
        head_dim] in place (all of them unless the rotary is partial); returns it.

        Queries and keys are passed together as one head axis, so the rotation runs once per layer.
        """
        half = cos.shape[-1]
        x1, x2 = x[..., :half], x[..., half: 2 * half]
        r1 = x1 * cos - x2 * sin
        r2 = x2 * cos + x1 * sin
        x1.copy_(r1)
        x2.copy_(r2)
        return x

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos_sin(positions)
        return self.rotate_(x, cos, sin)
