"""Gemma, Gemma 2 and Gemma 3 (text) decoders.

Each is the Llama block with Gemma's choices:
* RMSNorms scale by (1 + w) in fp32 (``GemmaRMSNorm``); the MLP is GeGLU (tanh-approximated gelu);
* the embeddings are multiplied by sqrt(hidden_size), rounded to the model's dtype; the head is tied;
* Gemma 2 and 3 norm the attention's and the MLP's outputs too before each residual add (four
  norms a layer), scale scores by query_pre_attn_scalar ** -0.5, and alternate sliding-window and
  full-attention layers (Gemma 2 every other layer; Gemma 3 five windowed layers to one full);
* Gemma 2 caps attention scores and the final logits softly (cap * tanh(x / cap));
* Gemma 3 norms each query and key head (as Qwen3 does, with Gemma's norm), and rotates its
  windowed layers with plain RoPE of their own base (10k), its full layers with rope_theta (1M) and
  rope_scaling.
All of these are ModelConfig fields, so one implementation serves the three.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.layers.embedding import VocabParallelEmbedding
from gpu_worker.layers.layernorm import GemmaRMSNorm
from gpu_worker.layers.rotary import RotaryEmbedding
from gpu_worker.layers.weight_utils import LANGUAGE_MODEL_PREFIXES, VISION_SIDE_PREFIXES, WeightLike
from gpu_worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, PipelineStage, PPMissingLayer


class GemmaDecoderLayer(LlamaDecoderLayer):
    """Llama's layer with Gemma's norms (Gemma); Gemma 2/3 also norm the attention's and the MLP's
    outputs before each residual add."""

    norm_class = GemmaRMSNorm

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        # (VaultGemma: Gemma 2 without the norms after each sublayer, its MLP's norm pre_feedforward_layernorm.)
        sandwich = config.architecture not in ("GemmaForCausalLM", "VaultGemmaForCausalLM")
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps) if sandwich else None
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps) if sandwich else None

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pre_feedforward_layernorm is None:
            return super().forward(rope, hidden, residual, meta)
        return self.sandwich_forward(rope, hidden, residual, meta, self.post_attention_layernorm,
                                     self.pre_feedforward_layernorm, self.post_feedforward_layernorm)


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.stage = stage = PipelineStage(config)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size) if stage.holds_embedding
                             else PPMissingLayer())
        # sqrt(hidden_size) in the model's dtype, as transformers multiplies by it (55.4256 is 55.5 in bf16).
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size ** 0.5), persistent=False)
        self.rotary_emb = RotaryEmbedding(config.rotary_dim or config.head_dim, config.max_context_len,
                                          config.rope_theta, config.rope_scaling)
        self.local_rotary_emb = (None if config.local_rope_theta is None else
                                 RotaryEmbedding(config.rotary_dim or config.head_dim, config.max_context_len,
                                                 config.local_rope_theta))
        self.layers = stage.layers(config, GemmaDecoderLayer)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps) if stage.last else PPMissingLayer()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As LlamaModel's (a pipeline stage's ``intermediate`` in, or out before the last stage)."""
        if intermediate is None:
            # (Prompt embeddings come scaled, as transformers' embedding module gives them: see embed_input_ids.)
            hidden = (self.embed_tokens.forward(input_ids) * self.embed_scale if inputs_embeds is None
                      else inputs_embeds)
            residual = None
        else:
            hidden, residual = intermediate
        rope = self.rotary_emb.cos_sin(positions)
        local = rope if self.local_rotary_emb is None else self.local_rotary_emb.cos_sin(positions)
        for layer in self.layers[self.stage.start:self.stage.end]:
            hidden, residual = layer.forward(local if layer.local_rope else rope, hidden, residual, meta)
        if not self.stage.last:
            return hidden, residual
        hidden, _ = self.norm.forward(hidden, residual)
        return hidden


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma (2B, 7B, CodeGemma): the Llama block with Gemma's norms, GeGLU and scaled embeddings."""

    model_class = GemmaModel

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The table's rows times sqrt(hidden_size): what transformers' Gemma embedding module gives
        (``get_input_embeddings()(ids)``), so the prompt embeddings a client makes with it are the
        rows the model runs."""
        return self.model.embed_tokens.forward(input_ids) * self.model.embed_scale


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Gemma 2 (2B, 9B, 27B): four norms a layer, soft caps, windowed and full layers alternating."""


class VaultGemmaForCausalLM(GemmaForCausalLM):
    """Google's VaultGemma (vaultgemma-1b, trained with differential privacy): Gemma 2's attention (soft
    caps, query_pre_attn_scalar, windowed layers where layer_types says) with Llama's two norms a layer,
    the MLP's read from the checkpoint's ``pre_feedforward_layernorm``."""

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        for name, tensor in weights:
            yield name.replace(".pre_feedforward_layernorm.", ".post_attention_layernorm."), tensor


class Gemma3ForCausalLM(GemmaForCausalLM):
    """Gemma 3's text decoder (the 1B model; the larger ones' language model): q/k head norms, five
    windowed layers to one full, and a RoPE base for each kind.

    Gemma 3 4B/12B/27B ship as vision-language checkpoints (Gemma3ForConditionalGeneration): their
    language model's tensors are read under its prefix, and the vision tower's and projector's are
    skipped (we serve text)."""

    # Checkpoint prefix of the language model -> ours (transformers 4.50's layout, then 4.52's).
    _LANGUAGE_MODEL_PREFIXES = LANGUAGE_MODEL_PREFIXES
    _VISION_PREFIXES = VISION_SIDE_PREFIXES

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        for name, tensor in weights:
            if name.startswith(self._VISION_PREFIXES):
                continue
            for theirs, ours in self._LANGUAGE_MODEL_PREFIXES:
                if name.startswith(theirs):
                    name = ours + name[len(theirs):]
                    break
            yield name, tensor
