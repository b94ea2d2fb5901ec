"""NAVER's HyperCLOVA X SEED (HyperCLOVAXForCausalLM: HyperCLOVAX-SEED-Think-14B and its kin).

Granite's Llama block (mup's four scalars: embeddings times embedding_multiplier, each sublayer's output
times residual_multiplier, scores scaled by attention_multiplier, here head_dim ** -0.5 unless stated)
with Peri-LN: under ``use_post_norm`` each sublayer's output is normed (``post_norm1`` after the
attention, ``post_norm2`` after the MLP) before it is scaled and added to the residual. Its logits are
*multiplied* by logits_scaling (Granite's divide): ModelConfig holds the reciprocal.
"""

from __future__ import annotations

import torch

from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.layers.layernorm import RMSNorm
from gpu_worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class HyperCLOVAXDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        peri = config.sublayer_output_norm
        self.post_norm1 = RMSNorm(config.hidden_size, config.rms_norm_eps) if peri else None
        self.post_norm2 = RMSNorm(config.hidden_size, config.rms_norm_eps) if peri else None

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) in and out, as Llama's layer: each sublayer's output normed, then times
        residual_multiplier, before its residual add (fused into the next norm)."""
        if self.post_norm1 is None:
            return super().forward(rope, hidden, residual, meta)
        return self.sandwich_forward(rope, hidden, residual, meta, self.post_norm1, self.post_attention_layernorm,
                                     self.post_norm2)


class HyperCLOVAXModel(LlamaModel):
    layer_class = HyperCLOVAXDecoderLayer


class HyperCLOVAXForCausalLM(LlamaForCausalLM):
    model_class = HyperCLOVAXModel
