"""Arcee's AFMoE (AfmoeForCausalLM: Trinity-Nano, Trinity-Mini, Trinity-Large).

The Llama block with these changes, all resolved in ModelConfig but the layer's shape:

* four norms a layer, as Gemma 2's (each sublayer's input and output normed; plain RMSNorms);
* per-head q/k RMSNorms, and a sigmoid gate on the attention's output, one value per head and channel
  from its own projection of the layer's input (``self_attn.gate_proj``), before o_proj;
* windowed layers (``layer_types``; by default three of every ``global_attn_every_n_layers``) rotate
  with RoPE, the full ones attend without positions;
* dense MLPs in the first ``num_dense_layers`` layers, then routed experts chosen by sigmoid scores
  through a correction bias (``expert_bias``), renormalised and times ``route_scale``, beside
  ``num_shared_experts`` ungated shared ones (SparseMoeBlock);
* under ``mup_enabled`` the embeddings (and prompt embeddings) are scaled by sqrt(hidden_size).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.layers.layernorm import RMSNorm
from gpu_worker.layers.weight_utils import WeightLike
from gpu_worker.models.llama import GatedOutputAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from gpu_worker.models.renamed_checkpoint import rename_parts


class AfmoeDecoderLayer(LlamaDecoderLayer):
    attention_class = GatedOutputAttention

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        self.pre_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) in and out, as Llama's layer; each sublayer's output is normed before its
        residual add (fused into the next norm)."""
        return self.sandwich_forward(rope, hidden, residual, meta, self.post_attention_layernorm,
                                     self.pre_mlp_layernorm, self.post_mlp_layernorm)


class AfmoeModel(LlamaModel):
    layer_class = AfmoeDecoderLayer


class AfmoeForCausalLM(LlamaForCausalLM):
    model_class = AfmoeModel

    # The router's and its correction bias's names -> ours (SparseMoeBlock's).
    _RENAMED = ((".mlp.router.gate.", ".mlp.gate."), (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"))

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        return ((rename_parts(name, self._RENAMED), tensor) for name, tensor in weights)

    def lora_module_name(self, module: str) -> str:
        """An adapter's module (its router's) as ours."""
        return rename_parts(f"{module}.", self._RENAMED)[:-1]
