"""A model's multi-token-prediction (MTP) layer, as speculative decoding's drafter (vLLM's ``mtp``
method): DeepSeek-V3 / V3.1 / R1 and GLM-4.5 / 4.6 / 4.7 were trained with one, and their checkpoints
hold it after the decoder's layers (``model.layers.{num_hidden_layers}.``); Qwen3-Next's and Qwen3.5's
hold theirs apart, under ``mtp.`` (Qwen3NextMTP: the same layout under other names, with Gemma's
norms, no zeroed first position, and its output normed before it goes on).

At position p it takes the token after p (its embedding, normed: ``enorm``) and the target's last
hidden state at p (after the final norm, normed again: ``hnorm``), projects the two side by side back
to the hidden width (``eh_proj``), runs one decoder layer of the model's own kind over that (with a
KV cache of its own), and its output, normed (``shared_head.norm``) through the target's LM head,
predicts the token after next. The embedding at position 0 is zeroed (DeepSeek's and GLM's, as
vLLM runs them). Drafting
further, the layer takes its own output as the hidden state (gpu_worker/hidden_state_drafter.py).

The embedding and the LM head are the target model's (the checkpoint's MTP layer holds copies of
them, ``embed_tokens`` and ``shared_head.head``: DeepSeek-V3's report shares them), so they are
neither read nor held twice. A checkpoint with several MTP layers is drafted for by the first, as
vLLM does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.layers.attention import PagedAttention
from gpu_worker.layers.layernorm import GemmaRMSNorm, RMSNorm
from gpu_worker.layers.rotary import RotaryEmbedding
from gpu_worker.layers.weight_utils import WeightLike
from gpu_worker.models.deepseek import DeepseekDecoderLayer, DeepseekV2ForCausalLM, rotary_rows_in_halves
from gpu_worker.models.deepseek_v32 import DeepseekV32DecoderLayer
from gpu_worker.models.llama import Glm4MoeForCausalLM, LlamaDecoderLayer
from gpu_worker.models.qwen3_next import Qwen3NextDecoderLayer, Qwen3NextForCausalLM

# The MTP layer's tensors in the checkpoint that the target model's own stand for.
_SHARED_WITH_TARGET = (".embed_tokens.", ".shared_head.head.")


class _MtpStack(nn.Module):
    """Named as the checkpoint names the layer: ``model.layers.{index}``."""

    def __init__(self, config: ModelConfig, layer: nn.Module, index: int) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(index): layer})
        self.rotary_emb = RotaryEmbedding(config.rotary_dim or config.head_dim, config.max_context_len,
                                          config.rope_theta, config.rope_scaling)


class MtpForCausalLM(nn.Module):
    layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer
    packed_modules_mapping: dict[str, tuple[str, int | str]] = {}
    # The kind of its three norms (enorm, hnorm, shared_head.norm).
    norm_class: type[RMSNorm] = RMSNorm
    # Whether the embedding at position 0 is zeroed (DeepSeek's and GLM's, as vLLM runs them), and
    # whether the layer's output is normed before it goes on as the next draft's hidden state (else
    # only before the LM head).
    zeroes_first_position = True
    normed_output_goes_on = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if not config.num_mtp_layers:
            raise ValueError(f"{config.architecture}: the checkpoint's config names no multi-token-prediction "
                             "layer (num_nextn_predict_layers, or mtp_num_hidden_layers)")
        self.config = config
        self.index = config.num_hidden_layers  # (the first MTP layer's number)
        layer = self.layer_class(config, self.index)
        width, eps = config.hidden_size, config.rms_norm_eps
        layer.enorm = self.norm_class(width, eps)
        layer.hnorm = self.norm_class(width, eps)
        layer.eh_proj = nn.Linear(2 * width, width, bias=False).requires_grad_(False)
        layer.shared_head = nn.Module()
        layer.shared_head.norm = self.norm_class(width, eps)
        self.model = _MtpStack(config, layer, self.index)
        # No head of its own: the checkpoint's copy is not read (``share_with``).
        self.lm_head = None
        # The target's embedding and LM head (set by share_with; kept out of this module's parameters).
        self._target: tuple[nn.Module, nn.Module] | None = None

    @property
    def layer(self) -> LlamaDecoderLayer:
        """The MTP layer (registered once, under the checkpoint's name: the loader expects each name)."""
        return self.model.layers[str(self.index)]

    def share_with(self, target: nn.Module) -> None:
        """Take the target model's embedding and LM head as this layer's."""
        self._target = (target.model.embed_tokens, target.lm_head)

    def reads_checkpoint_tensor(self, name: str) -> bool:
        """Whether a checkpoint tensor is the first MTP layer's own (not its embedding's or head's
        copy): the rest of the checkpoint is not read (nor dequantized)."""
        return name.startswith(f"model.layers.{self.index}.") and not any(part in name for part in _SHARED_WITH_TARGET)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        """The tensors read (reads_checkpoint_tensor: the first MTP layer's own); ValueError at the end
        when there were none."""
        found = False
        for name, tensor in weights:
            found = True
            yield name, tensor
        if not found:  # (a re-saved or quantized copy may leave it out, and its config not say so)
            raise ValueError(f"the checkpoint holds no multi-token-prediction layer (model.layers.{self.index}.*), "
                             "though its config "
                             f"names {self.config.num_mtp_layers} (num_nextn_predict_layers): speculative method "
                             "mtp needs the checkpoint as released")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None, intermediate: object = None,
                previous_hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output (before ``shared_head.norm``, unless normed_output_goes_on) at each
        position, from the token after it (``input_ids``) and the target's (or this layer's own)
        hidden state there (``previous_hidden``; None: zeros, as the memory profile runs it)."""
        if self._target is None:
            raise RuntimeError("share_with(target) must come before the MTP layer runs")
        layer = self.layer
        embeds = self._target[0].forward(input_ids) if inputs_embeds is None else inputs_embeds
        if self.zeroes_first_position:
            embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0.0)
        if previous_hidden is None:
            previous_hidden = torch.zeros_like(embeds)
        hidden = layer.eh_proj.forward(torch.cat((layer.enorm.forward(embeds),
                                                  layer.hnorm.forward(previous_hidden)), dim=-1))
        hidden, residual = layer.forward(self.model.rotary_emb.cos_sin(positions), hidden, None, meta)
        if self.normed_output_goes_on:
            return layer.shared_head.norm.forward(hidden, residual)[0]
        return hidden + residual

    def combine_hidden_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's last hidden states are the layer's input as they are."""
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocab logits of the token after next on TP rank 0, None on the other ranks."""
        assert self._target is not None
        return self._target[1](hidden if self.normed_output_goes_on else self.layer.shared_head.norm.forward(hidden))

    def attention_layers(self) -> list[PagedAttention]:
        return [self.layer.self_attn.attn]


class Glm4MoeMTPModel(MtpForCausalLM):
    """GLM-4.5's MTP layer: a GLM-4.5 decoder layer (routed experts beside a shared one)."""

    packed_modules_mapping = Glm4MoeForCausalLM.packed_modules_mapping


class DeepSeekMTPModel(MtpForCausalLM):
    """DeepSeek-V3's MTP layer: a DeepSeek decoder layer (latent attention, routed experts), its
    rotary rows reordered at load as the target's are."""

    layer_class = DeepseekDecoderLayer
    packed_modules_mapping = DeepseekV2ForCausalLM.packed_modules_mapping

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        return rotary_rows_in_halves(self.config, super().checkpoint_tensors(weights))


class DeepSeekV32MTPModel(DeepSeekMTPModel):
    """DeepSeek-V3.2's MTP layer: its decoder layer, whose attention is DeepSeek Sparse Attention (an
    indexer of its own over the layer's own cache rows)."""

    layer_class = DeepseekV32DecoderLayer


class Qwen3NextMTP(MtpForCausalLM):
    """Qwen3-Next's and Qwen3.5's MTP layer (vLLM's Qwen3NextMTP / Qwen3_5MTP): one gated full-attention
    layer of the model's kind, its MLP routed as the decoder's first layer's is, held under ``mtp.``:
    ``pre_fc_norm_embedding`` and ``pre_fc_norm_hidden`` (our enorm and hnorm), ``fc`` (eh_proj),
    ``layers.0`` and ``norm`` (shared_head.norm), all its norms Gemma's (1 + w). Position 0's embedding
    is not zeroed, and its output goes on normed (the final norm belongs to the layer, not the head)."""

    layer_class = Qwen3NextDecoderLayer
    packed_modules_mapping = Qwen3NextForCausalLM.packed_modules_mapping
    norm_class = GemmaRMSNorm
    zeroes_first_position = False
    normed_output_goes_on = True
    _RENAMES = (("mtp.pre_fc_norm_embedding.", "enorm."), ("mtp.pre_fc_norm_hidden.", "hnorm."),
                ("mtp.fc.", "eh_proj."), ("mtp.norm.", "shared_head.norm."), ("mtp.layers.0.", ""))

    def reads_checkpoint_tensor(self, name: str) -> bool:
        return name.startswith(("mtp.pre_fc_norm_", "mtp.fc.", "mtp.norm.", "mtp.layers.0.", "mtp.embed_tokens."))

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        found = False
        for name, tensor in weights:
            if name.startswith("mtp.embed_tokens."):  # (mtp_use_dedicated_embeddings: none released so)
                raise ValueError("the checkpoint's MTP layer has an embedding of its own (mtp.embed_tokens), which "
                                 "this drafter does not read: it drafts through the model's")
            for old, new in self._RENAMES:
                if name.startswith(old):
                    found = True
                    yield f"model.layers.{self.index}.{new}{name[len(old):]}", tensor
                    break
        if not found:
            raise ValueError(f"the checkpoint holds no multi-token-prediction layer (mtp.*), though its config names "
                             f"{self.config.num_mtp_layers} (mtp_num_hidden_layers): speculative method mtp needs "
                             "the checkpoint as released")


# The architectures whose checkpoints may hold MTP layers -> their MTP drafter (named as vLLM's).
MTP_DRAFTERS: dict[str, type[MtpForCausalLM]] = {
    "DeepseekV3ForCausalLM": DeepSeekMTPModel,
    "DeepseekV32ForCausalLM": DeepSeekV32MTPModel,
    "Glm4MoeLiteForCausalLM": DeepSeekMTPModel,  # (GLM-4.7-Flash: latent attention, as DeepSeek-V3's)
    "Glm4MoeForCausalLM": Glm4MoeMTPModel,
    "Qwen3NextForCausalLM": Qwen3NextMTP,
    "Qwen3_5ForCausalLM": Qwen3NextMTP,
    "Qwen3_5MoeForCausalLM": Qwen3NextMTP,
}


def mtp_config(target: ModelConfig) -> ModelConfig:
    """The configuration the MTP drafter of ``target``'s model is built from; ValueError when the
    model has no MTP layer to draft with."""
    import dataclasses

    name = target.architecture
    if name not in MTP_DRAFTERS or not target.num_mtp_layers:
        families = ("DeepSeek-V3 / R1 (DeepseekV3ForCausalLM), DeepSeek-V3.2 (DeepseekV32ForCausalLM), GLM-4.5 and "
                    "later (Glm4MoeForCausalLM), GLM-4.7-Flash (Glm4MoeLiteForCausalLM), Qwen3-Next "
                    "(Qwen3NextForCausalLM), Qwen3.5 (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM)")
        why = ("its config names no multi-token-prediction layer (num_nextn_predict_layers, or Qwen's "
               "mtp_num_hidden_layers)"
               if name in MTP_DRAFTERS else
               "its MTP layer attends through an indexer of its own (DeepSeek Sparse Attention), which the "
               "drafter does not run" if target.index_topk and target.num_mtp_layers else "its architecture has none")
        raise ValueError(f"speculative method mtp drafts with the model's own multi-token-prediction layer, and "
                         f"{name} has none: {why}. Served with one: {families}")
    drafter = MTP_DRAFTERS[name]
    if drafter is Qwen3NextMTP:
        # One full-attention layer after the decoder's (no recurrent state), routed as layer 0 is.
        moe = target.moe_layers + (target.layer_is_moe(0),) if target.moe_layers else ()
        return dataclasses.replace(target, architecture=drafter.__name__, mamba=None, mamba_layers=(), moe_layers=moe)
    return dataclasses.replace(target, architecture=drafter.__name__)
