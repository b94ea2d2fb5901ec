"""poolside's Laguna (LagunaForCausalLM: laguna-XS.2) and JetBrains' Mellum (MellumForCausalLM:
Mellum2-12B-A2.5B).

Both are the Llama block (norms before each sublayer) with per-head q/k RMSNorms, a RoPE for each layer
kind (the full layers' base 500,000, the windowed layers' 10,000, plain: ModelConfig's
local_rope_theta) and a dense MLP or routed experts per layer as ``mlp_layer_types`` says.

Laguna: each layer its own number of query heads (``num_attention_heads_per_layer``; the KV heads
the same in every layer, so every layer's cache has one shape), the full layers rotating half of
each head; the attention's output scaled by softplus(g_proj(x)), one value per head broadcast over
its channels (``gating`` true or "per-head") or one per channel ("per-element"); routed experts chosen
by sigmoid scores through a correction bias (ModelConfig: SparseMoeBlock's grouped router, its logits
soft-capped under moe_router_logit_softcapping) beside an ungated shared expert.

Mellum: Qwen3-MoE's attention and experts (the softmax's top k); its multi-token-prediction layer
(``mtp.*``) is not read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

from gpu_worker.config import ModelConfig
from gpu_worker.layers.weight_utils import WeightLike
from gpu_worker.models.llama import GatedOutputAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from gpu_worker.models.renamed_checkpoint import rename_parts


class SoftplusGatedAttention(GatedOutputAttention):
    """Laguna's gate: softplus(g_proj(x)) in fp32, per head (``gating`` true or "per-head") or per channel."""

    gate_name = "g_proj"

    @staticmethod
    def gate_per_head(config: ModelConfig) -> bool:
        gating = config.raw.get("gating", True)
        return gating is True or gating == "per-head"

    @staticmethod
    def activation(gate: torch.Tensor) -> torch.Tensor:
        return F.softplus(gate.float())


class LagunaDecoderLayer(LlamaDecoderLayer):
    attention_class = SoftplusGatedAttention


class LagunaModel(LlamaModel):
    layer_class = LagunaDecoderLayer


class LagunaForCausalLM(LlamaForCausalLM):
    model_class = LagunaModel

    # As released: the router's correction bias beside the experts, the shared expert's name singular.
    _RENAMED = ((".mlp.experts.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
                (".mlp.shared_expert.", ".mlp.shared_experts."))

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        return ((rename_parts(name, self._RENAMED), tensor) for name, tensor in weights)


class MellumForCausalLM(LlamaForCausalLM):
    def reads_checkpoint_tensor(self, name: str) -> bool:
        return not name.startswith("mtp.")
