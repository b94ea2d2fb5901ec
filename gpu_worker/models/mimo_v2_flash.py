"""Xiaomi's MiMo-V2-Flash (MiMoV2FlashForCausalLM).

The Llama block (norms before each sublayer) with:

* queries and keys of ``head_dim`` (192) values a head, values of ``v_head_dim`` (128), scaled by
  ``attention_value_scale`` before attention; RoPE over a third of each head (``partial_rotary_factor``
  0.334: 64 values), with a base per layer kind (the full layers' 5,000,000, the windowed layers'
  10,000: ModelConfig's local_rope_theta);
* windowed layers (by default all but the first and every sixth) with twice the KV heads of the full
  ones and a learnt attention sink per query head (``self_attn.sinks``): each layer's cache keeps its
  own heads (ModelConfig.attention_layer_geometry);
* a dense MLP in the first layer, then DeepSeek-V3's routed experts (sigmoid scores through a
  correction bias, in groups) without shared ones, as ``mlp_layer_types`` says.

The paged cache holds keys and values of one width: each value head is stored ``head_dim`` wide, its
``v_head_dim`` values then zeros (v_proj's rows, and a LoRA adapter's B rows for it, are padded so at
load), and the attention's output is cut back to ``v_head_dim`` per head before o_proj. That costs a
half more of the values' memory than values stored at their own width would. Its multi-token-
prediction layers (``model.mtp.*``) are not read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.layers.attention import PagedAttention
from gpu_worker.layers.layernorm import RMSNorm
from gpu_worker.layers.linear import QKVParallelLinear, RowParallelLinear
from gpu_worker.layers.rotary import RotaryEmbedding
from gpu_worker.layers.weight_utils import WeightLike, materialize
from gpu_worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, sinks_under_attention


class MiMoV2FlashAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0, norm_class: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        self.head_dim, self.v_dim = config.head_dim, config.v_head_dim
        windowed = config.raw["layer_types"][layer] == "sliding_attention"
        kv_heads = config.num_key_value_heads * (2 if windowed else 1)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, config.num_attention_heads, kv_heads,
                                          bias=config.qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(config.num_attention_heads * config.v_head_dim, config.hidden_size, bias=False)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, config.attention_scale,
                                   config.layer_sliding_window(layer), sinks=windowed)
        self.value_scale = config.attention_value_scale

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        tokens = hidden.shape[0]
        qkv = self.qkv_proj.forward(hidden)
        qk = qkv[:, : self.q_size + self.kv_size].view(tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        RotaryEmbedding.rotate_(qk, rope[0], rope[1])
        v = qkv[:, self.q_size + self.kv_size:].view(tokens, self.num_kv_heads, self.head_dim)
        if self.value_scale != 1.0:
            v = v * self.value_scale
        out = self.attn.forward(qk[:, : self.num_heads], qk[:, self.num_heads:], v, meta)
        out = out.view(tokens, self.num_heads, self.head_dim)[..., : self.v_dim]
        return self.o_proj.forward(out.reshape(tokens, self.num_heads * self.v_dim))


class MiMoV2FlashDecoderLayer(LlamaDecoderLayer):
    attention_class = MiMoV2FlashAttention  # type: ignore[assignment]


class MiMoV2FlashModel(LlamaModel):
    layer_class = MiMoV2FlashDecoderLayer


class MiMoV2FlashForCausalLM(LlamaForCausalLM):
    model_class = MiMoV2FlashModel

    def _padded_value_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """v_proj's rows (or a LoRA B's), each head's v_head_dim rows then zeros to head_dim."""
        v_dim, width = self.config.v_head_dim, self.config.head_dim
        per_head = rows.reshape(-1, v_dim, *rows.shape[1:])
        padding = per_head.new_zeros(per_head.shape[0], width - v_dim, *rows.shape[1:])
        return torch.cat((per_head, padding), dim=1).reshape(-1, *rows.shape[1:])

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        for name, tensor in sinks_under_attention(weights):
            if name.endswith((".self_attn.v_proj.weight", ".self_attn.v_proj.bias")):
                tensor = self._padded_value_rows(materialize(tensor))
            yield name, tensor

    def reads_checkpoint_tensor(self, name: str) -> bool:
        return not name.startswith(("model.mtp.", "mtp."))

    def lora_b_rows(self, module: str, b: torch.Tensor) -> torch.Tensor:
        """A LoRA adapter's B for ``module``, its rows placed as the base weight's were loaded."""
        return self._padded_value_rows(b) if module.endswith(".self_attn.v_proj") else b
