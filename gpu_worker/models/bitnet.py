"""Microsoft's BitNet b1.58 (BitNetForCausalLM: bitnet-b1.58-2B-4T, and its bf16 master weights).

The Llama block with a norm inside each sublayer: the attention's heads' outputs are normed
(``self_attn.attn_sub_norm``, over all heads) before o_proj, and the MLP's act(gate) * up (a gated
relu^2) before down_proj (``mlp.ffn_sub_norm``). Its released checkpoints are quantized (ternary weights,
8-bit inputs: gpu_worker.bitnet_checkpoint); served on one tensor-parallel rank, as the norms over whole
rows need.
"""

from __future__ import annotations

import torch

from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.layers.layernorm import RMSNorm
from gpu_worker.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel


class BitNetAttention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer: int = 0, norm_class: type[RMSNorm] = RMSNorm) -> None:
        super().__init__(config, layer, norm_class)
        if self.qkv_proj.tp_size > 1:
            raise ValueError("BitNet is served on one tensor-parallel rank (its norms span every head)")
        self.attn_sub_norm = RMSNorm(self.num_heads * self.head_dim, config.rms_norm_eps)

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.o_proj.forward(self.attn_sub_norm.forward(self.attend(rope, hidden, meta)))


class BitNetMLP(LlamaMLP):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None, reduce_results: bool = True) -> None:
        super().__init__(config, intermediate_size, reduce_results)
        self.ffn_sub_norm = RMSNorm(intermediate_size or config.intermediate_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.ffn_sub_norm.forward(self.act.forward(self.gate_up_proj.forward(x))))


class BitNetDecoderLayer(LlamaDecoderLayer):
    attention_class = BitNetAttention
    mlp_class = BitNetMLP


class BitNetModel(LlamaModel):
    layer_class = BitNetDecoderLayer


class BitNetForCausalLM(LlamaForCausalLM):
    model_class = BitNetModel
