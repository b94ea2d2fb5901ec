"""InternVL's image encoder: its InternViT vision tower, the pixel shuffle and the projector.

An image arrives as the processor cut it: tiles of ``image_size`` square pixels (a thumbnail among
them), every tile the same size, so a call's tiles stack into one tensor. Each ``patch_size`` square
of a tile is embedded by the checkpoint's patch convolution (with a bias; its kernel is its stride,
so it is one matmul over the patches' pixel values); a learned class token is put in front of the
tile's patches, row by row, and a learned absolute position embedding (one per place, the class
token's first) is added. The rows then run through pre-norm transformer layers: LayerNorms
(InternViT-300M) or float32 RMSNorms (InternViT-6B), attention with or without q/k/v biases and with
optional RMSNorms over the whole width of the queries and of the keys (before the split into heads),
a two-linear MLP, and each branch scaled per channel by a learned vector (``lambda_1``,
``lambda_2``) before its residual add. Every row of a tile attends to every row of that tile, the
class token included, and to nothing else. The features are the hidden states after
``num_layers_used`` layers (the config's ``vision_feature_layer``; 0: the embeddings); no final norm.

The projector drops the class token, pixel-shuffles the tile's patch grid and maps it into the
language model's width. The shuffle (``downsample_ratio`` 1/s) makes each s x s square of patches one
token: the square's features concatenated row by row (its top row left to right, then the next),
tokens row by row over the squares, as transformers' InternVLModel.pixel_shuffle orders them. Then
a LayerNorm over the s*s-wide rows, a linear, an activation and a linear.

Work is batched across tiles: every projection, norm and MLP runs over all of a call's rows at once,
attention as one SDPA call over the stacked tiles.

Parameter names are transformers' (InternVLVisionModel; InternVLMultiModalProjector), so a checkpoint
loads by name once ``internvl_vision_tensors`` has renamed its prefixes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.layers.weight_utils import WeightLike, tower_and_projector_tensors
from gpu_worker.models.llava import _activation
from gpu_worker.models.qwen2_vl_vision import TwoLayerMLP, VisionRMSNorm
from gpu_worker.vision_config import InternVLVisionConfig

# The q and k RMSNorms' epsilon: transformers builds them with its default, not layer_norm_eps.
_QK_NORM_EPS = 1e-6
# The projector's LayerNorm: torch's default epsilon, also not layer_norm_eps.
_PROJECTOR_NORM_EPS = 1e-5

_TOWER_LAYERS = "vision_tower.encoder.layer."
# The masked-image-modelling token (use_mask_token): a training-time input, never used here.
_UNUSED_TOWER_PARTS = ("vision_tower.embeddings.mask_token",)


def internvl_vision_tensors(weights: Iterable[tuple[str, WeightLike]], num_layers_used: int
                            ) -> Iterator[tuple[str, WeightLike]]:
    """``weights`` with InternVL's vision tensors renamed to ours (``vision_tower.*`` for an
    ``InternVisionTower``, ``multi_modal_projector.*`` for an ``InternVLProjector``), the tower's layers
    from ``num_layers_used`` on (past the feature layer: never run) and its mask token dropped; every
    other tensor (the language model's) passes through unchanged."""
    return tower_and_projector_tensors(weights, _TOWER_LAYERS, num_layers_used, _UNUSED_TOWER_PARTS)


def _norm(vc: InternVLVisionConfig) -> nn.Module:
    if vc.norm_type == "rms_norm":
        return VisionRMSNorm(vc.hidden_size, vc.layer_norm_eps)
    return nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)


def shuffle_scale(vc: InternVLVisionConfig) -> int:
    """s of the pixel shuffle (downsample_ratio 1/s): each s x s square of patches becomes one token."""
    scale = round(1 / vc.downsample_ratio)
    if abs(scale * vc.downsample_ratio - 1) > 1e-6:
        raise ValueError(f"InternVL's downsample_ratio must be 1/s for a whole s, got {vc.downsample_ratio}")
    return scale


def pixel_shuffle(patches: torch.Tensor, side: int, scale: int) -> torch.Tensor:
    """Tiles' patch features [tiles, side * side, width] (row by row) -> [tiles, (side/scale)^2,
    scale^2 * width]: token (i, j) is the square of patches (scale*i + dy, scale*j + dx) concatenated,
    dy then dx (the square row by row); tokens row by row. transformers' pixel_shuffle, as one permute."""
    tiles, _, width = patches.shape
    squares = side // scale
    grid = patches.reshape(tiles, squares, scale, squares, scale, width).permute(0, 1, 3, 2, 4, 5)
    return grid.reshape(tiles, squares * squares, scale * scale * width)


class _Attention(nn.Module):
    """Attention over each tile's rows (class token and patches), no positions inside: the absolute
    embeddings were added at the input."""

    def __init__(self, vc: InternVLVisionConfig) -> None:
        super().__init__()
        width = vc.hidden_size
        self.num_heads = vc.num_attention_heads
        self.head_dim = vc.head_dim
        self.q_proj = nn.Linear(width, width, bias=vc.attention_bias)
        self.k_proj = nn.Linear(width, width, bias=vc.attention_bias)
        self.v_proj = nn.Linear(width, width, bias=vc.attention_bias)
        self.projection_layer = nn.Linear(width, width)  # (biased whatever attention_bias says)
        self.qk_norm = vc.use_qk_norm
        if vc.use_qk_norm:
            self.q_norm = VisionRMSNorm(width, _QK_NORM_EPS)
            self.k_norm = VisionRMSNorm(width, _QK_NORM_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiles, rows, width = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.view(tiles, rows, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)  # (scale head_dim ** -0.5, as transformers')
        return self.projection_layer(out.transpose(1, 2).reshape(tiles, rows, width))


class _Layer(nn.Module):
    def __init__(self, vc: InternVLVisionConfig) -> None:
        super().__init__()
        self.layernorm_before = _norm(vc)
        self.attention = _Attention(vc)
        self.lambda_1 = nn.Parameter(torch.ones(vc.hidden_size))
        self.layernorm_after = _norm(vc)
        self.mlp = TwoLayerMLP(vc)
        self.lambda_2 = nn.Parameter(torch.ones(vc.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.lambda_1 * self.attention(self.layernorm_before(x))
        return x + self.lambda_2 * self.mlp(self.layernorm_after(x))


class InternVisionTower(nn.Module):
    """transformers' InternVLVisionModel up to the feature layer (its parameter names; only the first
    ``num_layers_used`` layers; no final norm)."""

    def __init__(self, vc: InternVLVisionConfig) -> None:
        super().__init__()
        if vc.hidden_size % vc.num_attention_heads:
            raise ValueError(f"the vision tower's width {vc.hidden_size} must split into {vc.num_attention_heads} "
                             "heads")
        self.vc = vc
        self.side = vc.image_size // vc.patch_size
        width = vc.hidden_size
        self.embeddings = nn.Module()
        self.embeddings.cls_token = nn.Parameter(torch.zeros(1, 1, width))
        # The checkpoint's Conv2d (its weight's shape); kernel and stride are one patch, so it is applied
        # as one matmul over every patch's pixel values.
        self.embeddings.patch_embeddings = nn.Module()
        self.embeddings.patch_embeddings.projection = nn.Conv2d(vc.num_channels, width, kernel_size=vc.patch_size,
                                                                stride=vc.patch_size)
        self.embeddings.position_embeddings = nn.Parameter(torch.zeros(1, 1 + self.side * self.side, width))
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(_Layer(vc) for _ in range(vc.num_layers_used))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Tiles [tiles, channels, image_size, image_size] -> their features [tiles, 1 + patches, hidden]
        (the class token's row, then the patches' row by row) in the parameters' dtype."""
        vc, side, p = self.vc, self.side, self.vc.patch_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (vc.num_channels, vc.image_size,
                                                                        vc.image_size):
            raise ValueError(f"tiles must be [tiles, {vc.num_channels}, {vc.image_size}, {vc.image_size}], "
                             f"got {list(pixel_values.shape)}")
        projection = self.embeddings.patch_embeddings.projection
        weight = projection.weight
        tiles = pixel_values.shape[0]
        pixels = pixel_values.to(device=weight.device, dtype=weight.dtype)
        # [tiles, channels, H, W] -> [tiles, patches, channels * p * p]: patches row by row, each patch
        # channel, then row, then column, as the convolution's weight.
        patches = pixels.reshape(tiles, vc.num_channels, side, p, side, p).permute(0, 2, 4, 1, 3, 5)
        x = F.linear(patches.reshape(tiles, side * side, vc.num_channels * p * p), weight.flatten(1), projection.bias)
        x = torch.cat((self.embeddings.cls_token.expand(tiles, 1, -1), x), dim=1)
        x = x + self.embeddings.position_embeddings
        for layer in self.encoder.layer:
            x = layer(x)
        return x


class InternVLProjector(nn.Module):
    """The class token dropped, the pixel shuffle and transformers' InternVLMultiModalProjector
    (layer_norm, linear_1, act, linear_2; its names)."""

    def __init__(self, vc: InternVLVisionConfig) -> None:
        super().__init__()
        self.scale = shuffle_scale(vc)
        self.side = vc.image_size // vc.patch_size
        self.hidden_size = vc.hidden_size
        self.tokens_per_tile = vc.tokens_per_tile
        width = vc.hidden_size * self.scale ** 2
        self.layer_norm = nn.LayerNorm(width, eps=_PROJECTOR_NORM_EPS)
        self.linear_1 = nn.Linear(width, vc.text_hidden_size)
        self.act = _activation(vc.projector_act)
        self.linear_2 = nn.Linear(vc.text_hidden_size, vc.text_hidden_size)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """The tower's features [tiles, 1 + patches, hidden] -> the tiles' tokens [tiles, tokens_per_tile,
        text hidden] (row by row over the shuffled grid) in the parameters' dtype."""
        expected = (1 + self.side * self.side, self.hidden_size)
        if features.dim() != 3 or tuple(features.shape[1:]) != expected:
            raise ValueError(f"the tower's features must be [tiles, {expected[0]}, {expected[1]}] (the class "
                             f"token, then {self.side}x{self.side} patches), got {list(features.shape)}")
        weight = self.linear_1.weight
        patches = features[:, 1:].to(device=weight.device, dtype=weight.dtype)
        x = pixel_shuffle(patches, self.side, self.scale)
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))
