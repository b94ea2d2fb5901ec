"""AI2's OLMo Hybrid (OlmoHybridForCausalLM): Gated DeltaNet layers (three of four by default) beside
OLMo 3's attention layers.

* Its linear-attention layers are Llama's (a norm before each sublayer) with Qwen3.5's Gated DeltaNet
  (gpu_worker.layers.gated_delta_net) under their own names: ``linear_attn.q_proj``, ``k_proj`` and
  ``v_proj`` (read as one in_proj_qkv: the convolution runs over q, k and v in that order), ``g_proj``
  (the output gate, Qwen3.5's z), ``b_proj``, ``a_proj``, ``o_proj``, ``o_norm`` (its epsilon 1e-5
  whatever rms_norm_eps says); under ``linear_allow_neg_eigval`` the write strength is twice the
  sigmoid.
* Its attention layers are OLMo 2's (norms after each sublayer, q/k norms over the whole
  projections), rotating where the config gives a RoPE base and without positions where it is null
  (the released checkpoints).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.layers.gated_delta_net import GatedDeltaNet
from gpu_worker.layers.layernorm import RMSNorm
from gpu_worker.layers.weight_utils import WeightLike
from gpu_worker.mamba_config import GatedDeltaNetConfig
from gpu_worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from gpu_worker.models.olmo2 import Olmo2DecoderLayer
from gpu_worker.models.renamed_checkpoint import joined_parts, rename_parts


class OlmoHybridGatedDeltaNet(GatedDeltaNet):
    def __init__(self, hidden_size: int, config: GatedDeltaNetConfig, eps: float) -> None:
        super().__init__(hidden_size, config, 1e-5)  # (its output norm's epsilon, fixed as FLA's)


class OlmoHybridDecoderLayer(Olmo2DecoderLayer):
    """A linear-attention layer (Llama's norms before each sublayer) or an attention layer (OLMo 2's
    norms after each)."""

    recurrent_class = OlmoHybridGatedDeltaNet

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        LlamaDecoderLayer.__init__(self, config, layer)
        if self.mamba is None:  # (OLMo 2's: no norm before the attention, one after the MLP)
            self.input_layernorm = None
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        else:
            self.post_feedforward_layernorm = None

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mamba is not None:
            return LlamaDecoderLayer.forward(self, rope, hidden, residual, meta)
        return super().forward(rope, hidden, residual, meta)


class OlmoHybridModel(LlamaModel):
    layer_class = OlmoHybridDecoderLayer


class OlmoHybridForCausalLM(LlamaForCausalLM):
    model_class = OlmoHybridModel
    _RENAMED = ((".linear_attn.g_proj.", ".mamba.in_proj_z."), (".linear_attn.b_proj.", ".mamba.in_proj_b."),
                (".linear_attn.a_proj.", ".mamba.in_proj_a."), (".linear_attn.o_proj.", ".mamba.out_proj."),
                (".linear_attn.o_norm.", ".mamba.norm."), (".linear_attn.", ".mamba."),
                # (as released: the linear-attention layers' norms under their own names)
                (".attention_layer_norm.", ".input_layernorm."),
                (".feedforward_layer_norm.", ".post_attention_layernorm."))
    # Tensors read joined (q's rows, then k's, then v's), as transformers' own names and as released.
    _JOINED = {".mamba.in_proj_qkv.weight": (".linear_attn.q_proj.weight", ".linear_attn.k_proj.weight",
                                             ".linear_attn.v_proj.weight"),
               ".mamba.conv1d.weight": (".linear_attn.q_conv1d.weight", ".linear_attn.k_conv1d.weight",
                                        ".linear_attn.v_conv1d.weight")}

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        """Its names as ours, each linear-attention layer's q, k and v projections (and, as released, their
        convolutions) joined as they arrive."""
        for name, tensor in joined_parts(weights, self._JOINED, self.pp_missing_prefixes):
            yield rename_parts(name, self._RENAMED), tensor
