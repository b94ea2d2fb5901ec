"""NVIDIA Nemotron-H (Nemotron-H 8B / 47B / 56B, Nemotron Nano 9B v2 and 12B v2, Nemotron 3 Nano): a
hybrid decoder whose every layer is one block behind its own RMSNorm and residual add: a Mamba-2
mixer (most layers), a self-attention without positions (a few), an ungated MLP of relu(x)^2, or
(Nemotron 3) routed experts of that MLP beside a shared one (ModelConfig.block_types, from the
config's hybrid_override_pattern "M", "*", "-", "E").

Checkpoint names as released (``backbone.embeddings``, ``backbone.layers.N.mixer.*``,
``backbone.norm_f``; transformers 5 saves them so too) are read into ours (``model.embed_tokens``,
``model.layers.N.mixer.*``, ``model.norm``), as are transformers 5's module names (``model.embeddings``,
``model.norm_f``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker import distributed
from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.layers.attention import PagedAttention
from gpu_worker.layers.embedding import VocabParallelEmbedding
from gpu_worker.layers.fused_moe import FusedMoE, select_experts_grouped
from gpu_worker.layers.layernorm import RMSNorm
from gpu_worker.layers.mamba import MambaMixer2
from gpu_worker.layers.mamba1 import MambaMixer
from gpu_worker.layers.weight_utils import WeightLike
from gpu_worker.mamba_config import Mamba1Config
from gpu_worker.models.llama import LlamaAttention, PipelineStage, UngatedMLP
from gpu_worker.models.single_stage import SingleStageCausalLM


class NemotronHMoE(nn.Module):
    """Nemotron 3's routed experts: an fp32 router (``gate``, its ``e_score_correction_bias``) picks
    each token's top k by sigmoid scores through the bias within the best groups, the weights the
    unbiased scores renormalised times routed_scaling_factor (DeepSeek-V3's routing); the experts are
    ungated relu^2 MLPs (optionally in a latent width, ``fc1_latent_proj`` / ``fc2_latent_proj``
    around them), beside an ungated shared expert. One all-reduce sums every rank's partial outputs."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False, dtype=torch.float32)
        self.gate.requires_grad_(False)
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts, dtype=torch.float32),
                                                         requires_grad=False)
        self.renormalize, self.scaling = config.norm_topk_prob, config.routed_scaling_factor
        self.num_groups, self.topk_groups = config.moe_num_groups, config.moe_topk_groups
        latent = config.moe_latent_size
        # (Replicated on every rank: the experts' rows are their width.)
        self.fc1_latent_proj = (nn.Linear(config.hidden_size, latent, bias=config.mlp_bias).requires_grad_(False)
                                if latent else None)
        self.fc2_latent_proj = (nn.Linear(latent, config.hidden_size, bias=config.mlp_bias).requires_grad_(False)
                                if latent else None)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, latent or config.hidden_size,
                                config.moe_intermediate_size, expert_parallel=config.expert_parallel,
                                activation="relu2")
        self.tp_size = self.experts.tp_size
        self.shared_experts = UngatedMLP(config, config.shared_expert_intermediate_size, reduce_results=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts_grouped(self.gate.forward(hidden.float()), self.experts.top_k, self.renormalize,
                                              self.gate.e_score_correction_bias, self.num_groups, self.topk_groups,
                                              self.scaling, "sigmoid")
        rows = hidden if self.fc1_latent_proj is None else self.fc1_latent_proj.forward(hidden)
        out = self.experts.forward(rows, weights, ids)
        if self.fc2_latent_proj is not None:  # (linear: each rank's partial sum projects to its share;
            # a bias only on rank 0, so the all-reduce counts it once)
            out = F.linear(out, self.fc2_latent_proj.weight,
                           self.fc2_latent_proj.bias if distributed.get_tp_rank() == 0 else None)
        out += self.shared_experts.forward(hidden)
        if self.tp_size > 1:
            distributed.all_reduce(out)
        return out


class NemotronHBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.kind = config.block_types[layer]
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.kind == "mamba":
            mixer_class = MambaMixer if isinstance(config.mamba, Mamba1Config) else MambaMixer2
            self.mixer: nn.Module = mixer_class(config.hidden_size, config.mamba, config.rms_norm_eps)
        elif self.kind == "attention":  # (Llama's attention: rope_layers leave every layer unrotated)
            self.mixer = LlamaAttention(config, layer)
        elif self.kind == "moe":
            self.mixer = NemotronHMoE(config)
        else:
            self.mixer = UngatedMLP(config)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) in and out, the residual add fused into the next norm."""
        if residual is None:
            residual, hidden = hidden, self.norm.forward(hidden)
        else:
            hidden, residual = self.norm.forward(hidden, residual)
        if self.kind == "mamba":
            return self.mixer.forward((), hidden, meta), residual
        if self.kind == "attention":
            return self.mixer.forward((), hidden, meta), residual
        return self.mixer.forward(hidden), residual


class NemotronHModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.stage = PipelineStage(config)  # (one stage: a model with Mamba-2 layers is not split)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(NemotronHBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        hidden = self.embed_tokens.forward(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            hidden, residual = layer.forward(hidden, residual, meta)
        hidden, _ = self.norm.forward(hidden, residual)
        return hidden


class NemotronHForCausalLM(SingleStageCausalLM):
    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}
    # The released names (and transformers 5's module names) -> ours.
    _RENAMED = (("backbone.embeddings.", "model.embed_tokens."), ("backbone.norm_f.", "model.norm."),
                ("backbone.", "model."), ("model.embeddings.", "model.embed_tokens."), ("model.norm_f.", "model.norm."))

    model_class = NemotronHModel

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        for name, tensor in weights:
            yield self.lora_module_name(name), tensor

    def lora_module_name(self, name: str) -> str:
        """A checkpoint's (or an adapter's) name as ours: backbone.layers.N.mixer our model.layers.N.mixer."""
        for theirs, ours in self._RENAMED:
            if name.startswith(theirs):
                return ours + name[len(theirs):]
        return name

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.mixer.attn for layer in self.model.layers if layer.kind == "attention"]

    def mamba_layers(self) -> list[MambaMixer2]:
        return [layer.mixer for layer in self.model.layers if layer.kind == "mamba"]


class Mamba2ForCausalLM(NemotronHForCausalLM):
    """A pure Mamba-2 language model (Mamba-Codestral-7B): Nemotron-H's blocks, every one a Mamba-2
    mixer, under the same checkpoint names (``backbone.embeddings``, ``backbone.layers.N.mixer``,
    ``backbone.norm_f``)."""


class MambaForCausalLM(NemotronHForCausalLM):
    """A Mamba (selective SSM, "Mamba-1") language model (state-spaces' mamba-130m ... 2.8b):
    Nemotron-H's blocks, every one a Mamba mixer (gpu_worker.layers.mamba1), under the same checkpoint
    names (``backbone.embeddings``, ``backbone.layers.N.mixer``, ``backbone.norm_f``)."""


class FalconMambaForCausalLM(MambaForCausalLM):
    """TII's Falcon-Mamba-7B: Mamba's blocks, dt, B and C RMS-normed (without weights) before the scan."""
