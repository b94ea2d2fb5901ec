"""InternVL 3 / 3.5 in transformers' layout (InternVLForConditionalGeneration): InternViT, its pixel
shuffle and projector before a Qwen2, Qwen3 or Llama decoder.

An image comes as its tiles ([tiles, channels, 448, 448]: the grid the processor cut it into, then
its thumbnail); each tile becomes ``tokens_per_tile`` rows (256) in the language model's width, an
image's rows its tiles' in order, standing for its run of <IMG_CONTEXT> tokens (between <img> and
</img>, which are text). The tower and projector are whole on every tensor-parallel rank.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.config import ModelConfig
from gpu_worker.models.internvl_vision import InternVisionTower, InternVLProjector, internvl_vision_tensors
from gpu_worker.models.llava import TowerProjectorMixin
from gpu_worker.vision_config import InternVLVisionConfig


class InternVLMixin(TowerProjectorMixin):
    """Adds InternVL's image side to a decoder class (see ``internvl_class``)."""

    tower_tensors = staticmethod(internvl_vision_tensors)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        assert isinstance(config.vision, InternVLVisionConfig)
        self.vision_tower = InternVisionTower(config.vision)
        self.multi_modal_projector = InternVLProjector(config.vision)

    def embed_images(self, pixel_values: list[torch.Tensor],
                     image_sizes: list[tuple[int, int] | None]) -> list[torch.Tensor]:
        """Each image's rows ([its tiles x tokens_per_tile, hidden]) from its tiles ([tiles, C, H, W]);
        every tile of the batch goes through the tower at once."""
        rows = self.multi_modal_projector(self.vision_tower(torch.cat(pixel_values))).to(self.model_dtype())
        return [r.flatten(0, 1) for r in rows.split([p.shape[0] for p in pixel_values])]



def internvl_class(decoder: type[nn.Module]) -> type[nn.Module]:
    """The InternVL model over ``decoder`` (Qwen2ForCausalLM, Qwen3ForCausalLM, LlamaForCausalLM)."""
    return type(f"InternVL{decoder.__name__}", (InternVLMixin, decoder), {})
