"""Gemma 3 with images (4B, 12B, 27B: Gemma3ForConditionalGeneration): a SigLIP tower whose patches
are average-pooled, normed and projected into the Gemma 3 decoder's width, one row per image token.

The prompt holds each image as a run of image tokens between its begin and end tokens; the model
runner writes the projector's rows over their embeddings (not scaled by sqrt(hidden), as transformers
leaves them), and the attention lets an image's tokens see each other both ways (the runner's
``bidirectional`` ranges; the scheduler keeps each image in one chunk). The tower and projector are
whole on every tensor-parallel rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from gpu_worker.config import ModelConfig
from gpu_worker.layers.weight_utils import WeightLike
from gpu_worker.models.gemma import Gemma3ForCausalLM
from gpu_worker.models.gemma3_vision import Gemma3Projector, SiglipVisionTower, gemma3_vision_tensors
from gpu_worker.vision_config import Gemma3VisionConfig


class Gemma3VLForConditionalGeneration(Gemma3ForCausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        assert isinstance(config.vision, Gemma3VisionConfig)
        self.vision_tower = SiglipVisionTower(config.vision)
        self.multi_modal_projector = Gemma3Projector(config.vision)

    def embed_images(self, pixel_values: list[torch.Tensor],
                     image_sizes: list[tuple[int, int] | None]) -> list[torch.Tensor]:
        """Each image's rows ([mm_tokens_per_image, hidden]) from its pixel values ([C, H, W]);
        every image of the batch goes through the tower at once."""
        features = self.vision_tower(torch.stack(pixel_values))
        rows = self.multi_modal_projector(features).to(self.model_dtype())
        return list(rows)

    def model_dtype(self) -> torch.dtype:
        return next(self.model.layers.parameters()).dtype

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        """The checkpoint's tensors under our names: the vision side's (which the text decoder would
        skip) renamed first, the language model's as the text decoder reads them."""
        for name, tensor in gemma3_vision_tensors(weights):
            for theirs, ours in self._LANGUAGE_MODEL_PREFIXES:
                if name.startswith(theirs):
                    name = ours + name[len(theirs):]
                    break
            yield name, tensor
