"""Reflection's Beam (BeamForCausalLM: Beam-1.0-501B-A23B).

The Llama block with these changes:

* attention with per-head q/k norms whose heads' outputs are scaled by a sigmoid gate per channel
  (``self_attn.gate_proj``) plus a bias per head (``self_attn.gate_bias``), before o_proj;
* windowed layers (by default five of every six, the last layer full) rotate with RoPE; the full ones
  (and windowed ones whose rope parameters are null) attend without positions, their queries scaled by
  position, (1 + (position + 1) / 2048) ** 0.1;
* four norms a layer (each sublayer's input and output), and residual adds scaled by depth: the k-th
  add (k = 2, 3, ... over the layers' attention and MLP outputs) is x * sqrt((k - 1) / k) + y / sqrt(k);
* dense MLPs where mlp_layer_types says so (the first three by default), elsewhere routed experts
  chosen by DeepSeek-V3's grouped sigmoid routing through a correction bias, times routed_scaling_factor,
  without shared experts;
* logits soft-capped at final_logit_softcapping (30 by default).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.layers.attention import query_heads_loader
from gpu_worker.layers.layernorm import RMSNorm
from gpu_worker.models.llama import GatedOutputAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

# The full layers' query scale: (1 + (position + 1) / _SCALE_LENGTH) ** _SCALE_POWER.
_SCALE_LENGTH, _SCALE_POWER = 2048, 0.1


class BeamAttention(GatedOutputAttention):
    def __init__(self, config: ModelConfig, layer: int = 0, norm_class: type[RMSNorm] = RMSNorm) -> None:
        super().__init__(config, layer, norm_class)
        self.gate_bias = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
        self.gate_bias.weight_loader = query_heads_loader

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``rope``: (cos, sin, each token's query scale); the scale applies to the layers attending
        without positions alone."""
        out = self.attend(rope if not self.rotates else rope[:2], hidden, meta)
        heads = out.view(out.shape[0], -1, self.head_dim)
        gate = self.gate_proj.forward(hidden).view_as(heads) + self.gate_bias.to(heads.dtype)[:, None]
        return self.o_proj.forward((heads * torch.sigmoid(gate)).view(out.shape))


class BeamDecoderLayer(LlamaDecoderLayer):
    attention_class = BeamAttention

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention_add, self.mlp_add = 2 * (layer + 1), 2 * (layer + 1) + 1

    @staticmethod
    def _depth_scaled(update: torch.Tensor, residual: torch.Tensor, k: int) -> torch.Tensor:
        """The k-th residual add, residual * sqrt((k - 1) / k) + update / sqrt(k), returned as what the
        next norm adds to ``residual`` (the (hidden, residual) pair's sum is the stream)."""
        return update.mul_(1.0 / math.sqrt(k)).add_(residual, alpha=math.sqrt((k - 1) / k) - 1.0)

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self._attention(rope, hidden, residual, meta)
        hidden = self._depth_scaled(self.post_attention_layernorm.forward(hidden), residual, self.attention_add)
        hidden, residual = self.pre_feedforward_layernorm.forward(hidden, residual)
        hidden = self.post_feedforward_layernorm.forward(self.mlp.forward(hidden))
        return self._depth_scaled(hidden, residual, self.mlp_add), residual


class BeamModel(LlamaModel):
    layer_class = BeamDecoderLayer

    def query_scale(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """[tokens, 1, 1] fp32: the full layers' query scale, applied in fp32 as transformers applies it."""
        return torch.exp(_SCALE_POWER * torch.log1p((positions.to(torch.float32) + 1) / _SCALE_LENGTH))[:, None, None]


class BeamForCausalLM(LlamaForCausalLM):
    model_class = BeamModel
