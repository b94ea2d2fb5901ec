"""MosaicML's MPT (MPTForCausalLM, transformers' MptForCausalLM: mpt-7b and its instruct, chat,
storywriter and 8k models, mpt-30b): ALiBi in place of RoPE (layers.attention), LayerNorms without
biases before attention and MLP, no biases on the projections, q/k/v in one ``Wqkv`` (q's rows, then
k's, then v's: split at load), optionally clamped to [-clip_qkv, clip_qkv], an ungated exact-gelu MLP
(up_proj, down_proj), the head tied to the embedding. Its names (``transformer.wte``,
``transformer.blocks``, ``norm_1`` / ``norm_2``, ``attn``, ``ffn``, ``norm_f``) are read as ours.
"""

from __future__ import annotations

import torch

from gpu_worker.layers.layernorm import LayerNorm
from gpu_worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, UngatedMLP
from gpu_worker.models.renamed_checkpoint import RenamedCheckpoint


class BiaslessLayerNorm(LayerNorm):
    """A LayerNorm with a weight and no bias (MPT's)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(hidden_size, eps, bias=False)


class MptDecoderLayer(LlamaDecoderLayer):
    norm_class = BiaslessLayerNorm
    mlp_class = UngatedMLP  # (up_proj, down_proj)


class MptModel(LlamaModel):
    layer_class = MptDecoderLayer


class MPTForCausalLM(RenamedCheckpoint, LlamaForCausalLM):
    model_class = MptModel
    renames = (("transformer.wte.", "model.embed_tokens."), ("transformer.norm_f.", "model.norm."),
               ("transformer.blocks.", "model.layers."), (".norm_1.", ".input_layernorm."),
               (".norm_2.", ".post_attention_layernorm."), (".attn.out_proj.", ".self_attn.o_proj."),
               (".attn.Wqkv.", ".self_attn.Wqkv."), (".ffn.", ".mlp."))
    fused = ".self_attn.Wqkv."

    def fused_qkv_parts(self, fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rows of ``Wqkv``: q's, then k's, then v's."""
        return tuple(fused.chunk(3))


class MptForCausalLM(MPTForCausalLM):
    """transformers' name for MPT."""
