"""The vision tower of Qwen3-VL (transformers' ``Qwen3VLVisionModel``), which encodes images at their
native resolution and also hands the language model DeepStack features from intermediate blocks.

An image arrives as the processor made it: ``t * h * w`` flattened patches (each ``in_channels x
temporal_patch_size x patch_size x patch_size`` pixel values) in spatial-merge order, i.e. every
``merge x merge`` square of neighbouring patches is consecutive. The tower:

1. embeds each patch by a linear projection with a bias (the checkpoint's Conv3d);
2. adds a learned absolute position: ``pos_embed`` is a square ``side x side`` grid of rows
   (``side = sqrt(num_position_embeddings)``), bilinearly resampled (corners aligned) to the image's
   ``h x w`` patch grid, every frame of an image getting the same positions;
3. runs ``depth`` pre-norm blocks (LayerNorm, attention rotated by a 2-D (row, column) rotary
   embedding and confined to one image frame, LayerNorm, a two-layer MLP);
4. after each block listed in ``deepstack_visual_indexes``, a DeepStack merger turns the hidden states
   into rows of the language model's width: it concatenates each ``merge x merge`` square first and
   normalises the concatenation;
5. the final merger normalises each patch, then concatenates each square and projects it.

Every merger gives one row per square, the images' rows in order.

Parameter names are the checkpoint's below ``visual.``, so a state dict loads by name; nothing is
stored in buffers (the rotary angles and the position resampling are computed in float32 per call).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.models.qwen2_vl_vision import (
    QwenVisionAttention,
    SegmentGroup,
    _activation,
    _merge_order_positions,
    patch_rotary,
    segment_groups,
)
from gpu_worker.vision_config import Qwen3VisionConfig

_NORM_EPS = 1e-6
class _PatchEmbed(nn.Module):
    def __init__(self, vc: Qwen3VisionConfig) -> None:
        super().__init__()
        kernel = (vc.temporal_patch_size, vc.patch_size, vc.patch_size)
        # The checkpoint's Conv3d: its kernel equals its stride and spans one whole flattened patch,
        # so it is applied as a single matmul (plus bias) over each patch's pixel values.
        self.proj = nn.Conv3d(vc.in_channels, vc.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixel_values.to(device=weight.device, dtype=weight.dtype), weight.flatten(1), self.proj.bias)


class _MLP(nn.Module):
    def __init__(self, vc: Qwen3VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(vc.hidden_size, vc.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(vc.intermediate_size, vc.hidden_size, bias=True)
        self.act = _activation(vc.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionBlock(nn.Module):
    def __init__(self, vc: Qwen3VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(vc.hidden_size, eps=_NORM_EPS)
        self.attn = QwenVisionAttention(vc)
        self.norm2 = nn.LayerNorm(vc.hidden_size, eps=_NORM_EPS)
        self.mlp = _MLP(vc)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                groups: list[SegmentGroup]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, groups)
        return x + self.mlp(self.norm2(x))


class _PatchMerger(nn.Module):
    """Maps every merge x merge square (consecutive rows) to one row of the language model's width. The
    final merger normalises each patch before concatenating the square (``norm_after_concat`` False);
    the DeepStack mergers normalise the concatenated square (True)."""

    def __init__(self, vc: Qwen3VisionConfig, norm_after_concat: bool) -> None:
        super().__init__()
        self.merged_width = vc.hidden_size * vc.spatial_merge_size ** 2
        self.norm_after_concat = norm_after_concat
        self.norm = nn.LayerNorm(self.merged_width if norm_after_concat else vc.hidden_size, eps=_NORM_EPS)
        self.linear_fc1 = nn.Linear(self.merged_width, self.merged_width)
        self.linear_fc2 = nn.Linear(self.merged_width, vc.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_after_concat:
            squares = self.norm(x.reshape(-1, self.merged_width))
        else:
            squares = self.norm(x).view(-1, self.merged_width)
        return self.linear_fc2(F.gelu(self.linear_fc1(squares)))  # exact (erf) GELU here


def _axis_taps(size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear resampling of a ``side``-long axis to ``size`` points with the end points aligned: for
    each point its two source indices [size, 2] and their weights [size, 2] (float32)."""
    src = torch.arange(size, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
    low = src.floor()
    frac = src - low
    low_i = low.long()
    taps = torch.stack((low_i, (low_i + 1).clamp(max=side - 1)), dim=-1)
    return taps, torch.stack((1 - frac, frac), dim=-1)


@dataclass
class _Layout:
    """Where each patch sits, which position rows it blends, and what it attends to, for one call."""

    positions: torch.Tensor  # [patches, 2] (row, column) within its image
    pos_index: torch.Tensor  # [patches, 4] rows of pos_embed blended into each patch
    pos_weight: torch.Tensor  # [patches, 4] their weights (float32)
    frame_groups: list[SegmentGroup]  # each image frame is one attention segment


class Qwen3VisionTower(nn.Module):
    """Qwen3-VL's vision tower with its merger and DeepStack mergers (checkpoint prefix ``visual.``)."""

    def __init__(self, vc: Qwen3VisionConfig) -> None:
        super().__init__()
        if vc.hidden_size % vc.num_heads or vc.head_dim % 4:
            raise ValueError(f"the vision tower's head size must be a multiple of 4 (hidden_size "
                             f"{vc.hidden_size} over {vc.num_heads} heads)")
        if vc.position_grid_side < 1:
            raise ValueError(f"num_position_embeddings must be positive, got {vc.num_position_embeddings}")
        taps = vc.deepstack_visual_indexes
        if any(i < 0 or i >= vc.depth for i in taps) or any(a >= b for a, b in pairwise(taps)):
            # (transformers emits the features in block order and skips out-of-range or repeated
            # entries; for increasing, in-range indexes that is also the list's order.)
            raise ValueError(f"deepstack_visual_indexes must be increasing block indexes below depth "
                             f"{vc.depth}, got {list(taps)}")
        self.vc = vc
        self.patch_embed = _PatchEmbed(vc)
        self.pos_embed = nn.Embedding(vc.num_position_embeddings, vc.hidden_size)
        self.blocks = nn.ModuleList(Qwen3VisionBlock(vc) for _ in range(vc.depth))
        self.merger = _PatchMerger(vc, norm_after_concat=False)
        self.deepstack_merger_list = nn.ModuleList(_PatchMerger(vc, norm_after_concat=True) for _ in taps)
        self._deepstack_at = {block: j for j, block in enumerate(taps)}

    def _layout(self, grid_thw: list[tuple[int, int, int]], device: torch.device) -> _Layout:
        merge = self.vc.spatial_merge_size
        side = self.vc.position_grid_side
        positions, pos_index, pos_weight, frame_lengths = [], [], [], []
        for t, h, w in grid_thw:
            if h % merge or w % merge:
                raise ValueError(f"an image's grid ({t}, {h}, {w}) must have h and w multiples of "
                                 f"spatial_merge_size {merge}")
            rc = _merge_order_positions(t, h, w, merge)
            row_taps, row_w = _axis_taps(h, side)
            col_taps, col_w = _axis_taps(w, side)
            rows, cols = rc[:, 0], rc[:, 1]
            # The four grid rows around each patch: (upper, lower) x (left, right).
            pos_index.append((row_taps[rows][:, :, None] * side + col_taps[cols][:, None, :]).flatten(1))
            pos_weight.append((row_w[rows][:, :, None] * col_w[cols][:, None, :]).flatten(1))
            positions.append(rc)
            frame_lengths += [h * w] * t
        return _Layout(torch.cat(positions).to(device), torch.cat(pos_index).to(device),
                       torch.cat(pos_weight).to(device), segment_groups(frame_lengths, device))

    def _positions(self, layout: _Layout) -> torch.Tensor:
        """The resampled learned positions [patches, hidden_size], blended in float32."""
        table = self.pos_embed.weight.float()
        return F.embedding_bag(layout.pos_index, table, per_sample_weights=layout.pos_weight, mode="sum")

    def forward(self, pixel_values: torch.Tensor,
                grid_thw: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixel_values [total patches, in_channels * temporal_patch_size * patch_size**2] (the images'
        processor outputs concatenated, in merge order), grid_thw each image's (t, h, w) in patches ->
        (merged rows [total/merge**2, out_hidden_size], the DeepStack rows: one [total/merge**2, out_hidden_size]
        per deepstack_visual_indexes entry, in that order), every image's rows in order."""
        grid_thw = [(int(t), int(h), int(w)) for t, h, w in grid_thw]
        weight = self.patch_embed.proj.weight
        if not grid_thw:
            empty = weight.new_empty(0, self.vc.out_hidden_size)
            return empty, [empty.clone() for _ in self.deepstack_merger_list]
        total = sum(t * h * w for t, h, w in grid_thw)
        if pixel_values.shape != (total, self.vc.patch_input_size):
            raise ValueError(f"pixel_values must be [{total}, {self.vc.patch_input_size}] for grids {grid_thw}, "
                             f"got {list(pixel_values.shape)}")
        layout = self._layout(grid_thw, weight.device)
        x = self.patch_embed(pixel_values)
        x = x + self._positions(layout).to(x.dtype)
        cos, sin = patch_rotary(layout.positions, self.vc.head_dim, self.vc.rope_theta)
        deepstack: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, layout.frame_groups)
            j = self._deepstack_at.get(i)
            if j is not None:
                deepstack.append(self.deepstack_merger_list[j](x))
        return self.merger(x), deepstack
