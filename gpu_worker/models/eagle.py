"""EAGLE and EAGLE-3 draft heads (speculative decoding's methods ``eagle`` and ``eagle3``; what
each is: gpu_worker/eagle_config.py), run by the hidden-state drafter (gpu_worker/hidden_state_drafter.py)
as the MTP layer is: ``forward(token ids, positions, metadata, previous_hidden=feature)`` gives the
head's output at each position, which is also the feature its next draft takes, and
``compute_logits`` its logits over the target's vocabulary.

Checkpoint names are the EAGLE authors': ``fc.*``, ``layers.{i}.*`` (EAGLE) or ``midlayer.*``
(EAGLE-3), ``norm.weight``, ``lm_head.weight``, ``d2t`` (read under ``model.`` as our stack holds
them; ``embed_tokens`` and EAGLE-3's ``t2d`` are not read).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.eagle_config import EagleHead
from gpu_worker.layers.attention import PagedAttention
from gpu_worker.layers.embedding import ParallelLMHead
from gpu_worker.layers.layernorm import RMSNorm
from gpu_worker.layers.linear import QKVParallelLinear
from gpu_worker.layers.rotary import RotaryEmbedding
from gpu_worker.layers.weight_utils import WeightLike
from gpu_worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class _EagleStack(nn.Module):
    def __init__(self, config: ModelConfig, layers: list[nn.Module], fc_in: int, fc_bias: bool) -> None:
        super().__init__()
        # (None where the head takes the target's last hidden state as it is.)
        self.fc = nn.Linear(fc_in, config.hidden_size, bias=fc_bias).requires_grad_(False) if fc_in else None
        self.layers = nn.ModuleList(layers)
        self.rotary_emb = RotaryEmbedding(config.rotary_dim or config.head_dim, config.max_context_len,
                                          config.rope_theta, config.rope_scaling)


class _EagleHeadBase(nn.Module):
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.eagle is None:
            raise ValueError(f"{config.architecture} is built from an EAGLE head's config (eagle_head_config)")
        self.config = config
        self.head: EagleHead = config.eagle
        self.model: _EagleStack
        # The target's embedding (and LM head where the head has none): set by share_with, kept out
        # of this module's parameters.
        self._target: tuple[nn.Module, nn.Module] | None = None

    def share_with(self, target: nn.Module) -> None:
        """Take the target model's token embedding (and LM head) as this head's."""
        self._target = (target.model.embed_tokens, target.lm_head)

    def reads_checkpoint_tensor(self, name: str) -> bool:
        """The head's own tensors: not the checkpoint's copy of the target's embedding, nor a head
        the target's stands for, nor EAGLE-3's target-to-draft mask."""
        name = name.removeprefix("model.")
        if name.endswith("embed_tokens.weight") or name == "t2d" or (name.startswith("fc.") and self.model.fc is None):
            return False
        return not name.startswith("lm_head.") or self.lm_head is not None

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        """Named as the EAGLE authors name them (the loader puts the stack's under ``model.``): some
        checkpoints hold every name under ``model.``, and EAGLE-3's authors name the layer ``midlayer``."""
        for name, tensor in weights:
            bare = name.removeprefix("model.")
            yield (f"layers.0.{bare[len('midlayer.'):]}" if bare.startswith("midlayer.") else bare), tensor

    def combine_hidden_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """The feature the head takes from the target's hidden states (as the target gave them)."""
        return hidden

    def _embeds(self, input_ids: torch.Tensor, inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        if self._target is None:
            raise RuntimeError("share_with(target) must come before the EAGLE head runs")
        return self._target[0].forward(input_ids) if inputs_embeds is None else inputs_embeds

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]


class EagleLlamaForCausalLM(_EagleHeadBase):
    """EAGLE-1's head: fc([embedding, feature]) through its decoder layers; the target's LM head on
    their output, un-normed (HASS: the embedding and the feature each normed before fc)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        width, eps = config.hidden_size, config.rms_norm_eps
        layers = [LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        if not self.head.first_input_norm:
            layers[0].input_layernorm = nn.Identity()  # (the EAGLE authors' first layer has no input norm)
        self.model = _EagleStack(config, layers, 2 * width, self.head.fc_bias)
        if self.head.para_norms:
            self.model.embedding_layernorm = RMSNorm(width, eps)
            self.model.hidden_states_layernorm = RMSNorm(width, eps)
        self.lm_head = None  # (the target's)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None, intermediate: object = None,
                previous_hidden: torch.Tensor | None = None) -> torch.Tensor:
        embeds = self._embeds(input_ids, inputs_embeds)
        feature = torch.zeros_like(embeds) if previous_hidden is None else previous_hidden
        if self.head.para_norms:
            embeds = self.model.embedding_layernorm.forward(embeds)
            feature = self.model.hidden_states_layernorm.forward(feature)
        hidden = self.model.fc.forward(torch.cat((embeds, feature), dim=-1))
        rope = self.model.rotary_emb.cos_sin(positions)
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer.forward(rope, hidden, residual, meta)
        return hidden + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocab logits on TP rank 0 (the target's head), None on the other ranks."""
        assert self._target is not None
        return self._target[1](hidden)


class Eagle3LlamaForCausalLM(_EagleHeadBase):
    """EAGLE-3's head: one layer whose attention reads [input_layernorm(embedding), hidden_norm(feature)]
    (the feature un-normed as its residual, or normed with norm_before_residual); its output, normed,
    through its own head over the draft vocabulary, mapped to the target's ids (the rest -inf)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        head, width, eps = self.head, config.hidden_size, config.rms_norm_eps
        layer = LlamaDecoderLayer(config, 0)
        attention = layer.self_attn
        attention.qkv_proj = QKVParallelLinear(2 * width, config.head_dim, config.num_attention_heads,
                                               config.num_key_value_heads, bias=config.qkv_bias)
        layer.hidden_norm = RMSNorm(width, eps)
        self.model = _EagleStack(config, [layer], len(head.aux_layer_ids) * head.target_hidden_size, fc_bias=False)
        self.model.norm = RMSNorm(width, eps)
        self.lm_head = ParallelLMHead(head.draft_vocab_size, width) if head.own_lm_head else None
        # Each draft id's offset to the target's id (d2t); none when the vocabularies are one.
        self.d2t = (nn.Parameter(torch.zeros(head.draft_vocab_size, dtype=torch.long), requires_grad=False)
                    if head.maps_ids else None)

    def combine_hidden_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's inner hidden states side by side [tokens, 3 x width] -> the feature (or its
        last hidden state, as it is)."""
        return hidden if self.model.fc is None else self.model.fc.forward(hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None, intermediate: object = None,
                previous_hidden: torch.Tensor | None = None) -> torch.Tensor:
        embeds = self._embeds(input_ids, inputs_embeds)
        feature = torch.zeros_like(embeds) if previous_hidden is None else previous_hidden
        layer = self.model.layers[0]
        if self.head.norm_before_residual:
            feature = residual = layer.hidden_norm.forward(feature)
        else:
            residual, feature = feature, layer.hidden_norm.forward(feature)
        rope = self.model.rotary_emb.cos_sin(positions)
        hidden = layer.self_attn.forward(rope, torch.cat((layer.input_layernorm.forward(embeds), feature), dim=-1),
                                         meta)
        hidden, residual = layer.post_attention_layernorm.forward(hidden, residual)
        return layer.mlp.forward(hidden) + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits over the target's vocabulary on TP rank 0 (the draft vocabulary's, each at its
        target id; -inf elsewhere), None on the other ranks."""
        assert self._target is not None
        normed = self.model.norm.forward(hidden)
        if self.lm_head is None:
            return self._target[1](normed)
        logits = self.lm_head(normed)
        if logits is None or self.d2t is None:
            return logits
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        full[:, torch.arange(self.head.draft_vocab_size, device=logits.device) + self.d2t] = logits
        return full


EAGLE_HEADS: dict[str, type[_EagleHeadBase]] = {
    "EagleLlamaForCausalLM": EagleLlamaForCausalLM,
    "Eagle3LlamaForCausalLM": Eagle3LlamaForCausalLM,
}
