"""inclusionAI's Ling 3 (BailingHybridForCausalLM: Ling-3.0-Flash): Kimi-Linear's hybrid with its own
turns (gpu_worker.models.kimi_linear):

* its Kimi Delta Attention layers' decay and output gate come from whole projections (``f_proj``,
  ``g_proj``), the decay through the "safe" gate lower_bound * sigmoid(exp(A_log) x) (kda_safe_gate);
* its MLA layers rotate (RoPE in pairs, reordered into halves at load as DeepSeek's) and gate each
  head's output by sigmoid(``g_proj``) of the layer's input;
* its experts' and shared experts' SwiGLU is clipped after the activation at a limit per layer
  (expert_swiglu_limit_list, share_expert_swiglu_limit_list; 0: none), the first layers' MLPs dense
  and unclipped;
* the released checkpoint's names: ``model.word_embeddings``, each layer's mixer ``attention`` (its
  output projection ``dense``), the router's bias ``expert_bias``; its multi-token-prediction layers
  (after the decoder's) are not read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from gpu_worker.config import ModelConfig
from gpu_worker.layers.activation import ClampedSiluAndMul
from gpu_worker.layers.weight_utils import WeightLike
from gpu_worker.models.deepseek import rotary_rows_in_halves
from gpu_worker.models.kimi_linear import KimiLinearDecoderLayer, KimiLinearForCausalLM
from gpu_worker.models.llama import LlamaModel
from gpu_worker.models.renamed_checkpoint import joined_parts, recurrent_mixer_name, rename_parts


class BailingHybridDecoderLayer(KimiLinearDecoderLayer):
    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        routed = config.swiglu_limits[layer] if config.swiglu_limits else 0.0
        shared = config.shared_swiglu_limits[layer] if config.shared_swiglu_limits else 0.0
        experts = getattr(self.mlp, "experts", None)
        if experts is not None and routed:
            experts.activation, experts.swiglu_limit = "silu_clamped", routed
        if getattr(self.mlp, "shared_experts", None) is not None and shared:
            self.mlp.shared_experts.act = ClampedSiluAndMul(shared)


class BailingHybridModel(LlamaModel):
    layer_class = BailingHybridDecoderLayer


class BailingHybridForCausalLM(KimiLinearForCausalLM):
    model_class = BailingHybridModel
    # (As released, then transformers' names of the decay's parameters.)
    _RELEASED = (("model.word_embeddings.", "model.embed_tokens."), (".attention.dense.", ".self_attn.o_proj."),
                 (".attention.", ".self_attn."), (".self_attn.forget_gate.", ".self_attn."),
                 (".mlp.gate.expert_bias", ".mlp.gate.e_score_correction_bias"))

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        """Its names as ours, the MLA layers' rotary rows in halves (after the KDA layers' tensors are
        named as their mixer's, so that only MLA's are reordered), each KDA layer's q, k and v joined."""
        renamed = ((recurrent_mixer_name(rename_parts(name, self._RELEASED), self.config), tensor)
                   for name, tensor in weights)
        skipped = self.pp_missing_prefixes
        return joined_parts(rotary_rows_in_halves(self.config, renamed, skipped), self._JOINED, skipped)
