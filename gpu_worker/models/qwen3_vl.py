"""Qwen3-VL: Qwen2-VL's native-resolution images before a Qwen3 decoder (or, for its
mixture-of-experts checkpoints, a Qwen3-MoE one), with two changes.

Its M-RoPE interleaves the position axes over the rotary frequencies (layers/rotary.py), and
DeepStack: the tower's mergers at ``deepstack_visual_indexes`` give each image token a row per
decoder layer among the first few, added to its hidden state after that layer. An image's rows in
the encoder cache are its embedding rows and its DeepStack rows side by side
([tokens, (1 + layers) x hidden]); the model runner splits them (``image_row_width``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from gpu_worker.config import ModelConfig
from gpu_worker.layers.weight_utils import WeightLike, materialize
from gpu_worker.models.llama import Qwen3ForCausalLM, Qwen3MoeForCausalLM
from gpu_worker.models.qwen2_vl import NativeImagesMixin
from gpu_worker.models.qwen3_vl_vision import Qwen3VisionTower
from gpu_worker.vision_config import Qwen3VisionConfig


class Qwen3VLImagesMixin(NativeImagesMixin):
    """Qwen3-VL's tower and DeepStack rows, over either decoder."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        assert isinstance(config.vision, Qwen3VisionConfig)
        self.visual = Qwen3VisionTower(config.vision)
        self.image_row_width = config.hidden_size * (1 + len(config.vision.deepstack_visual_indexes))

    def _tower_rows(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        rows, deepstack = self.visual(pixel_values, grids)
        return torch.cat([rows, *deepstack], dim=-1)


class Qwen3VLForConditionalGeneration(Qwen3VLImagesMixin, Qwen3ForCausalLM):
    pass


class Qwen3VLMoeForConditionalGeneration(Qwen3VLImagesMixin, Qwen3MoeForCausalLM):
    """Qwen3-VL's MoE checkpoints (Qwen3-VL-30B-A3B, 235B-A22B) store each layer's experts stacked.
    The released ones (saved by transformers 4) as [experts, in, out] ([experts, hidden, 2 x
    moe_intermediate] for gate and up, [experts, moe_intermediate, hidden] for down): those are read
    transposed into our [experts, out, in]; transformers 5 saves ours. (The shapes tell them apart:
    a model's hidden size is never twice its experts' width, nor equal to it.)"""

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        return stacked_experts_as_ours(super().checkpoint_tensors(weights), self.config)


def stacked_experts_as_ours(weights: Iterable[tuple[str, WeightLike]], config: ModelConfig
                            ) -> Iterator[tuple[str, WeightLike]]:
    """A Qwen3-VL MoE checkpoint's tensors with its released stacked experts ([experts, in, out])
    transposed into ours ([experts, out, in]); the others (transformers 5's experts too) as they are."""
    hidden, width = config.hidden_size, config.moe_intermediate_size
    released = {"gate_up_proj": (hidden, 2 * width), "down_proj": (width, hidden)}
    for name, tensor in weights:
        projection = name.rsplit(".", 1)[-1]
        if ".mlp.experts." in name and projection in released and released[projection][0] != \
                released[projection][1] and tuple(tensor.shape[1:]) == released[projection]:
            tensor = materialize(tensor).transpose(1, 2)
        yield name, tensor
