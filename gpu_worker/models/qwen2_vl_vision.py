"""The vision towers of Qwen2-VL and Qwen2.5-VL (transformers' ``Qwen2VisionTransformerPretrainedModel``
and ``Qwen2_5_VisionTransformerPretrainedModel``), which encode images at their native resolution.

An image arrives as the processor made it: ``t * h * w`` flattened patches (each ``in_channels x
temporal_patch_size x patch_size x patch_size`` pixel values), listed in spatial-merge order, i.e.
every ``merge x merge`` square of neighbouring patches is consecutive. Each patch is embedded by a
linear projection, then runs through ``depth`` pre-norm transformer blocks whose attention is
rotated by a 2-D (row, column) rotary embedding and never crosses an image's frame; finally the
merger normalises each patch, concatenates each ``merge x merge`` square and projects it into the
language model's width, giving one row per square.

Qwen2-VL: LayerNorms, a two-layer MLP, every block attends over the whole frame.
Qwen2.5-VL (``windowed``): RMSNorms, a gated MLP, and blocks outside ``fullatt_block_indexes``
attend only within square windows of ``window_size`` pixels (windows at the right and bottom edges
are cut short). The patches are kept in window order throughout (a window's patches consecutive),
which changes nothing for the full-attention blocks, and the merged rows are put back in the
image's order at the end.

Parameter names are the checkpoint's below ``visual.``, so a state dict loads by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.models.llava import _activation
from gpu_worker.vision_config import InternVLVisionConfig, Qwen3VisionConfig, QwenVisionConfig

# The vision rotary embedding's base (fixed in both models; their configs do not change it).
_ROPE_THETA = 10000.0
_NORM_EPS = 1e-6

class VisionRMSNorm(nn.Module):
    """The vision towers' RMSNorm (Qwen2.5-VL's, Pixtral's): normalised in float32, cast back, then
    scaled by the weight."""

    def __init__(self, width: int, eps: float = _NORM_EPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def _norm(vc: QwenVisionConfig, width: int) -> nn.Module:
    return VisionRMSNorm(width) if vc.windowed else nn.LayerNorm(width, eps=_NORM_EPS)


@dataclass
class SegmentGroup:
    """Equal-length attention segments run as one batched SDPA call: ``count`` segments of
    ``length`` rows, either one consecutive run starting at ``start`` or the rows ``index``
    ([count, length])."""

    length: int
    count: int
    start: int = 0
    index: torch.Tensor | None = None


def segment_groups(lengths: list[int], device: torch.device) -> list[SegmentGroup]:
    """Consecutive segments of the given lengths (covering the sequence in order), grouped by length."""
    starts_by_length: dict[int, list[int]] = {}
    offset = 0
    for length in lengths:
        starts_by_length.setdefault(length, []).append(offset)
        offset += length
    groups = []
    for length, starts in starts_by_length.items():
        if starts == list(range(starts[0], starts[0] + len(starts) * length, length)):
            groups.append(SegmentGroup(length, len(starts), start=starts[0]))  # back to back: a view
        else:
            index = torch.tensor(starts)[:, None] + torch.arange(length)
            groups.append(SegmentGroup(length, len(starts), index=index.to(device)))
    return groups


def patch_rotary(positions: torch.Tensor, head_dim: int, theta: float = _ROPE_THETA
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [patches, head_dim] (float32) of patches at (row, column) ``positions`` [patches, 2].
    Both halves of a head rotate alike; within a half, the first quarter's angles are the row times
    the frequencies, the second's the column times them."""
    quarter = head_dim // 4
    inv_freq = 1.0 / theta ** (torch.arange(quarter, device=positions.device, dtype=torch.float32) / quarter)
    angles = (positions.float()[:, :, None] * inv_freq).flatten(1)  # [patches, (row, col) x quarter]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class QwenVisionAttention(nn.Module):
    """Attention within each segment (an image's frame, or a window), rotated by the patches' 2-D
    rotary angles (Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's towers alike)."""

    def __init__(self, vc: QwenVisionConfig | Qwen3VisionConfig) -> None:
        super().__init__()
        self.num_heads = vc.num_heads
        self.head_dim = vc.head_dim
        self.qkv = nn.Linear(vc.hidden_size, 3 * vc.hidden_size, bias=True)
        self.proj = nn.Linear(vc.hidden_size, vc.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                groups: list[SegmentGroup]) -> torch.Tensor:
        rows = x.shape[0]
        q, k, v = self.qkv(x).view(rows, 3, self.num_heads, self.head_dim).unbind(1)
        return self.proj(rotary_segment_attention(q, k, v, cos, sin, groups).view(rows, -1))


def rotary_segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             groups: list[SegmentGroup]) -> torch.Tensor:
    """Attention of q, k, v ([rows, heads, head_dim]) within each segment of ``groups``, q and k
    rotated by cos and sin ([rows, head_dim], shared by the heads; in float32) -> [rows, heads, head_dim]."""
    heads, head_dim = q.shape[1:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    q = (q.float() * cos + _rotate_half(q.float()) * sin).to(v.dtype)
    k = (k.float() * cos + _rotate_half(k.float()) * sin).to(v.dtype)
    out = torch.empty_like(v)
    for g in groups:
        if g.index is None:
            end = g.start + g.count * g.length
            q_s, k_s, v_s = (t[g.start:end].view(g.count, g.length, heads, head_dim)
                             for t in (q, k, v))
        else:
            q_s, k_s, v_s = (t[g.index] for t in (q, k, v))
        # [segments, length, heads, dim] -> [segments, heads, length, dim] and back.
        attended = F.scaled_dot_product_attention(q_s.transpose(1, 2), k_s.transpose(1, 2),
                                                  v_s.transpose(1, 2)).transpose(1, 2)
        if g.index is None:
            out[g.start:g.start + g.count * g.length] = attended.reshape(-1, heads, head_dim)
        else:
            out[g.index] = attended
    return out


class TwoLayerMLP(nn.Module):
    """Qwen2-VL's (and InternViT's) block MLP: fc1, activation, fc2."""

    def __init__(self, vc: QwenVisionConfig | InternVLVisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(vc.hidden_size, vc.intermediate_size)
        self.fc2 = nn.Linear(vc.intermediate_size, vc.hidden_size)
        self.act = _activation(vc.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _GatedMLP(nn.Module):
    """Qwen2.5-VL's block MLP: down(act(gate(x)) * up(x)), every projection with a bias."""

    def __init__(self, vc: QwenVisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(vc.hidden_size, vc.intermediate_size)
        self.up_proj = nn.Linear(vc.hidden_size, vc.intermediate_size)
        self.down_proj = nn.Linear(vc.intermediate_size, vc.hidden_size)
        self.act = _activation(vc.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class QwenVisionBlock(nn.Module):
    def __init__(self, vc: QwenVisionConfig) -> None:
        super().__init__()
        self.norm1 = _norm(vc, vc.hidden_size)
        self.attn = QwenVisionAttention(vc)
        self.norm2 = _norm(vc, vc.hidden_size)
        self.mlp = _GatedMLP(vc) if vc.windowed else TwoLayerMLP(vc)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                groups: list[SegmentGroup]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, groups)
        return x + self.mlp(self.norm2(x))


class _PatchEmbed(nn.Module):
    def __init__(self, vc: QwenVisionConfig) -> None:
        super().__init__()
        kernel = (vc.temporal_patch_size, vc.patch_size, vc.patch_size)
        # The checkpoint's Conv3d (its weight's shape); its kernel equals its stride and covers a whole
        # flattened patch, so it is applied as one matmul over the patch's pixel values.
        self.proj = nn.Conv3d(vc.in_channels, vc.hidden_size, kernel_size=kernel, stride=kernel, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixel_values.to(device=weight.device, dtype=weight.dtype), weight.flatten(1))


class _PatchMerger(nn.Module):
    """Normalises each patch, then maps every merge x merge square (consecutive rows) to one row."""

    def __init__(self, vc: QwenVisionConfig) -> None:
        super().__init__()
        self.merged_width = vc.hidden_size * vc.spatial_merge_size ** 2
        self.ln_q = _norm(vc, vc.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.merged_width, self.merged_width), nn.GELU(),
                                 nn.Linear(self.merged_width, vc.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_width))


@dataclass
class _Layout:
    """Where each patch sits and what it attends to, for one call's images."""

    positions: torch.Tensor  # [patches, 2] (row, column) of each patch, in the order the blocks see them
    frame_groups: list[SegmentGroup]  # full attention: each image's frame
    window_groups: list[SegmentGroup]  # Qwen2.5-VL's windows ([] for Qwen2-VL)
    patch_order: torch.Tensor | None  # the input patches, gathered into window order (None: as given)
    merged_order: torch.Tensor | None  # the merged rows, gathered back into the images' order


def _merge_order_positions(t: int, h: int, w: int, merge: int) -> torch.Tensor:
    """(row, column) of an image's patches in the processor's order: frame by frame, the merge x merge
    squares row by row, each square's patches row by row."""
    rows = torch.arange(h).view(h // merge, 1, merge, 1).expand(-1, w // merge, -1, merge)
    cols = torch.arange(w).view(1, w // merge, 1, merge).expand(h // merge, -1, merge, -1)
    return torch.stack((rows.reshape(-1), cols.reshape(-1)), dim=-1).repeat(t, 1)


def _windows(t: int, units_h: int, units_w: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An image's merged units (merge x merge squares, numbered in its order) in window order: frame by
    frame, windows of ``side x side`` units row by row (the last row and column of windows cut short),
    each window's units row by row. Returns that order and each window's number of units."""
    win_h, win_w = -(-units_h // side), -(-units_w // side)
    grid = torch.full((t, win_h * side, win_w * side), -1, dtype=torch.long)
    grid[:, :units_h, :units_w] = torch.arange(t * units_h * units_w).view(t, units_h, units_w)
    per_window = grid.view(t, win_h, side, win_w, side).permute(0, 1, 3, 2, 4).reshape(-1, side * side)
    present = per_window >= 0
    return per_window[present], present.sum(dim=1)


class QwenVisionTower(nn.Module):
    """Qwen2-VL's / Qwen2.5-VL's vision tower with its patch merger (checkpoint prefix ``visual.``)."""

    def __init__(self, vc: QwenVisionConfig) -> None:
        super().__init__()
        if vc.hidden_size % vc.num_heads or vc.head_dim % 4:
            raise ValueError(f"the vision tower's head size must be a multiple of 4 (hidden_size "
                             f"{vc.hidden_size} over {vc.num_heads} heads)")
        if vc.windowed and vc.window_size < vc.spatial_merge_size * vc.patch_size:
            raise ValueError(f"window_size {vc.window_size} is smaller than one merged square of patches "
                             f"({vc.spatial_merge_size * vc.patch_size} pixels)")
        self.vc = vc
        self.patch_embed = _PatchEmbed(vc)
        self.blocks = nn.ModuleList(QwenVisionBlock(vc) for _ in range(vc.depth))
        self.merger = _PatchMerger(vc)
        self._full_blocks = set(vc.fullatt_block_indexes) if vc.windowed else set(range(vc.depth))

    def _layout(self, grid_thw: list[tuple[int, int, int]], device: torch.device) -> _Layout:
        vc = self.vc
        merge = vc.spatial_merge_size
        unit = merge * merge
        positions, frame_lengths = [], []
        unit_orders, window_lengths = [], []
        units_before = 0
        for t, h, w in grid_thw:
            if h % merge or w % merge:
                raise ValueError(f"an image's grid ({t}, {h}, {w}) must have h and w multiples of "
                                 f"spatial_merge_size {merge}")
            positions.append(_merge_order_positions(t, h, w, merge))
            frame_lengths += [h * w] * t
            if vc.windowed:
                side = vc.window_size // merge // vc.patch_size
                order, sizes = _windows(t, h // merge, w // merge, side)
                unit_orders.append(order + units_before)
                window_lengths += (sizes * unit).tolist()
            units_before += t * (h // merge) * (w // merge)
        all_positions = torch.cat(positions)
        patch_order = merged_order = None
        window_groups: list[SegmentGroup] = []
        if vc.windowed:
            units = torch.cat(unit_orders)
            # Each unit's patches stay together (and in order) when the units are reordered.
            patches = (units[:, None] * unit + torch.arange(unit)).reshape(-1)
            all_positions = all_positions[patches]
            patch_order = patches.to(device)
            merged_order = torch.argsort(units).to(device)
            window_groups = segment_groups(window_lengths, device)
        # (Windows never straddle a frame, so in window order each frame is still one consecutive run.)
        return _Layout(all_positions.to(device), segment_groups(frame_lengths, device), window_groups,
                       patch_order, merged_order)

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values [total patches, in_channels * temporal_patch_size * patch_size**2] (the images'
        processor outputs concatenated in order, as Qwen2VLImageProcessor flattens them), grid_thw each
        image's (t, h, w) in patches -> [total patches / spatial_merge_size**2, out_hidden_size], the
        images' rows in order."""
        grid_thw = [(int(t), int(h), int(w)) for t, h, w in grid_thw]
        weight = self.patch_embed.proj.weight
        if not grid_thw:
            return weight.new_empty(0, self.vc.out_hidden_size)
        total = sum(t * h * w for t, h, w in grid_thw)
        if pixel_values.shape != (total, self.vc.patch_input_size):
            raise ValueError(f"pixel_values must be [{total}, {self.vc.patch_input_size}] for grids {grid_thw}, "
                             f"got {list(pixel_values.shape)}")
        layout = self._layout(grid_thw, weight.device)
        x = self.patch_embed(pixel_values)
        if layout.patch_order is not None:
            x = x[layout.patch_order]
        cos, sin = patch_rotary(layout.positions, self.vc.head_dim)
        for i, block in enumerate(self.blocks):
            groups = layout.frame_groups if i in self._full_blocks else layout.window_groups
            x = block(x, cos, sin, groups)
        merged = self.merger(x)
        return merged if layout.merged_order is None else merged[layout.merged_order]
