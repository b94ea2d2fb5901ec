"""Gemma 3's image encoder: a SigLIP vision tower and Gemma 3's multimodal projector.

An image (the processor's ``pixel_values``, [channels, image_size, image_size]) goes through the
tower to one feature row per patch (the last encoder layer's, after ``post_layernorm``); the
projector average-pools that patch grid down to ``mm_tokens_per_image`` rows, RMS-normalises them
(Gemma's ``1 + weight`` scale, in float32) and maps them into the language model's width. These rows
replace the image's placeholder tokens in the prompt.

SigLIP's encoder layer is CLIP's pre-norm layer (LayerNorm, biased q/k/v/out projections, full
attention between patches, a two-layer MLP), so it is reused from ``gpu_worker.models.llava`` with its
fused ``qkv_proj``: a checkpoint's q_proj/k_proj/v_proj load into it as shards. Unlike CLIP's, the
tower has no class token, its patch convolution has a bias and it has no pre-norm.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.layers.weight_utils import WeightLike, renamed_by_prefix
from gpu_worker.models.llava import CLIPEncoderLayer
from gpu_worker.vision_config import Gemma3VisionConfig, SiglipTowerConfig

# Where a checkpoint keeps the vision side -> our module names. Published Gemma 3 checkpoints (and
# transformers 4) have SigLIP's ``vision_model`` level; transformers 5 drops it, in memory under the
# "model." prefix and without it in what it saves. Longest prefixes first.
VISION_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.vision_tower.vision_model.", "vision_tower."), ("vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."), ("vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."))
# Tower tensors Gemma 3 never uses: SigLIP's attention-pooling head (its output is discarded; Gemma 3
# configs turn it off, but a checkpoint saved with it on still stores it) and old position-id buffers.
_UNUSED_TOWER_PARTS = ("vision_tower.head.", "vision_tower.embeddings.position_ids")


def gemma3_vision_tensors(weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
    """``weights`` with Gemma 3's vision tensors renamed to ours (``vision_tower.*`` for a
    ``SiglipVisionTower``, ``multi_modal_projector.*`` for a ``Gemma3Projector``) and the unused ones
    dropped; every other tensor (the language model's) passes through unchanged."""
    return renamed_by_prefix(weights, VISION_PREFIXES, lambda name: not name.startswith(_UNUSED_TOWER_PARTS))


class SiglipVisionTower(nn.Module):
    """transformers' SigLIP vision model without its pooling head (parameter names as its checkpoint's
    below ``vision_model.``; q/k/v fused into each layer's ``self_attn.qkv_proj``)."""

    def __init__(self, vc: SiglipTowerConfig) -> None:
        super().__init__()
        self.image_size = vc.image_size
        embeddings = self.embeddings = nn.Module()
        embeddings.patch_embedding = nn.Conv2d(vc.num_channels, vc.hidden_size, kernel_size=vc.patch_size,
                                               stride=vc.patch_size, bias=True)
        # One learnt position per patch, row by row; no class token.
        embeddings.position_embedding = nn.Embedding(vc.patches_side ** 2, vc.hidden_size)
        self.encoder = nn.Module()
        # (CLIPEncoderLayer reads only hidden_size, intermediate_size, num_attention_heads,
        # layer_norm_eps and hidden_act, which SiglipTowerConfig names alike.)
        layers = (CLIPEncoderLayer(vc) for _ in range(vc.num_hidden_layers))  # type: ignore[arg-type]
        self.encoder.layers = nn.ModuleList(layers)
        self.post_layernorm = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)

    def positions(self, device: torch.device) -> torch.Tensor:
        """The learnt position rows added to an image's patches, in patch order (SigLIP's: one each)."""
        return self.embeddings.position_embedding.weight

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, channels, size, size] -> the last layer's normed features [images, patches, hidden],
        in the parameters' dtype."""
        if tuple(pixel_values.shape[-2:]) != (self.image_size, self.image_size):
            raise ValueError(f"the vision tower takes {self.image_size}x{self.image_size} images, "
                             f"got pixel values of shape {tuple(pixel_values.shape)}")
        conv = self.embeddings.patch_embedding
        patches = conv(pixel_values.to(device=conv.weight.device, dtype=conv.weight.dtype))
        x = patches.flatten(2).transpose(1, 2) + self.positions(conv.weight.device)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class _GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: computed in float32, scaled by ``1 + weight``, cast back to the input's dtype."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Projector(nn.Module):
    """Gemma 3's multimodal projector (transformers' Gemma3MultiModalProjector, its parameter names):
    pool the patch grid to ``tokens_side`` x ``tokens_side``, norm, project to the text width."""

    def __init__(self, vc: Gemma3VisionConfig) -> None:
        super().__init__()
        if vc.patches_side % vc.tokens_side or vc.tokens_side ** 2 != vc.mm_tokens_per_image:
            raise ValueError(f"a {vc.patches_side}x{vc.patches_side} patch grid does not pool evenly into "
                             f"mm_tokens_per_image {vc.mm_tokens_per_image}")
        self.patches_side = vc.patches_side
        self.pool = vc.patches_side // vc.tokens_side
        # [vision hidden, text hidden]: applied as ``x @ weight``, not nn.Linear's transpose.
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vc.hidden_size, vc.text_hidden_size))
        # (The norm's epsilon is the vision config's layer_norm_eps, as transformers builds it.)
        self.mm_soft_emb_norm = _GemmaRMSNorm(vc.hidden_size, vc.layer_norm_eps)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[images, patches, vision hidden] -> [images, mm_tokens_per_image, text hidden], in the
        parameters' dtype."""
        weight = self.mm_input_projection_weight
        images, patches, width = features.shape
        if patches != self.patches_side ** 2:
            raise ValueError(f"the projector takes {self.patches_side ** 2} patches per image, got {patches}")
        # Patches come row by row: lay them out as a [width, side, side] picture per image to pool.
        grid = features.to(weight.dtype).transpose(1, 2).reshape(images, width, self.patches_side, self.patches_side)
        pooled = F.avg_pool2d(grid, kernel_size=self.pool, stride=self.pool).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), weight)
