"""ModernBERT's decoder (ModernBertDecoderForCausalLM: the Ettin decoders, ettin-decoder-17m .. -1b).

ModernBERT's layers run causally over the paged cache:
* the token embeddings normed (a LayerNorm, also over prompt embeddings given), the first layer's
  attention reading them without a norm of its own; pre-norm layers, a final norm; LayerNorms without
  biases unless norm_bias says so;
* multi-head attention (``attn.q_proj``, ``k_proj``, ``v_proj``, ``Wo``) with RoPE at the global base on the
  full-attention layers (every third from the first) and the local base on the others, which attend
  through a window of local_attention // 2 keys;
* a GeGLU MLP (``Wi``: the activation's input rows, then the gate's; ``Wo``);
* the head: a dense layer, its activation and a norm (``lm_head``), then the vocabulary projection
  (``decoder``, tied to the embeddings by default, with a bias under decoder_bias).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from gpu_worker.config import ModelConfig
from gpu_worker.layers.layernorm import LayerNorm
from gpu_worker.layers.weight_utils import WeightLike, gate_and_up
from gpu_worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from gpu_worker.models.modernbert import ModernBertPredictionHead
from gpu_worker.models.renamed_checkpoint import rename_parts


class _Unnormed(nn.Module):
    """The first layer's attention input: the embeddings' norm already applied (no residual yet)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is not None:
            raise RuntimeError("the first layer has no residual to add")
        return x


class ModernBertDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        self.input_layernorm = (LayerNorm(config.hidden_size, config.rms_norm_eps, bias=config.norm_bias) if layer
                                else _Unnormed())
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps, bias=config.norm_bias)



class ModernBertDecoderModel(LlamaModel):
    layer_class = ModernBertDecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        if self.embed_norm is not None:
            self.embed_norm = LayerNorm(config.hidden_size, config.rms_norm_eps, bias=config.norm_bias)
        if self.stage.last:
            self.norm = LayerNorm(config.hidden_size, config.rms_norm_eps, bias=config.norm_bias)


class ModernBertDecoderForCausalLM(LlamaForCausalLM):
    model_class = ModernBertDecoderModel

    @property
    def lm_head_bias(self) -> bool:  # (read as the head is built: the config's)
        return bool(self.config.raw.get("decoder_bias", True))

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.head_transform = ModernBertPredictionHead(config, fp32=False) if self.lm_head is not None else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return super().compute_logits(hidden if self.head_transform is None else self.head_transform.forward(hidden))

    _RENAMED = (("model.embeddings.tok_embeddings.", "model.embed_tokens."),
                ("model.embeddings.norm.", "model.embed_norm."), ("model.final_norm.", "model.norm."),
                (".attn_norm.", ".input_layernorm."), (".mlp_norm.", ".post_attention_layernorm."),
                (".attn.Wo.", ".self_attn.o_proj."), (".attn.", ".self_attn."), (".mlp.Wo.", ".mlp.down_proj."),
                ("lm_head.", "head_transform."), ("decoder.", "lm_head."))

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        for name, tensor in weights:
            if self.head_transform is None and name.startswith("lm_head."):
                continue  # (the head's transform, where this model or stage has no head)
            name = rename_parts(name, self._RENAMED)
            if ".mlp.Wi." in name:
                yield from gate_and_up(name, tensor, ".mlp.Wi.", ".mlp.gate_proj.", ".mlp.up_proj.")
            else:
                yield name, tensor
