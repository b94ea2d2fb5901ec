"""Zhipu's GLM-4 (Glm4ForCausalLM: GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1-9B / 32B, GLM-Z1-Rumination):
Llama's attention with q/k/v biases (none on o_proj) and RoPE over the first half of each head, and
two more norms a layer: one on the attention's output and one on the MLP's, each before its residual
add (``post_self_attn_layernorm``, ``post_mlp_layernorm``; ``post_attention_layernorm`` is the norm
before the MLP, as in Llama). The first GLM-4 release (GlmForCausalLM: glm-4-9b-chat-hf, glm-4-9b-hf,
glm-edge) is the same without those two norms. Aleph Alpha's Kolibri 1 has GLM-4's layer around its
own attention and experts (Kolibri1ForCausalLM).

Its RoPE turns pairs of neighbouring values (GPT-J's) where Llama's turns halves: each head's rotary
rows of the query and key projections (and of a LoRA adapter's B) are reordered into halves as they
are read. Its checkpoints store the MLP's gate and up projections as one (``gate_up_proj``), split
at load.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.layers.layernorm import RMSNorm
from gpu_worker.layers.weight_utils import WeightLike, gate_and_up
from gpu_worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from gpu_worker.models.paired_rope import PairedRopeForCausalLM
from gpu_worker.models.renamed_checkpoint import rename_parts


class Glm4DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        self.post_self_attn_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sandwich_forward(rope, hidden, residual, meta, self.post_self_attn_layernorm,
                                     self.post_attention_layernorm, self.post_mlp_layernorm)


class Glm4Model(LlamaModel):
    layer_class = Glm4DecoderLayer


class GlmForCausalLM(PairedRopeForCausalLM):
    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        return super().checkpoint_tensors(self._split_gate_up(weights))

    @staticmethod
    def _split_gate_up(weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        for name, tensor in weights:
            if ".mlp.gate_up_proj." in name:
                yield from gate_and_up(name, tensor)
            else:
                yield name, tensor


class Glm4ForCausalLM(GlmForCausalLM):
    model_class = Glm4Model


class Kolibri1ForCausalLM(LlamaForCausalLM):
    """Aleph Alpha's Kolibri 1 (Kolibri1ForCausalLM): GLM-4's four norms a layer around EXAONE 4.0's
    attention (per-head q/k norms; the windowed layers rotate, the full ones attend without positions, in
    Llama's halves) and routed experts in every layer beside an ungated shared one, chosen by the router's
    logits plus a correction bias and weighted by their sigmoids (ModelConfig's "sigmoid_logits"); its
    released names (``moe.router.expert_bias``, ``post_attn_norm``, ``post_ffn_norm``) read as ours."""

    model_class = Glm4Model
    _RENAMED = ((".moe.router.expert_bias", ".mlp.gate.e_score_correction_bias"),
                (".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
                (".post_attn_norm.", ".post_self_attn_layernorm."), (".post_ffn_norm.", ".post_mlp_layernorm."))

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        return ((rename_parts(name, self._RENAMED), tensor) for name, tensor in weights)
