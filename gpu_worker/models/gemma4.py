"""Google's Gemma 4 language model (Gemma4ForCausalLM; the gemma-4 releases as
Gemma4ForConditionalGeneration, served on text: their vision and audio towers are not read), as
transformers' Gemma4TextModel computes it (gpu_worker.gemma4_config names the parts):

* Gemma 3's layer (norms before and after the attention and the MLP; q/k/v normed per head, v without
  a scale; unscaled scores) with a learnt scalar on its output;
* windowed layers of ``head_dim``-wide heads with plain RoPE, full layers of ``global_head_dim``-wide
  heads with proportional RoPE (a quarter of the head turning), and, under ``attention_k_eq_v``, their
  own KV heads whose values are the keys' projection (the checkpoint's k_proj read as v_proj too). The
  KV cache keeps each layer's own geometry;
* per-layer inputs as Gemma 3n's (a row of their own table plus a projection of the token's
  embedding), gated into each layer's output;
* KV sharing as Gemma 3n's: the last ``num_kv_shared_layers`` layers attend over the cache of the last
  earlier layer of their kind (its PagedAttention, called with that layer's keys and values of the
  pass) and hold none; their MLPs twice as wide under ``use_double_wide_mlp``;
* with ``enable_moe_block``, routed experts beside every layer's MLP: a router (a scale-free norm,
  a learnt scale, the softmax's top k renormalised and scaled per expert) over experts of gelu-gated
  MLPs, their output normed and added to the MLP's;
* logits soft-capped where final_logit_softcapping is set; the head tied to the embedding.

Pipeline parallelism is refused (the shared caches cross the stages), and so are prompt embeddings
where it has per-layer inputs (read by token id: transformers recovers the ids from the embeddings),
and prefill/decode disaggregation (its layers' caches differ in shape); a LoRA adapter on a full
layer's k_proj under ``attention_k_eq_v`` is refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker import distributed
from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.gemma4_config import Gemma4Config
from gpu_worker.layers.attention import PagedAttention
from gpu_worker.layers.fused_moe import FusedMoE
from gpu_worker.layers.weight_utils import WeightLike
from gpu_worker.models.gemma import GemmaForCausalLM
from gpu_worker.models.gemma3n import (
    Gemma3nForCausalLM,
    Gemma3nRMSNorm,
    KVSharingAttention,
    PerLayerInputsModel,
    Shared,
    language_model_tensors,
)
from gpu_worker.models.llama import LlamaMLP


class Gemma4Router(nn.Module):
    """Each token's top k experts: the softmax (fp32) over proj(norm(x) * scale / sqrt(hidden)), its top
    k renormalised, each weight times its expert's per_expert_scale."""

    def __init__(self, config: ModelConfig, g: Gemma4Config) -> None:
        super().__init__()
        self.top_k = g.top_k_experts
        self.norm = Gemma3nRMSNorm(config.hidden_size, config.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(config.hidden_size, g.num_experts, bias=False).requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(config.hidden_size), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(g.num_experts), requires_grad=False)
        self.root_size = config.hidden_size ** -0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.proj(self.norm.forward(x) * self.scale * self.root_size)
        probabilities = F.softmax(scores, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probabilities, k=self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, g: Gemma4Config) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.layer = layer
        self.local_rope = bool(config.sliding_window_layers) and config.sliding_window_layers[layer]
        self.self_attn = KVSharingAttention(config, layer, g.head_dims[layer], g.num_kv_heads[layer],
                                            g.kv_sources[layer])
        self.mlp = LlamaMLP(config, g.intermediate_sizes[layer])
        self.input_layernorm = Gemma3nRMSNorm(hidden, eps)
        self.post_attention_layernorm = Gemma3nRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma3nRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = Gemma3nRMSNorm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        self.per_layer_input_gate = self.per_layer_projection = self.post_per_layer_input_norm = None
        if g.hidden_size_per_layer_input:
            width = g.hidden_size_per_layer_input
            self.per_layer_input_gate = nn.Linear(hidden, width, bias=False).requires_grad_(False)
            self.per_layer_projection = nn.Linear(width, hidden, bias=False).requires_grad_(False)
            self.post_per_layer_input_norm = Gemma3nRMSNorm(hidden, eps)
        self.router = self.experts = None
        if g.num_experts:
            self.router = Gemma4Router(config, g)
            self.experts = FusedMoE(g.num_experts, g.top_k_experts, hidden, g.moe_intermediate_size,
                                    expert_parallel=config.expert_parallel, activation="gelu_pytorch_tanh")
            self.post_feedforward_layernorm_1 = Gemma3nRMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = Gemma3nRMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = Gemma3nRMSNorm(hidden, eps)

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, per_layer_input: torch.Tensor | None,
                meta: AttentionMetadata, shared: Shared) -> torch.Tensor:
        attn = self.self_attn.forward(rope, self.input_layernorm.forward(hidden), meta, shared, self.layer)
        residual = hidden + self.post_attention_layernorm.forward(attn)
        out = self.mlp.forward(self.pre_feedforward_layernorm.forward(residual))
        if self.router is not None and self.experts is not None:
            weights, ids = self.router.forward(residual)
            routed = self.experts.forward(self.pre_feedforward_layernorm_2.forward(residual), weights, ids)
            if self.experts.tp_size > 1:
                distributed.all_reduce(routed)
            out = self.post_feedforward_layernorm_1.forward(out) + self.post_feedforward_layernorm_2.forward(routed)
        hidden = residual + self.post_feedforward_layernorm.forward(out)
        if self.per_layer_input_gate is not None:
            assert self.per_layer_projection is not None and self.post_per_layer_input_norm is not None
            gated = F.gelu(self.per_layer_input_gate(hidden), approximate="tanh") * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm.forward(self.per_layer_projection(gated))
        return hidden * self.layer_scalar


class Gemma4Model(PerLayerInputsModel):
    def __init__(self, config: ModelConfig) -> None:
        g = config.gemma4
        assert g is not None
        # (The full layers' heads: their proportional RoPE's width.)
        full_dims = {g.head_dims[i] for i, local in enumerate(config.sliding_window_layers or ()) if not local}
        super().__init__(config, "Gemma4ForCausalLM", g.hidden_size_per_layer_input, g.vocab_size_per_layer_input,
                         dtype_scalars=False, full_head_dim=max(full_dims, default=config.head_dim))
        self.g = g
        self.layers = nn.ModuleList(Gemma4DecoderLayer(config, i, g) for i in range(self.num_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        assert intermediate is None  # (one pipeline stage)
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        per_layer_inputs = self.per_layer_inputs(None if inputs_embeds is not None else input_ids, hidden)
        rope = self.rotary_emb.cos_sin(positions)
        local = self.local_rotary_emb.cos_sin(positions)
        shared: Shared = {}
        for i, layer in enumerate(self.layers):
            hidden = layer.forward(local if layer.local_rope else rope, hidden,
                                   None if per_layer_inputs is None else per_layer_inputs[:, i], meta, shared)
        return self.norm.forward(hidden)


class Gemma4ForCausalLM(GemmaForCausalLM):
    """Gemma 4's language model (see the module's docstring); a Gemma4ForConditionalGeneration
    checkpoint's language model is read under its prefix, its towers skipped."""

    model_class = Gemma4Model  # type: ignore[assignment]
    _LANGUAGE_MODEL_PREFIXES = Gemma3nForCausalLM._LANGUAGE_MODEL_PREFIXES
    _VISION_PREFIXES = Gemma3nForCausalLM._VISION_PREFIXES
    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        g = self.config.gemma4
        assert g is not None
        keys_as_values = tuple(f"model.layers.{i}.self_attn.k_proj." for i, same in enumerate(g.k_eq_v) if same)
        for name, tensor in language_model_tensors(weights, g.kv_sources):
            yield name, tensor
            # (attention_k_eq_v: a full layer's values are its keys' projection, read as both.)
            if keys_as_values and name.startswith(keys_as_values):
                yield name.replace(".self_attn.k_proj.", ".self_attn.v_proj."), tensor

    def lora_module_name(self, module: str) -> str:
        """(Refused: an adapter on a full layer's k_proj under attention_k_eq_v, whose values are that
        projection too; its delta would reach the keys alone.)"""
        g = self.config.gemma4
        assert g is not None
        for i, same in enumerate(g.k_eq_v):
            if same and module.endswith(f"layers.{i}.self_attn.k_proj"):
                raise ValueError(f"a LoRA adapter on {module} (its values are the keys' projection under "
                                 "attention_k_eq_v) is not served")
        return module

    def attention_layers(self) -> list[PagedAttention]:
        """The layers holding a cache: those computing their own keys and values."""
        return [layer.self_attn.attn for layer in self.model.layers if layer.self_attn.attn is not None]
