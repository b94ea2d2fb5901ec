"""Qwen3-Next (Qwen3-Next-80B-A3B): a hybrid decoder whose layers are three Gated DeltaNet linear
attentions (gpu_worker.layers.gated_delta_net) to one gated full attention, each followed by
Qwen2-MoE's routed experts beside a sigmoid-gated shared expert (or a dense MLP in mlp_only_layers).

Its norms scale by (1 + w), Gemma's (GemmaRMSNorm). The full attention is Qwen3's with two changes:
q_proj gives each head its queries and, after them, an output gate (the attention's output is
multiplied by sigmoid(gate) before o_proj), and RoPE rotates the first quarter of each head
(partial_rotary_factor). The checkpoint's ``linear_attn`` modules are our layers' recurrent mixer
(``mamba``, as Granite 4.0-H's Mamba-2 layers are named); its multi-token-prediction layer
(``mtp.*``) is not read here, but by speculative decoding's mtp drafter (gpu_worker.models.mtp).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.layers.attention import PagedAttention
from gpu_worker.layers.gated_delta_net import GatedDeltaNet
from gpu_worker.layers.layernorm import GemmaRMSNorm, RMSNorm
from gpu_worker.layers.linear import QKVParallelLinear, RowParallelLinear, divide_for_tp, tp_rank_and_size
from gpu_worker.layers.rotary import RotaryEmbedding
from gpu_worker.layers.weight_utils import WeightLike
from gpu_worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Qwen3NextAttention(nn.Module):
    """Gated attention: per head, q_proj's queries then its output gate; (1 + w) q/k norms; partial RoPE.
    q_proj's rows are fused with k's and v's as twice the heads (each head's queries and gate rows
    stay together on its rank; KV heads replicated where there are fewer than ranks). A subclass
    without ``qk_normed`` has no q/k norms (MiniCPM5-MoE's)."""

    qk_normed = True

    def __init__(self, config: ModelConfig, layer: int = 0, norm_class: type[RMSNorm] = GemmaRMSNorm) -> None:
        super().__init__()
        self.head_dim = hd = config.head_dim
        _, tp_size = tp_rank_and_size(None, None)
        heads = divide_for_tp(config.num_attention_heads, tp_size, "num_attention_heads")
        self.qkv_proj = QKVParallelLinear(config.hidden_size, hd, 2 * config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.qkv_bias)
        self.num_heads, self.num_kv_heads = heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * hd, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = norm_class(hd, config.rms_norm_eps) if self.qk_normed else None
        self.k_norm = norm_class(hd, config.rms_norm_eps) if self.qk_normed else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, hd, config.attention_scale)

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        tokens, hd = hidden.shape[0], self.head_dim
        q_size, kv_size = 2 * self.num_heads * hd, self.num_kv_heads * hd
        qg, k, v = self.qkv_proj.forward(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q, gate = qg.view(tokens, self.num_heads, 2 * hd).split(hd, dim=-1)
        k = k.reshape(tokens, self.num_kv_heads, hd)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm.forward(q.contiguous()), self.k_norm.forward(k)
        qk = RotaryEmbedding.rotate_(torch.cat((q, k), dim=1), rope[0], rope[1])
        v = v.reshape(tokens, self.num_kv_heads, hd)
        out = self.attn.forward(qk[:, :self.num_heads], qk[:, self.num_heads:], v, meta)
        return self.o_proj.forward(out * torch.sigmoid(gate.reshape(tokens, -1)))


class Qwen3NextDecoderLayer(LlamaDecoderLayer):
    norm_class = GemmaRMSNorm
    attention_class = Qwen3NextAttention
    recurrent_class = GatedDeltaNet


class Qwen3NextModel(LlamaModel):
    layer_class = Qwen3NextDecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        if self.stage.last:  # (the final norm: the last pipeline stage's)
            self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3NextForCausalLM(LlamaForCausalLM):
    model_class = Qwen3NextModel
    # (The linear attention's projections stay as they are: in_proj_qkvz and in_proj_ba are whole.)
    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        for name, tensor in weights:
            yield name.replace(".linear_attn.", ".mamba."), tensor

    def reads_checkpoint_tensor(self, name: str) -> bool:
        return not name.startswith("mtp.")


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5's language model (dense): Qwen3-Next's layers with a dense MLP in each and its Gated
    DeltaNet projections apart (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``); its
    M-RoPE over text is plain RoPE. A Qwen3_5ForConditionalGeneration checkpoint is served as this
    (its language model's tensors; the vision tower's are not read)."""


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5's mixture-of-experts language model (Qwen3.5-397B-A17B and its smaller MoE sizes):
    Qwen3.5's layers with routed experts (renormalised top k) beside a gated shared expert in every
    layer, as Qwen3-Next's. A Qwen3_5MoeForConditionalGeneration checkpoint is served on text as this."""
