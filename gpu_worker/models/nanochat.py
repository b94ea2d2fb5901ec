"""Karpathy's nanochat (NanoChatForCausalLM: the nanochat-d20 / d32 checkpoints as transformers reads them).

The Llama block with these changes:

* every norm without a learnt weight (x / rms(x)): each layer's two, each head's query and key (after
  RoPE, which a weightless norm over whole heads commutes with), the final one, and one more over the
  embeddings before the first layer;
* an ungated MLP, ``fc1`` -> relu^2 -> ``fc2``;
* RoPE turning each head's halves the other way (its rotate_half is (x2, -x1)): each head's query and
  key rows (and a LoRA adapter's B on them) have their halves swapped as they are read, which turns
  Llama's rotation into nanochat's for every query-key product;
* logits soft-capped at final_logit_softcapping (15 by default).
"""

from __future__ import annotations

import torch

from gpu_worker.layers.layernorm import WeightlessRMSNorm
from gpu_worker.models.llama import LlamaDecoderLayer, LlamaModel, UngatedMLP
from gpu_worker.models.paired_rope import PairedRopeForCausalLM


class NanoChatMLP(UngatedMLP):
    in_name, out_name = "fc1", "fc2"


class NanoChatDecoderLayer(LlamaDecoderLayer):
    norm_class = WeightlessRMSNorm
    mlp_class = NanoChatMLP


class NanoChatModel(LlamaModel):
    layer_class = NanoChatDecoderLayer


class NanoChatForCausalLM(PairedRopeForCausalLM):
    model_class = NanoChatModel

    def rotary_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows of q or k (weight, bias, LoRA B), each head's two halves swapped."""
        half = self.config.head_dim // 2
        per_head = rows.reshape(-1, 2, half, *rows.shape[1:])
        return per_head.flip(1).reshape(rows.shape)
