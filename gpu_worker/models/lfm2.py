"""Liquid AI's LFM2 (LFM2-350M / 700M / 1.2B / 2.6B) and LFM2-MoE (LFM2-8B-A1B): a hybrid decoder whose
layers are mostly gated short convolutions (gpu_worker.layers.short_conv), a few grouped-query
attentions with per-head q/k norms between them, each followed by a SwiGLU MLP (routed experts in
LFM2-MoE's layers from num_dense_layers on).

The layers are the Llama block's with transformers' names changed: ``operator_norm`` and
``ffn_norm`` are the input and post-attention norms, ``feed_forward`` (w1 gate, w3 up, w2 down) the
MLP, ``out_proj`` / ``q_layernorm`` / ``k_layernorm`` the attention's o_proj and q/k norms, the
layer's ``conv`` its recurrent mixer (``mamba``, as Granite 4.0-H's Mamba-2 layers are named), and
``embedding_norm`` the final norm (applied after the last layer, despite its name).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from gpu_worker.layers.short_conv import ShortConv
from gpu_worker.layers.weight_utils import WeightLike
from gpu_worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

# transformers' names -> ours (the layer's own ``conv`` first: its convolution is named ``conv`` too).
_RENAMED = ((".self_attn.out_proj.", ".self_attn.o_proj."), (".self_attn.q_layernorm.", ".self_attn.q_norm."),
            (".self_attn.k_layernorm.", ".self_attn.k_norm."), (".operator_norm.", ".input_layernorm."),
            (".ffn_norm.", ".post_attention_layernorm."), (".feed_forward.w1.", ".mlp.gate_proj."),
            (".feed_forward.w3.", ".mlp.up_proj."), (".feed_forward.w2.", ".mlp.down_proj."),
            (".feed_forward.expert_bias", ".mlp.gate.e_score_correction_bias"), (".feed_forward.", ".mlp."),
            ("model.embedding_norm.", "model.norm."))


class Lfm2DecoderLayer(LlamaDecoderLayer):
    recurrent_class = ShortConv


class Lfm2Model(LlamaModel):
    layer_class = Lfm2DecoderLayer


class Lfm2ForCausalLM(LlamaForCausalLM):
    model_class = Lfm2Model

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        for name, tensor in weights:
            if ".conv." in name:  # (model.layers.N.conv.{in_proj, conv, out_proj})
                name = name.replace(".conv.", ".mamba.", 1)
            for theirs, ours in _RENAMED:
                name = name.replace(theirs, ours)
            yield name, tensor


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    """LFM2-MoE: LFM2's layers, routed experts (sigmoid scores chosen through ``expert_bias``) in
    place of the MLP from layer num_dense_layers on."""
