"""MiniMax-Text-01 and MiniMax-M1 (transformers' MiniMaxForCausalLM; the released remote code's
MiniMaxText01ForCausalLM, MiniMaxM1ForCausalLM): a hybrid decoder of lightning-attention layers
(gpu_worker.layers.lightning_attention: linear attention with a fixed decay per head) and, every few
layers, grouped-query softmax attention with RoPE; Mixtral's routed experts in every layer.

Its residual stream holds normed values: each layer norms its input, and that normed input (not the
sum before it) is what the sublayer's output is added to, each side scaled (``minimax_residual_scales``:
the input times alpha plus the output times beta, per sublayer kind). A layer hands the next one its
output as two parts, (MLP output x beta, normed input x alpha), whose sum the next norm adds (and the
final norm), as the Llama layers' fused residual add does.

The checkpoint names both mixers ``self_attn``: a lightning layer's are read as its recurrent mixer's
(``mamba``, as the other hybrids'); the experts are Mixtral's (``block_sparse_moe``, w1 / w3 / w2); the
decay tables transformers saves beside them (``slope_rate`` ...) are computed here, not read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.layers.lightning_attention import LightningAttention
from gpu_worker.layers.weight_utils import WeightLike
from gpu_worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from gpu_worker.models.renamed_checkpoint import recurrent_mixer_name

# transformers' lightning-attention buffers, saved in its checkpoints: the decay rates and their tables.
_DECAY_TABLES = (".slope_rate", ".query_decay", ".key_decay", ".diagonal_decay")


class MiniMaxDecoderLayer(LlamaDecoderLayer):
    recurrent_class = LightningAttention

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        if self.mamba is not None:
            self.mamba.set_layer(layer, config.num_hidden_layers)
        scales = config.minimax_residual_scales
        self.mixer_alpha, self.mixer_beta = scales[0:2] if self.mamba is not None else scales[2:4]
        self.mlp_alpha, self.mlp_beta = scales[4:6]

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) in and out: the layer's input is their sum, its output too."""
        normed = (self.input_layernorm.forward(hidden) if residual is None
                  else self.input_layernorm.forward(hidden, residual)[0])
        mixed = self._mix(rope, normed, meta)
        normed, _ = self.post_attention_layernorm.forward(mixed.mul_(self.mixer_beta), normed * self.mixer_alpha)
        return self.mlp.forward(normed).mul_(self.mlp_beta), normed.mul_(self.mlp_alpha)


class MiniMaxModel(LlamaModel):
    layer_class = MiniMaxDecoderLayer


class MiniMaxForCausalLM(LlamaForCausalLM):
    model_class = MiniMaxModel

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        for name, tensor in weights:
            if name.endswith(_DECAY_TABLES):
                continue
            name = recurrent_mixer_name(name, self.config).replace(".block_sparse_moe.", ".mlp.")
            yield name.replace(".mamba.qkv_proj.", ".mamba.in_proj_qkv."), tensor
