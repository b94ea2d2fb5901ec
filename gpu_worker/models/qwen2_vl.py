"""Qwen2-VL and Qwen2.5-VL: a native-resolution vision tower in front of a Qwen2 decoder with
M-RoPE positions.

An image (its processor output: [patches, channels x frames x patch x patch], the patches in
2x2-merge order) becomes one row per merged patch in the language model's width; the prompt holds as
many image tokens, whose embeddings the model runner replaces by those rows, and the runner gives
the image's tokens their (time, height, width) rotary positions (gpu_worker/mrope.py). The tower is
whole on every tensor-parallel rank; the decoder is our Qwen2 (the Llama block), unchanged but for
its rotary table's M-RoPE sections.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from gpu_worker.config import ModelConfig
from gpu_worker.layers.weight_utils import WeightLike
from gpu_worker.models.llama import Qwen2ForCausalLM
from gpu_worker.models.qwen2_vl_vision import QwenVisionTower
from gpu_worker.vision_config import QwenVisionConfig


class NativeImagesMixin(nn.Module):
    """What Qwen2-VL and Qwen3-VL share around their decoders: images in by their patches and grids,
    the tower's rows out per image, the checkpoints' names."""

    # Checkpoint prefixes -> ours: the released Qwen2-VL checkpoints' layout (decoder under ``model.``,
    # tower under ``visual.``) needs none; transformers 5 (and Qwen3-VL's checkpoints) keep the
    # decoder under ``model.language_model.`` and the tower under ``model.visual.``.
    _LANGUAGE_MODEL_PREFIXES = (("model.language_model.", "model."),)
    _PREFIXES = (*_LANGUAGE_MODEL_PREFIXES, ("model.visual.", "visual."))
    # (A LoRA adapter's modules in the tower are skipped, with a warning, as vLLM does.)
    _VISION_PREFIXES = ("visual.", "model.visual.")

    def _tower_rows(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Every image's rows, in order ([merged patches, image_row_width])."""
        raise NotImplementedError

    def embed_images(self, pixel_values: list[torch.Tensor],
                     image_sizes: list[tuple[int, ...] | None]) -> list[torch.Tensor]:
        """Each image's rows ([its tokens, image_row_width]) from its patches and its own (height,
        width), which give its grid of patches (a video's: its (frames, height, width)); every image
        of the batch goes through the tower at once."""
        geometry = self.config.vision.geometry
        grids = []
        for size in image_sizes:
            assert size is not None, "a native-resolution model reads an image's grid from its size"
            grids.append(geometry.video_patch_grid(*size) if len(size) == 3 else geometry.patch_grid(*size))
        rows = self._tower_rows(torch.cat(pixel_values), grids).to(self.model_dtype())
        merged = geometry.merge_size ** 2
        return list(rows.split([t * h * w // merged for t, h, w in grids]))

    def model_dtype(self) -> torch.dtype:
        return next(self.model.layers.parameters()).dtype

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        for name, tensor in weights:
            for theirs, ours in self._PREFIXES:
                if name.startswith(theirs):
                    name = ours + name[len(theirs):]
                    break
            yield name, tensor


class Qwen2VLForConditionalGeneration(NativeImagesMixin, Qwen2ForCausalLM):
    """Qwen2-VL, and Qwen2.5-VL (the same model around a windowed tower: QwenVisionConfig.windowed)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        assert isinstance(config.vision, QwenVisionConfig)
        self.visual = QwenVisionTower(config.vision)

    def _tower_rows(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        return self.visual(pixel_values, grids)
