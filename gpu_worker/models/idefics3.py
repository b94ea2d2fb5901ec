"""Idefics3 (SmolVLM 256M / 500M / 2.2B, Idefics3-8B: Idefics3ForConditionalGeneration): a SigLIP-like
tower over square tiles, its patch grid pixel-shuffled and projected (the connector) into a Llama
decoder.

Each encoder input is one tile ([channels, image_size, image_size]: the router cuts an image into
tiles beside the whole image shrunk to one, as its processor does); a tile becomes
``tokens_per_tile`` rows, standing for its run of <image> tokens. The tower's learnt positions are
looked up as transformers' Idefics3VisionEmbeddings buckets a full tile's patches (float32 steps: not
always the patches' own indexes). The tower and connector are whole on every tensor-parallel rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from gpu_worker.config import ModelConfig
from gpu_worker.layers.weight_utils import WeightLike, renamed_by_prefix
from gpu_worker.models.gemma3_vision import SiglipVisionTower
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.vision_config import Idefics3VisionConfig

# Where a checkpoint keeps each part -> our module names (the released SmolVLM checkpoints and
# transformers 5 alike).
_PREFIXES = (("model.vision_model.", "vision_model."), ("model.connector.", "connector."),
             ("model.text_model.", "model."))


def tile_position_ids(patches_side: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A full tile's patches' position ids, as transformers' Idefics3VisionEmbeddings computes them
    (each patch's fractional row and column, in float32 on ``device``, bucketed into the learnt grid)."""
    f32 = torch.float32
    boundaries = torch.arange(1 / patches_side, 1.0, 1 / patches_side, dtype=f32, device=device)
    steps = (torch.arange(patches_side, dtype=f32, device=device)
             * (1.0 / torch.tensor([float(patches_side)], dtype=f32, device=device)))
    buckets = torch.bucketize(torch.clamp(steps, max=1.0 - 1e-6), boundaries, right=True)
    return (buckets[:, None] * patches_side + buckets[None, :]).reshape(-1)


class Idefics3VisionTower(SiglipVisionTower):
    """transformers' Idefics3VisionTransformer on full tiles: SigLIP's tower (parameter names as its
    checkpoint's below ``model.vision_model.``) whose learnt positions are looked up by the patches'
    buckets (``tile_position_ids``)."""

    def __init__(self, vc: Idefics3VisionConfig) -> None:
        super().__init__(vc)
        self.patches_side = vc.patches_side
        # (computed at the first pass, on its device, in float32 whatever the model's dtype)
        self._position_ids: torch.Tensor | None = None

    def positions(self, device: torch.device) -> torch.Tensor:
        if self._position_ids is None or self._position_ids.device != device:
            self._position_ids = tile_position_ids(self.patches_side, device)
        return self.embeddings.position_embedding(self._position_ids)


class Idefics3Connector(nn.Module):
    """transformers' Idefics3Connector: the patch grid pixel-shuffled (each scale x scale square of
    patches one row, their features side by side in its order), then projected to the text width."""

    def __init__(self, vc: Idefics3VisionConfig) -> None:
        super().__init__()
        self.scale = vc.scale_factor
        self.modality_projection = nn.Module()
        self.modality_projection.proj = nn.Linear(vc.hidden_size * vc.scale_factor ** 2, vc.text_hidden_size,
                                                  bias=False)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[tiles, patches, hidden] -> [tiles, tokens_per_tile, text hidden]."""
        tiles, patches, width = features.shape
        side, scale = int(patches ** 0.5), self.scale
        x = features.view(tiles, side, side // scale, width * scale).permute(0, 2, 1, 3)
        x = x.reshape(tiles, side // scale, side // scale, width * scale * scale).permute(0, 2, 1, 3)
        x = x.reshape(tiles, patches // scale ** 2, width * scale * scale)
        proj = self.modality_projection.proj
        return proj(x.to(proj.weight.dtype))


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    # (A LoRA adapter's modules in the tower or connector are skipped, with a warning, as vLLM does.)
    _LANGUAGE_MODEL_PREFIXES = (("model.text_model.", "model."),)
    _VISION_PREFIXES = ("model.vision_model.", "model.connector.", "vision_model.", "connector.")

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        assert isinstance(config.vision, Idefics3VisionConfig)
        self.vision_model = Idefics3VisionTower(config.vision)
        self.connector = Idefics3Connector(config.vision)

    def embed_images(self, pixel_values: list[torch.Tensor],
                     image_sizes: list[tuple[int, int] | None]) -> list[torch.Tensor]:
        """Each tile's rows ([tokens_per_tile, hidden]) from its pixel values ([C, H, W]); every tile of
        the batch goes through the tower at once."""
        rows = self.connector(self.vision_model(torch.stack(pixel_values)))
        return list(rows.to(self.model_dtype()))

    def model_dtype(self) -> torch.dtype:
        return next(self.model.layers.parameters()).dtype

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        return renamed_by_prefix(weights, _PREFIXES, lambda name: "position_ids" not in name)
