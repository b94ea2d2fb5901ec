"""The Swiss AI Initiative's Apertus (ApertusForCausalLM: Apertus-8B / 70B and their instruct models):
Llama's attention with a norm over each query and key head (ModelConfig.qk_norm), an ungated MLP
(up_proj, down_proj) whose activation is xIELU, with two learned scalars a layer (``mlp.act_fn``),
and the norms before each sublayer named ``attention_layernorm`` and ``feedforward_layernorm``.
xIELU's beta and eps are fixed in transformers (0.5, -1e-6); a checkpoint stating others is refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from gpu_worker.layers.activation import XIELU
from gpu_worker.layers.weight_utils import WeightLike, materialize
from gpu_worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, UngatedMLP
from gpu_worker.models.renamed_checkpoint import RenamedCheckpoint


class ApertusDecoderLayer(LlamaDecoderLayer):
    mlp_class = UngatedMLP


class ApertusModel(LlamaModel):
    layer_class = ApertusDecoderLayer


class ApertusForCausalLM(RenamedCheckpoint, LlamaForCausalLM):
    model_class = ApertusModel
    renames = ((".attention_layernorm.", ".input_layernorm."),
               (".feedforward_layernorm.", ".post_attention_layernorm."), (".mlp.act_fn.", ".mlp.act."))
    _FIXED = {".mlp.act_fn.beta": XIELU.BETA, ".mlp.act_fn.eps": XIELU.EPS}

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        return super().checkpoint_tensors(self._fixed_scalars_checked(weights))

    def _fixed_scalars_checked(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        """xIELU's beta and eps buffers (saved beside its learned scalars) left out once checked to be
        the values computed with."""
        for name, tensor in weights:
            fixed = next((value for suffix, value in self._FIXED.items() if name.endswith(suffix)), None)
            if fixed is None:
                yield name, tensor
                continue
            value = float(materialize(tensor).float().reshape(-1)[0])
            if abs(value - fixed) > 1e-2 * abs(fixed):  # (bf16's rounding of the fixed value passes)
                raise ValueError(f"checkpoint tensor {name!r} is {value}; xIELU is served with {fixed} (transformers')")
