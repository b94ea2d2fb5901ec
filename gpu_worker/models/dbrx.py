"""Databricks' DBRX (DbrxForCausalLM: dbrx-base, dbrx-instruct): Llama's layers with LayerNorms without
biases, q/k/v in one ``Wqkv`` (q's rows, then the KV heads' k's, then v's: split at load) clamped to
[-clip_qkv, clip_qkv], and routed experts in every layer (the softmax's top k, renormalised as its
moe_normalize_expert_weights of 1 asks). Its names read as ours: ``transformer.wte``,
``transformer.blocks.{i}.norm_attn_norm.{norm_1, attn, norm_2}``, ``ffn.router.layer`` (the router)
and ``ffn.experts.mlp.{w1, v1, w2}``, every expert's gate, up and (transposed) down rows stacked in one
tensor each: handed to the experts one expert at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from gpu_worker.layers.weight_utils import WeightLike
from gpu_worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from gpu_worker.models.mpt import BiaslessLayerNorm
from gpu_worker.models.renamed_checkpoint import RenamedCheckpoint

# DBRX's stacked expert tensors -> each expert's projection (and whether its rows are transposed: w2
# holds each expert's down projection as [intermediate, hidden]).
_EXPERT_STACKS = {"w1": ("gate_proj", False), "v1": ("up_proj", False), "w2": ("down_proj", True)}


class DbrxDecoderLayer(LlamaDecoderLayer):
    norm_class = BiaslessLayerNorm


class DbrxModel(LlamaModel):
    layer_class = DbrxDecoderLayer


class DbrxForCausalLM(RenamedCheckpoint, LlamaForCausalLM):
    model_class = DbrxModel
    renames = (("transformer.wte.", "model.embed_tokens."), ("transformer.norm_f.", "model.norm."),
               ("transformer.blocks.", "model.layers."), (".norm_attn_norm.norm_1.", ".input_layernorm."),
               (".norm_attn_norm.norm_2.", ".post_attention_layernorm."),
               (".norm_attn_norm.attn.out_proj.", ".self_attn.o_proj."),
               (".norm_attn_norm.attn.Wqkv.", ".self_attn.Wqkv."), (".ffn.router.layer.", ".mlp.gate."),
               (".ffn.experts.mlp.", ".mlp.experts."))
    fused = ".self_attn.Wqkv."

    def fused_qkv_parts(self, fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rows of ``Wqkv``: the query heads', then the KV heads' keys, then their values."""
        config = self.config
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        return tuple(fused.split([q, kv, kv]))

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        """Each stacked expert tensor (every expert's rows, [experts x intermediate, hidden]) as one
        lazily read tensor per expert, under the names the experts load: a rank reads only the rows
        of its experts' slices (tensor or expert parallelism)."""
        width = self.config.moe_intermediate_size
        for name, tensor in super().checkpoint_tensors(weights):
            stack = name.rsplit(".", 1)[-1]
            if ".mlp.experts." not in name or stack not in _EXPERT_STACKS:
                yield name, tensor
                continue
            projection, transposed = _EXPERT_STACKS[stack]
            for expert in range(self.config.num_experts):
                yield (f"{name.rsplit('.', 1)[0]}.{expert}.{projection}.weight",
                       ExpertRows(tensor, expert * width, width, transposed))


class ExpertRows:
    """One expert's rows [width, hidden] of a stacked DBRX tensor, or their transpose [hidden, width]
    (w2's down projection), read on ``narrow`` as a lazy checkpoint tensor is (WeightLike)."""

    __slots__ = ("_first", "_stack", "_transposed", "_width", "shape")

    def __init__(self, stack: WeightLike, first: int, width: int, transposed: bool) -> None:
        self._stack, self._first, self._width, self._transposed = stack, first, width, transposed
        hidden = stack.shape[1]
        self.shape = torch.Size((hidden, width) if transposed else (width, hidden))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        along_rows = dim == (1 if self._transposed else 0)  # (the expert's own rows in the stack)
        if along_rows:
            rows = self._stack.narrow(0, self._first + start, length)
        else:
            rows = self._stack.narrow(0, self._first, self._width).narrow(1, start, length)
        return rows.t() if self._transposed else rows
