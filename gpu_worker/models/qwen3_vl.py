"""Qwen3-VL: Qwen2-VL's native-resolution images before a Qwen3 decoder, with two changes.

Its M-RoPE interleaves the position axes over the rotary frequencies (layers/rotary.py), and
DeepStack: the tower's mergers at ``deepstack_visual_indexes`` give each image token a row per
decoder layer among the first few, added to its hidden state after that layer. An image's rows in
the encoder cache are its embedding rows and its DeepStack rows side by side
([tokens, (1 + layers) x hidden]); the model runner splits them (``image_row_width``).
"""

from __future__ import annotations

import torch

from gpu_worker.config import ModelConfig
from gpu_worker.models.llama import Qwen3ForCausalLM
from gpu_worker.models.qwen2_vl import NativeImagesMixin
from gpu_worker.models.qwen3_vl_vision import Qwen3VisionTower
from gpu_worker.vision_config import Qwen3VisionConfig


class Qwen3VLForConditionalGeneration(NativeImagesMixin, Qwen3ForCausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        assert isinstance(config.vision, Qwen3VisionConfig)
        self.visual = Qwen3VisionTower(config.vision)
        self.image_row_width = config.hidden_size * (1 + len(config.vision.deepstack_visual_indexes))

    def _tower_rows(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        rows, deepstack = self.visual(pixel_values, grids)
        return torch.cat([rows, *deepstack], dim=-1)
