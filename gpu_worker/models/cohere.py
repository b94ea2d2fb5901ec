"""Cohere's Command models: Command-R / R+ and Aya 23 / Aya Expanse (CohereForCausalLM), Command-R7B
and Command-A (Cohere2ForCausalLM), and Cohere2-MoE (Cohere2MoeForCausalLM).

Both run each layer's attention and SwiGLU MLP side by side on the same normed input and add both
outputs to the residual (no norm between them); their norms are LayerNorms without a bias (the mean
taken out, fp32 statistics); the logits are scaled by logit_scale (ModelConfig.logits_scaling is its
inverse). Command-R+ norms each query and key head with weights of its own (use_qk_norm). Cohere2
windows three layers of four (layer_types, sliding_window) and rotates only in those: its
full-attention layers have no positions.

Their RoPE turns each head's values in pairs (0, 1), (2, 3), ... where Llama turns halves: the
query and key projections' rows (and a per-head norm's weights, and a LoRA adapter's B) are reordered
from pairs into halves as they are read, which leaves every dot product of a query and a key as it
was, so Llama's rotation then computes Cohere's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.layers.layernorm import LayerNorm, RMSNorm
from gpu_worker.layers.rotary import pairs_to_halves_order
from gpu_worker.layers.weight_utils import WeightLike, copy_into, materialize
from gpu_worker.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaModel, SparseMoeBlock
from gpu_worker.models.paired_rope import PairedRopeForCausalLM


class CohereLayerNorm(LayerNorm):
    """LayerNorm without a bias: (x - mean) / sqrt(var + eps) * w, statistics and scale in fp32, as
    transformers' CohereLayerNorm."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(hidden_size, eps, bias=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.weight.shape, self.weight.float(), None, self.eps).to(x.dtype)


class HeadLayerNorm(nn.Module):
    """Command-R+'s query (or key) norm: a bias-free LayerNorm over each head's values, with weights of
    each head's own ([this rank's heads, head_dim]; ``first_head``: the first of them in the
    checkpoint's [heads, head_dim])."""

    def __init__(self, num_heads: int, head_dim: int, eps: float, first_head: int) -> None:
        super().__init__()
        self.eps, self.first_head = eps, first_head
        self.weight = nn.Parameter(torch.ones(num_heads, head_dim), requires_grad=False)
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, loaded: WeightLike, shard_id: int | str | None = None) -> None:
        copy_into(param, loaded.narrow(0, self.first_head, param.shape[0]))

    def forward(self, heads: torch.Tensor) -> torch.Tensor:
        """[tokens, heads, head_dim] -> the same, normed."""
        normed = F.layer_norm(heads.float(), heads.shape[-1:], None, None, self.eps)
        return (normed * self.weight.float()).to(heads.dtype)


class CohereAttention(LlamaAttention):
    """Llama's attention (its q/k norm path) with Command-R+'s norms of each head's own weights."""

    def __init__(self, config: ModelConfig, layer: int = 0, norm_class: type[RMSNorm] = RMSNorm) -> None:
        super().__init__(config, layer, norm_class)
        qkv = self.qkv_proj
        if config.raw.get("use_qk_norm"):
            self.q_norm = HeadLayerNorm(self.num_heads, self.head_dim, config.rms_norm_eps,
                                        qkv.tp_rank * self.num_heads)
            self.k_norm = HeadLayerNorm(self.num_kv_heads, self.head_dim, config.rms_norm_eps, qkv._kv_head_start())


class CohereDecoderLayer(LlamaDecoderLayer):
    norm_class = CohereLayerNorm
    attention_class = CohereAttention

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        self.post_attention_layernorm = None  # (one norm a layer: attention and MLP read the same input)

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        return self.parallel_forward(rope, hidden, residual, meta)


class CohereModel(LlamaModel):
    layer_class = CohereDecoderLayer


class CohereForCausalLM(PairedRopeForCausalLM):
    model_class = CohereModel
    # Command-R+'s head norms: their columns follow each head's values.
    _HEAD_NORMS = (".self_attn.q_norm.weight", ".self_attn.k_norm.weight")

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        return super().checkpoint_tensors(self._head_norms_in_halves(weights))

    def _head_norms_in_halves(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        for name, tensor in weights:
            if name.endswith(self._HEAD_NORMS) and not name.startswith(self.pp_missing_prefixes):
                yield name, materialize(tensor).index_select(-1, pairs_to_halves_order(self.config.head_dim))
            else:
                yield name, tensor


class Cohere2ForCausalLM(CohereForCausalLM):
    """Command-R7B / Command-A: Cohere's layers, three of four windowed and rotating, the fourth
    attending to everything without positions."""


class CohereMoeBlock(SparseMoeBlock):
    """Cohere2-MoE's routed experts (the softmax over the top k logits, or their sigmoids, renormalised
    under norm_topk_prob: ModelConfig) beside its shared experts, the two outputs averaged where
    shared_expert_combination_strategy is "average" (summed where "sum")."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.halved = (config.shared_expert_intermediate_size > 0
                       and config.raw.get("shared_expert_combination_strategy", "average") == "average")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out.mul_(0.5) if self.halved else out


class Cohere2MoeDecoderLayer(CohereDecoderLayer):
    moe_class = CohereMoeBlock


class Cohere2MoeRMSNormDecoderLayer(Cohere2MoeDecoderLayer):
    norm_class = RMSNorm


class Cohere2MoeModel(LlamaModel):
    layer_class = Cohere2MoeDecoderLayer


class Cohere2MoeRMSNormModel(LlamaModel):
    layer_class = Cohere2MoeRMSNormDecoderLayer


class Cohere2MoeForCausalLM(Cohere2ForCausalLM):
    """Cohere2-MoE: Command-R7B's layers (attention beside the MLP on one norm, RoPE in pairs in the
    windowed layers and, where prefix_dense_sliding_window_pattern is 1, in the dense prefix layers)
    with routed experts after first_k_dense_replace dense ones (prefix_dense_intermediate_size wide),
    beside num_shared_experts shared ones; its norms RMSNorms where rms_norm_eps is set, else Cohere's
    bias-free LayerNorms."""

    @property
    def model_class(self) -> type[nn.Module]:  # type: ignore[override]  # (read as the model is built)
        return Cohere2MoeRMSNormModel if self.config.raw.get("cohere_norm") == "rms" else Cohere2MoeModel
