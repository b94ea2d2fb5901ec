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

import torch

from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.layers.layernorm import RMSNorm
from gpu_worker.layers.short_conv import ShortConv
from gpu_worker.layers.weight_utils import WeightLike
from gpu_worker.models.llama import GatedOutputAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from gpu_worker.models.renamed_checkpoint import rename_parts

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
    renamed = _RENAMED

    def _ours(self, name: str) -> str:
        if ".conv." in name:  # (model.layers.N.conv.{in_proj, conv, out_proj})
            name = name.replace(".conv.", ".mamba.", 1)
        return rename_parts(name, self.renamed)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        for name, tensor in weights:
            yield self._ours(name), tensor

    def lora_module_name(self, module: str) -> str:
        """An adapter's modules as PEFT names them on transformers' model (feed_forward.w1: our
        mlp.gate_proj, ...), read as the checkpoint's tensors are."""
        return self._ours(f"{module}.")[:-1]


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    """LFM2-MoE: LFM2's layers, routed experts (sigmoid scores chosen through ``expert_bias``) in
    place of the MLP from layer num_dense_layers on."""


class Lfm3Attention(GatedOutputAttention):
    """LFM3's attention: Qwen3's (per-head q/k norms), its output scaled per head by sigmoid(gate_proj(x))
    where use_attention_gate (the released name; transformers' g_proj)."""

    @staticmethod
    def gated(config: ModelConfig) -> bool:
        return bool(config.raw.get("use_attention_gate", True))

    @staticmethod
    def gate_per_head(config: ModelConfig) -> bool:
        return True


class Lfm3DecoderLayer(Lfm2DecoderLayer):
    """LFM2's layer with LFM3's attention and, under use_sandwich_norm, each sublayer's output normed
    before its residual add (``post_operator_norm``, ``post_ffn_norm``)."""

    attention_class = Lfm3Attention

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        sandwich = config.raw.get("use_sandwich_norm", True)
        self.post_operator_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if sandwich else None
        self.post_ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if sandwich else None

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if self.post_operator_norm is None:
            return super().forward(rope, hidden, residual, meta)
        return self.sandwich_forward(rope, hidden, residual, meta, self.post_operator_norm,
                                     self.post_attention_layernorm, self.post_ffn_norm)


class Lfm3Model(LlamaModel):
    layer_class = Lfm3DecoderLayer


class Lfm3ForCausalLM(Lfm2ForCausalLM):
    """Liquid AI's LFM3 (LFM3-1.7B): LFM2's short-convolution and attention layers (the convolutions
    conv_L_cache wide) with windowed attention layers beside the full ones, a RoPE per layer kind (the
    full layers' proportional, half of each head's frequencies turning; the windowed layers' plain),
    a sigmoid gate per head on the attention's output, and four norms a layer (use_sandwich_norm)."""

    model_class = Lfm3Model
    # (transformers' name of the attention's gate, g_proj, read as the released gate_proj)
    renamed = ((".self_attn.g_proj.", ".self_attn.gate_proj."), *_RENAMED)
