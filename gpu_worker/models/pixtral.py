"""Pixtral-12B (LlavaForConditionalGeneration with a Pixtral tower) and Mistral Small 3.1 / 3.2
(Mistral3ForConditionalGeneration): Pixtral's tower and projector before a Mistral decoder.

An image, resized by the processor to keep its aspect (pixel values [channels, height, width], each
side whole tokens), becomes rows x columns rows in the language model's width. Its prompt run is those
rows of image tokens, each row ended by [IMG_BREAK] and the last by [IMG_END]: ``embed_images`` gives
one row per token of that run, the break and end tokens' rows being their own embeddings (as
transformers leaves them), so the runner writes the run whole like any model's. The tower and
projector are whole on every tensor-parallel rank.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.config import ModelConfig
from gpu_worker.models.llava import TowerProjectorMixin
from gpu_worker.models.pixtral_vision import PixtralProjector, PixtralVisionTower, pixtral_vision_tensors
from gpu_worker.vision_config import PixtralVisionConfig


class PixtralMixin(TowerProjectorMixin):
    """Adds Pixtral's image side to a decoder class (see ``pixtral_class``)."""

    tower_tensors = staticmethod(pixtral_vision_tensors)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        assert isinstance(config.vision, PixtralVisionConfig)
        self.vision_tower = PixtralVisionTower(config.vision)
        self.multi_modal_projector = PixtralProjector(config.vision)

    def embed_images(self, pixel_values: list[torch.Tensor],
                     image_sizes: list[tuple[int, int] | None]) -> list[torch.Tensor]:
        """Each image's rows, one per token of its prompt run ([rows x (columns + 1), hidden]), from its
        pixel values ([C, H, W] as resized); every image of the batch goes through the tower at once."""
        vc = self.config.vision
        patches = [(p.shape[-2] // vc.patch_size, p.shape[-1] // vc.patch_size) for p in pixel_values]
        features = self.vision_tower(pixel_values)
        projected = self.multi_modal_projector(features, patches)
        dtype = self.model_dtype()
        marks = self.embed_input_ids(torch.tensor([vc.image_break_token_id, vc.image_end_token_id],
                                                  device=projected[0].device)).to(dtype)
        out = []
        for rows, (patch_rows, patch_columns) in zip(projected, patches, strict=True):
            height, width = patch_rows // vc.spatial_merge_size, patch_columns // vc.spatial_merge_size
            ends = marks[0].expand(height, 1, -1).clone()
            ends[-1] = marks[1]
            out.append(torch.cat([rows.to(dtype).view(height, width, -1), ends], dim=1).flatten(0, 1))
        return out



def pixtral_class(decoder: type[nn.Module]) -> type[nn.Module]:
    """The Pixtral model over ``decoder`` (MistralForCausalLM, LlamaForCausalLM)."""
    return type(f"Pixtral{decoder.__name__}", (PixtralMixin, decoder), {})
