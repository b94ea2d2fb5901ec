"""AI2's OLMo family, the Llama block with changes.

OLMo 2 (Olmo2ForCausalLM: OLMo-2 1B / 7B / 13B / 32B) and OLMo 3 (Olmo3ForCausalLM: OLMo 2's layers
with a sliding window on three layers of four, which rotate with plain RoPE of their own:
ModelConfig's local_rope_theta):

* The norms come after the attention and the MLP, not before: each sublayer's output is normed, then
  added to the residual (``post_attention_layernorm``, ``post_feedforward_layernorm``; no input norm).
* The queries and the keys are normed over their whole projection (every head at once:
  ``q_norm`` of num_heads x head_dim, ``k_norm`` of num_kv_heads x head_dim), before RoPE. Under tensor
  parallelism a rank holds some heads: the ranks' sums of squares are all-reduced, so each normalises
  by the whole projection's mean square (with KV heads replicated across ranks each copy is counted as
  often as it is held, which leaves the mean the same).

OLMoE (OlmoeForCausalLM): Llama's layers (norms before each sublayer) with those q/k norms and routed
experts. FlexOlmo (FlexOlmoForCausalLM: FlexOlmo-7x7B-1T and its RT model): OLMo 2's layers (norms after
each sublayer, OLMo 2's q/k norms) with OLMoE's routed experts in every layer. The first OLMo
(OlmoForCausalLM: OLMo-1B-hf, OLMo-7B-hf, OLMo-7B-0424 / 0724-hf): Llama's layers with LayerNorms of no
parameters. OLMo's and OLMoE's clip_qkv clamps q, k (after any norms)
and v (ModelConfig.clip_qkv).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from gpu_worker import distributed
from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.layers.layernorm import ParameterFreeLayerNorm, RMSNorm
from gpu_worker.layers.linear import tp_rank_and_size
from gpu_worker.layers.weight_utils import WeightLike, copy_into
from gpu_worker.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class OlmoDecoderLayer(LlamaDecoderLayer):
    norm_class = ParameterFreeLayerNorm


class OlmoModel(LlamaModel):
    layer_class = OlmoDecoderLayer


class OlmoForCausalLM(LlamaForCausalLM):
    model_class = OlmoModel


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole q or k projection of which this rank holds ``width`` values from ``start``
    (its heads'), as transformers' Olmo2RMSNorm computes it: statistics and weight in fp32, then the
    cast (``cast_first``: OlmoeRMSNorm's order, the cast, then the weight)."""

    def __init__(self, width: int, start: int, eps: float, cast_first: bool = False) -> None:
        super().__init__()
        self.start, self.eps, self.cast_first = start, eps, cast_first
        self.tp_size = tp_rank_and_size(None, None)[1]
        self.weight = nn.Parameter(torch.ones(width), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: WeightLike, shard_id: int | str | None = None) -> None:
        copy_into(param.data, loaded.narrow(0, self.start, param.shape[0]), "q/k norm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim] (this rank's heads, as LlamaAttention norms them), normed over
        the whole projection."""
        x32 = x.float().flatten(1)
        squares = x32.pow(2).sum(-1, keepdim=True)
        if self.tp_size > 1:
            distributed.all_reduce(squares)
        mean = squares / (x32.shape[-1] * self.tp_size)
        if self.cast_first:
            return (self.weight * (x32 * torch.rsqrt(mean + self.eps)).to(x.dtype)).view_as(x)
        return (self.weight.float() * (x32 * torch.rsqrt(mean + self.eps))).to(x.dtype).view_as(x)


class Olmo2Attention(LlamaAttention):
    """Llama's attention (its q/k norm path) with the norms over the whole projections."""

    cast_first = False  # (the norms' order of the weight and the cast: OLMoE's casts first)

    def __init__(self, config: ModelConfig, layer: int = 0, norm_class: type[RMSNorm] = RMSNorm) -> None:
        super().__init__(config, layer, norm_class)
        proj, eps = self.qkv_proj, config.rms_norm_eps
        self.q_norm = ProjectionRMSNorm(self.q_size, proj.tp_rank * self.q_size, eps, self.cast_first)
        self.k_norm = ProjectionRMSNorm(self.kv_size, proj._kv_head_start() * self.head_dim, eps, self.cast_first)


class Olmo2DecoderLayer(LlamaDecoderLayer):
    attention_class = Olmo2Attention

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        self.input_layernorm = None  # (no norm before the attention)
        self.post_feedforward_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) in and out, as Llama's layer: the input is their sum; out, the normed MLP
        output and the residual stream it is added to."""
        x = hidden if residual is None else hidden + residual
        x = x + self.post_attention_layernorm.forward(self.self_attn.forward(rope, x, meta))
        return self.post_feedforward_layernorm.forward(self.mlp.forward(x)), x


class Olmo2Model(LlamaModel):
    layer_class = Olmo2DecoderLayer


class Olmo2ForCausalLM(LlamaForCausalLM):
    model_class = Olmo2Model


class FlexOlmoForCausalLM(Olmo2ForCausalLM):
    """FlexOlmo: OLMo 2's layers whose MLPs are routed experts (ModelConfig's, as OLMoE's: the softmax's
    top k, not renormalised by default)."""


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 3 (7B, 32B): OLMo 2 with windowed layers (ModelConfig)."""


class Exaone4DecoderLayer(Olmo2DecoderLayer):
    """LG's EXAONE 4.0: OLMo 2's norms after each sublayer, with Qwen3's q/k norms (one per head,
    ModelConfig.qk_norm) in Llama's attention."""

    attention_class = LlamaAttention


class Exaone4Model(LlamaModel):
    layer_class = Exaone4DecoderLayer


class Exaone4ForCausalLM(LlamaForCausalLM):
    """EXAONE 4.0 (1.2B, 32B): OLMo 2's post-norms, per-head q/k norms; the 32B's windowed layers (three
    of four) rotate, its full layers attend without positions (ModelConfig)."""

    model_class = Exaone4Model


class ExaoneMoeForCausalLM(LlamaForCausalLM):
    """LG's K-EXAONE (K-EXAONE-236B-A23B): Llama's layers (norms before each sublayer) with EXAONE 4.0's
    attention (per-head q/k norms; windowed layers rotate, full ones attend without positions) and
    DeepSeek-V3's experts (sigmoid scores through the correction bias, beside a shared one) where
    mlp_layer_types says sparse; its multi-token-prediction layers (``mtp.*``) are not read."""

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        for name, tensor in weights:  # (the correction bias beside the router, as released)
            yield name.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"), tensor

    def reads_checkpoint_tensor(self, name: str) -> bool:
        return not name.startswith("mtp.")


class OlmoeAttention(Olmo2Attention):
    cast_first = True


class OlmoeDecoderLayer(LlamaDecoderLayer):
    """OLMoE's layer: Llama's (norms before each sublayer), OLMo's whole-projection q/k norms, and
    routed experts in every layer (SparseMoeBlock: the softmax's top k, not renormalised by default)."""

    attention_class = OlmoeAttention


class OlmoeModel(LlamaModel):
    layer_class = OlmoeDecoderLayer


class OlmoeForCausalLM(LlamaForCausalLM):
    """OLMoE (OLMoE-1B-7B): 64 experts, 8 per token."""

    model_class = OlmoeModel
