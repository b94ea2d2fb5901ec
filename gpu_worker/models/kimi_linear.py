"""Moonshot AI's Kimi-Linear (KimiLinearForCausalLM: Kimi-Linear-48B-A3B-Base / -Instruct): a hybrid
decoder of Kimi Delta Attention layers (gpu_worker.layers.kimi_delta_attention: the gated delta rule
with a decay per key channel) and, one layer in four, DeepSeek-V3's multi-head latent attention
without positions (mla_use_nope: the latent's "rope" part is kept as a plain part of the key, shared
by the heads); DeepSeek-V3's routed experts (sigmoid scores through a correction bias, renormalised,
times routed_scaling_factor) beside a shared expert, a dense MLP in the first layers.

The checkpoint names both mixers ``self_attn``: a KDA layer's are read as its recurrent mixer's
(``mamba``, as the other hybrids'), its q, k and v projections as one and their three convolutions
as one; the experts are Mixtral's (``block_sparse_moe``, w1 / w3 / w2). transformers' own names (the
decay's projections under ``forget_gate``, ``mlp``) are read too.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from gpu_worker.layers.kimi_delta_attention import KimiDeltaAttention
from gpu_worker.layers.weight_utils import WeightLike
from gpu_worker.models.deepseek import DeepseekDecoderLayer, DeepseekV3ForCausalLM
from gpu_worker.models.llama import LlamaModel
from gpu_worker.models.renamed_checkpoint import joined_parts, recurrent_mixer_name, rename_parts


class KimiLinearDecoderLayer(DeepseekDecoderLayer):
    recurrent_class = KimiDeltaAttention


class KimiLinearModel(LlamaModel):
    layer_class = KimiLinearDecoderLayer


class KimiLinearForCausalLM(DeepseekV3ForCausalLM):
    model_class = KimiLinearModel
    _RENAMED = ((".mamba.forget_gate.", ".mamba."), (".block_sparse_moe.", ".mlp."))
    _JOINED = {".mamba.in_proj_qkv.weight": (".mamba.q_proj.weight", ".mamba.k_proj.weight", ".mamba.v_proj.weight"),
               ".mamba.conv1d.weight": (".mamba.q_conv1d.weight", ".mamba.k_conv1d.weight",
                                        ".mamba.v_conv1d.weight")}

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        renamed = ((rename_parts(recurrent_mixer_name(name, self.config), self._RENAMED), tensor)
                   for name, tensor in weights)
        return joined_parts(renamed, self._JOINED, self.pp_missing_prefixes)
