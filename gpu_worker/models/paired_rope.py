"""Llama-family decoders whose RoPE turns pairs of neighbouring values, (0, 1), (2, 3), ... (GPT-J's
rotation: GLM-4, Cohere's Command models, Kyutai's Helium, Baidu's ERNIE 4.5), where Llama's turns
the two halves of each head. Each head's rotary rows of the query and key projections (and of a LoRA
adapter's B on them) are reordered from pairs into halves as the checkpoint is read: a query and its
keys reordered alike keep every dot product, so Llama's rotation then computes theirs."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from gpu_worker.layers.rotary import head_rows_in_halves
from gpu_worker.layers.weight_utils import WeightLike, materialize
from gpu_worker.models.llama import LlamaForCausalLM

_ROTATED = (".self_attn.q_proj", ".self_attn.k_proj")


class PairedRopeForCausalLM(LlamaForCausalLM):
    def rotary_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows of q or k (weight, bias, LoRA B), each head's rotary part from pairs into halves."""
        return head_rows_in_halves(rows, self.config.head_dim, self.config.rotary_dim)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        for name, tensor in weights:
            if any(f"{part}." in name for part in _ROTATED) and not name.startswith(self.pp_missing_prefixes):
                yield name, self.rotary_rows(materialize(tensor))
            else:
                yield name, tensor

    def lora_b_rows(self, module: str, b: torch.Tensor) -> torch.Tensor:
        """A LoRA adapter's B for ``module``, its rows in the order the base weight's were loaded in."""
        return self.rotary_rows(b) if module.endswith(_ROTATED) else b


class HeliumForCausalLM(PairedRopeForCausalLM):
    """Kyutai's Helium (helium-1-2b, -preview): the Llama block with RoPE in pairs."""


class Ernie4_5ForCausalLM(PairedRopeForCausalLM):
    """Baidu's ERNIE 4.5 dense (ERNIE-4.5-0.3B): the Llama block with RoPE in pairs and, under use_bias,
    biases on every attention and MLP projection."""


class Ernie4_5_MoeForCausalLM(Ernie4_5ForCausalLM):
    """ERNIE 4.5's mixture-of-experts models (ERNIE-4.5-21B-A3B, -300B-A47B): ERNIE's layers with routed
    experts beside shared ones (SparseMoeBlock, ModelConfig's routing). The correction bias is read
    from Baidu's name (``mlp.moe_statics``) or transformers' (``mlp.gate.moe_statics``); the
    multi-token-prediction layers (``mtp_*``) are not read."""

    _STATICS = (".mlp.moe_statics.e_score_correction_bias", ".mlp.gate.moe_statics.e_score_correction_bias")

    def reads_checkpoint_tensor(self, name: str) -> bool:
        return "mtp" not in name

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        return super().checkpoint_tensors(self._statics_renamed(weights))

    def _statics_renamed(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        for name, tensor in weights:
            statics = next((part for part in self._STATICS if name.endswith(part)), None)
            if statics is None:
                yield name, tensor
            else:  # ([1, experts] as stored: one group)
                yield (name.removesuffix(statics) + ".mlp.gate.e_score_correction_bias",
                       materialize(tensor).reshape(-1))
