"""Pixtral's image encoder: its vision tower and the projector of Pixtral-12B (a LLaVA) or Mistral 3.

An image arrives as the processor resized it, [channels, H, W] with H and W whole numbers of patches
and its aspect kept, so images of one request differ in size. Each ``patch_size`` square of pixels is
embedded by a bias-free linear map (the checkpoint's patch convolution, whose kernel is its stride)
and RMS-normalised (``ln_pre``); the patches then run through pre-norm transformer blocks (RMSNorms,
bias-free q/k/v/o projections, a gated MLP) in which a patch attends only to the patches of its own
image, its queries and keys rotated by a 2-D rotary embedding: a quarter of each half of a head turns
with the patch's row, the other quarter with its column, at interleaved frequencies (the row takes
the even ones, the column the odd ones). The features are the hidden states after
``num_layers_used`` blocks (the config's ``vision_feature_layer``), one row per patch, row by row;
no final norm.

The projector maps them into the language model's width. Pixtral-12B: two linears around an
activation, one token per patch. Mistral 3: first an RMSNorm and a patch merger, which concatenates
each ``spatial_merge_size`` square of patches (channel-major: a channel's square of values, then the
next channel's, as ``torch.nn.functional.unfold`` lays them out) and maps it back to the tower's
width, one token per square, squares row by row.

Work is batched across images: the patch embedding, norms, projections and MLPs run over every
patch of the call at once; attention runs as one SDPA call per distinct patch count, the images of
that count stacked.

Parameter names are transformers' (PixtralVisionModel; LlavaMultiModalProjector or
Mistral3MultiModalProjector), so a checkpoint loads by name once ``pixtral_vision_tensors`` has
renamed its prefixes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.layers.weight_utils import WeightLike, tower_and_projector_tensors
from gpu_worker.models.llava import _activation
from gpu_worker.models.qwen2_vl_vision import SegmentGroup, VisionRMSNorm, rotary_segment_attention, segment_groups
from gpu_worker.vision_config import PixtralVisionConfig

# The tower's RMSNorms (ln_pre, attention_norm, ffn_norm): a fixed epsilon, not a config field.
_TOWER_NORM_EPS = 1e-5

_TOWER_LAYERS = "vision_tower.transformer.layers."
# The rotary embedding's frequencies: recomputed, never loaded (transformers does not save them; a
# checkpoint that has them still may).
_UNUSED_TOWER_PARTS = ("vision_tower.patch_positional_embedding.",)


def pixtral_vision_tensors(weights: Iterable[tuple[str, WeightLike]], num_layers_used: int
                           ) -> Iterator[tuple[str, WeightLike]]:
    """``weights`` with Pixtral's vision tensors renamed to ours (``vision_tower.*`` for a
    ``PixtralVisionTower``, ``multi_modal_projector.*`` for a ``PixtralProjector``), the tower's blocks
    from ``num_layers_used`` on (past the feature layer: never run) and its rotary buffers dropped;
    every other tensor (the language model's) passes through unchanged."""
    return tower_and_projector_tensors(weights, _TOWER_LAYERS, num_layers_used, _UNUSED_TOWER_PARTS)


def axial_rotary(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [patches, head_dim] (float32) of patches at (row, column) ``positions`` [patches, 2].
    Of the head's head_dim/2 rotary frequencies theta**(-2i/head_dim), the even ones turn with the row
    and the odd ones with the column; each half of the head rotates by [row angles, column angles]."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    positions = positions.float()
    angles = torch.cat((positions[:, :1] * freqs[0::2], positions[:, 1:] * freqs[1::2]), dim=-1)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


class _Attention(nn.Module):
    """Attention within each image, q and k rotated by the patches' 2-D angles."""

    def __init__(self, vc: PixtralVisionConfig) -> None:
        super().__init__()
        self.num_heads = vc.num_attention_heads
        self.head_dim = vc.head_dim
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, nn.Linear(vc.hidden_size, vc.hidden_size, bias=False))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                groups: list[SegmentGroup]) -> torch.Tensor:
        rows = x.shape[0]
        q, k, v = (proj(x).view(rows, self.num_heads, self.head_dim)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        return self.o_proj(rotary_segment_attention(q, k, v, cos, sin, groups).view(rows, -1))


class _GatedMLP(nn.Module):
    def __init__(self, vc: PixtralVisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(vc.hidden_size, vc.intermediate_size, bias=False)
        self.up_proj = nn.Linear(vc.hidden_size, vc.intermediate_size, bias=False)
        self.down_proj = nn.Linear(vc.intermediate_size, vc.hidden_size, bias=False)
        self.act = _activation(vc.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, vc: PixtralVisionConfig) -> None:
        super().__init__()
        self.attention_norm = VisionRMSNorm(vc.hidden_size, _TOWER_NORM_EPS)
        self.attention = _Attention(vc)
        self.ffn_norm = VisionRMSNorm(vc.hidden_size, _TOWER_NORM_EPS)
        self.feed_forward = _GatedMLP(vc)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                groups: list[SegmentGroup]) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, groups)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralVisionTower(nn.Module):
    """transformers' PixtralVisionModel up to the feature layer (its parameter names; only the first
    ``num_layers_used`` blocks)."""

    def __init__(self, vc: PixtralVisionConfig) -> None:
        super().__init__()
        if vc.hidden_size % vc.num_attention_heads or vc.head_dim % 4:
            raise ValueError(f"the vision tower's width {vc.hidden_size} must split into {vc.num_attention_heads} "
                             "heads whose width is a multiple of 4 (its 2-D rotary embedding)")
        self.vc = vc
        # The checkpoint's Conv2d (its weight's shape); kernel and stride are one patch, so it is applied
        # as one matmul over every patch's pixel values.
        self.patch_conv = nn.Conv2d(vc.num_channels, vc.hidden_size, kernel_size=vc.patch_size,
                                    stride=vc.patch_size, bias=False)
        self.ln_pre = VisionRMSNorm(vc.hidden_size, _TOWER_NORM_EPS)
        self.transformer = nn.Module()
        self.transformer.layers = nn.ModuleList(_Block(vc) for _ in range(vc.num_layers_used))

    def _patches(self, image: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """An image [channels, H, W] -> its patches' pixel values [rows * columns, channels * p * p]
        (row by row; each patch channel, then row, then column, as the convolution's weight), rows, columns."""
        p = self.vc.patch_size
        if image.dim() != 3 or image.shape[0] != self.vc.num_channels or image.shape[1] % p or image.shape[2] % p \
                or not image.shape[1] or not image.shape[2]:
            raise ValueError(f"an image must be [{self.vc.num_channels}, H, W] with H and W positive multiples of "
                             f"patch_size {p}, got {list(image.shape)}")
        channels, height, width = image.shape
        rows, cols = height // p, width // p
        patches = image.reshape(channels, rows, p, cols, p).permute(1, 3, 0, 2, 4).reshape(rows * cols, -1)
        return patches, rows, cols

    def forward(self, pixel_values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each image [channels, H, W] (H and W multiples of patch_size; sizes may differ) -> its
        features [rows * columns, hidden], patches row by row, in the parameters' dtype."""
        weight = self.patch_conv.weight
        if not pixel_values:
            return []
        patches, grids = [], []
        for image in pixel_values:
            flat, rows, cols = self._patches(image)
            patches.append(flat)
            grids.append((rows, cols))
        lengths = [rows * cols for rows, cols in grids]
        # (Images of one patch count attend in one batched call.)
        groups = segment_groups(lengths, weight.device)
        pixels = torch.cat(patches).to(device=weight.device, dtype=weight.dtype)
        x = self.ln_pre(F.linear(pixels, weight.flatten(1)))
        positions = torch.cat([torch.stack(torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij"),
                                           dim=-1).view(-1, 2) for rows, cols in grids])
        cos, sin = axial_rotary(positions.to(weight.device), self.vc.head_dim, self.vc.rope_theta)
        for layer in self.transformer.layers:
            x = layer(x, cos, sin, groups)
        return list(x.split(lengths))


class _PatchMerger(nn.Module):
    """Mistral 3's: every merge x merge square of patches, concatenated channel-major, to one row."""

    def __init__(self, vc: PixtralVisionConfig) -> None:
        super().__init__()
        self.merge = vc.spatial_merge_size
        self.merging_layer = nn.Linear(vc.hidden_size * self.merge ** 2, vc.hidden_size, bias=False)

    def forward(self, features: list[torch.Tensor], grids: list[tuple[int, int]]) -> torch.Tensor:
        m = self.merge
        squares = []
        for x, (rows, cols) in zip(features, grids, strict=True):
            width = x.shape[-1]
            # [rows, cols, width] -> [rows/m, cols/m, width, m, m]: one square per row, as unfold orders it.
            grid = x.reshape(rows // m, m, cols // m, m, width).permute(0, 2, 4, 1, 3)
            squares.append(grid.reshape((rows // m) * (cols // m), width * m * m))
        return self.merging_layer(torch.cat(squares))


class PixtralProjector(nn.Module):
    """The projector into the language model's width, transformers' names: Pixtral-12B's
    (LlavaMultiModalProjector: linear_1, act, linear_2) or, with ``vc.patch_merger``, Mistral 3's
    (Mistral3MultiModalProjector: norm and patch_merger before them)."""

    def __init__(self, vc: PixtralVisionConfig) -> None:
        super().__init__()
        self.merges = vc.patch_merger
        self.merge = vc.spatial_merge_size if vc.patch_merger else 1
        self.hidden_size = vc.hidden_size
        if vc.patch_merger:
            self.norm = VisionRMSNorm(vc.hidden_size, vc.projector_norm_eps)
            self.patch_merger = _PatchMerger(vc)
        self.linear_1 = nn.Linear(vc.hidden_size, vc.text_hidden_size, bias=vc.projector_bias)
        self.act = _activation(vc.projector_act)
        self.linear_2 = nn.Linear(vc.text_hidden_size, vc.text_hidden_size, bias=vc.projector_bias)

    def forward(self, features: list[torch.Tensor], grids: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Each image's features [rows * columns, hidden] (patches row by row) and its (rows, columns)
        of patches -> its tokens [(rows / merge) * (columns / merge), text hidden], row by row, in the
        parameters' dtype."""
        weight = self.linear_1.weight
        if len(features) != len(grids):
            raise ValueError(f"{len(features)} images' features but {len(grids)} grids")
        if not features:
            return []
        grids = [(int(rows), int(cols)) for rows, cols in grids]
        m = self.merge
        for x, (rows, cols) in zip(features, grids):
            if x.dim() != 2 or x.shape != (rows * cols, self.hidden_size) or rows % m or cols % m:
                raise ValueError(f"an image's features must be [rows * columns, {self.hidden_size}] with rows and "
                                 f"columns multiples of spatial_merge_size {m}: got {list(x.shape)} for grid "
                                 f"{(rows, cols)}")
        features = [x.to(device=weight.device, dtype=weight.dtype) for x in features]
        if self.merges:
            # (The norm is per row: one call over every image's.)
            normed = self.norm(torch.cat(features)).split([x.shape[0] for x in features])
            x = self.patch_merger(list(normed), grids)
        else:
            x = torch.cat(features)
        rows_out = self.linear_2(self.act(self.linear_1(x)))
        return list(rows_out.split([(rows // m) * (cols // m) for rows, cols in grids]))
