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

Pipeline parallelism is refused (the shared caches cross the stages); prompt embeddings given
without token ids take the per-layer inputs from the embeddings' projection alone.
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
from gpu_worker.layers.embedding import VocabParallelEmbedding
from gpu_worker.layers.fused_moe import FusedMoE
from gpu_worker.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from gpu_worker.layers.rotary import RotaryEmbedding
from gpu_worker.layers.weight_utils import WeightLike
from gpu_worker.models.gemma import GemmaForCausalLM
from gpu_worker.models.gemma3n import Gemma3nRMSNorm
from gpu_worker.models.llama import PipelineStage

_TOWER_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
_LANGUAGE_MODEL_PREFIX = "model.language_model."
Shared = dict[int, tuple[torch.Tensor, torch.Tensor, PagedAttention]]


class Gemma4Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, g: Gemma4Config) -> None:
        super().__init__()
        hd = self.head_dim = g.head_dims[layer]
        self.source = g.kv_sources[layer]
        heads = config.num_attention_heads
        if self.source is None:
            self.qkv_proj = QKVParallelLinear(config.hidden_size, hd, heads, g.num_kv_heads[layer],
                                              bias=config.qkv_bias)
            self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
            self.k_norm = Gemma3nRMSNorm(hd, config.rms_norm_eps)
            self.v_norm = Gemma3nRMSNorm(hd, config.rms_norm_eps, with_scale=False)
            self.attn: PagedAttention | None = PagedAttention(self.num_heads, self.num_kv_heads, hd,
                                                              config.attention_scale,
                                                              config.layer_sliding_window(layer))
        else:  # (queries only: the keys and values are the source layer's, through its attention)
            self.q_proj = ColumnParallelLinear(config.hidden_size, heads * hd, bias=config.qkv_bias)
            self.num_heads = self.q_proj.output_size_per_partition // hd
            self.attn = None
        self.q_norm = Gemma3nRMSNorm(hd, config.rms_norm_eps)
        self.o_proj = RowParallelLinear(heads * hd, config.hidden_size, bias=config.qkv_bias)

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, meta: AttentionMetadata, shared: Shared,
                layer: int) -> torch.Tensor:
        tokens, hd = hidden.shape[0], self.head_dim
        if self.source is None:
            q_size, kv_size = self.num_heads * hd, self.num_kv_heads * hd
            q, k, v = self.qkv_proj.forward(hidden).split([q_size, kv_size, kv_size], dim=-1)
            k = RotaryEmbedding.rotate_(self.k_norm.forward(k.reshape(tokens, self.num_kv_heads, hd)), rope[0], rope[1])
            v = self.v_norm.forward(v.reshape(tokens, self.num_kv_heads, hd))
            attn = self.attn
            assert attn is not None
            shared[layer] = (k, v, attn)
        else:
            q = self.q_proj.forward(hidden)
            k, v, attn = shared[self.source]
        q = RotaryEmbedding.rotate_(self.q_norm.forward(q.reshape(tokens, self.num_heads, hd)), rope[0], rope[1])
        # (A sharing layer writes its source's keys and values to the slots they already fill.)
        return self.o_proj.forward(attn.forward(q, k, v, meta))


class Gemma4MLP(nn.Module):
    def __init__(self, config: ModelConfig, width: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [width] * 2)
        self.down_proj = RowParallelLinear(width, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
        return self.down_proj.forward(F.gelu(gate, approximate="tanh") * up)


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
        self.self_attn = Gemma4Attention(config, layer, g)
        self.mlp = Gemma4MLP(config, g.intermediate_sizes[layer])
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


class Gemma4Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if distributed.get_pp_world_size() > 1:
            raise ValueError("Gemma4ForCausalLM is not served under pipeline parallelism (its shared KV caches cross "
                             "the stages)")
        g = config.gemma4
        assert g is not None
        self.g = g
        self.stage = PipelineStage(config)
        hidden, per_layer = config.hidden_size, g.hidden_size_per_layer_input
        self.num_layers = config.num_hidden_layers
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden)
        self.register_buffer("embed_scale", torch.tensor(hidden ** 0.5), persistent=False)
        self.embed_tokens_per_layer = self.per_layer_model_projection = self.per_layer_projection_norm = None
        if per_layer:
            self.embed_tokens_per_layer = VocabParallelEmbedding(g.vocab_size_per_layer_input,
                                                                 self.num_layers * per_layer)
            self.register_buffer("per_layer_embed_scale", torch.tensor(per_layer ** 0.5), persistent=False)
            self.per_layer_model_projection = nn.Linear(hidden, self.num_layers * per_layer,
                                                        bias=False).requires_grad_(False)
            self.per_layer_projection_norm = Gemma3nRMSNorm(per_layer, config.rms_norm_eps)
        # The full layers' heads (their proportional RoPE) and the windowed layers' (plain RoPE).
        full_dims = {g.head_dims[i] for i, local in enumerate(config.sliding_window_layers or ()) if not local}
        self.rotary_emb = RotaryEmbedding(max(full_dims, default=config.head_dim), config.max_context_len,
                                          config.rope_theta, config.rope_scaling)
        self.local_rotary_emb = RotaryEmbedding(config.head_dim, config.max_context_len,
                                                config.local_rope_theta or 10000.0)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(config, i, g) for i in range(self.num_layers))
        self.norm = Gemma3nRMSNorm(hidden, config.rms_norm_eps)

    def per_layer_inputs(self, input_ids: torch.Tensor | None, embeds: torch.Tensor) -> torch.Tensor | None:
        """[tokens, layers, per_layer] (None without per-layer inputs): the normed projection of the
        embeddings, plus (with the token ids) their per-layer rows, times 1 / sqrt(2)."""
        if self.per_layer_model_projection is None or self.per_layer_projection_norm is None:
            return None
        per_layer = self.g.hidden_size_per_layer_input
        projection = self.per_layer_model_projection(embeds) * embeds.shape[-1] ** -0.5
        projection = self.per_layer_projection_norm.forward(projection.reshape(-1, self.num_layers, per_layer))
        if input_ids is None or self.embed_tokens_per_layer is None:
            return projection
        rows = self.embed_tokens_per_layer.forward(input_ids) * self.per_layer_embed_scale.to(embeds.dtype)
        return (projection + rows.reshape(-1, self.num_layers, per_layer)) * 2.0 ** -0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        assert intermediate is None  # (one pipeline stage)
        if inputs_embeds is None:
            hidden = self.embed_tokens.forward(input_ids) * self.embed_scale.to(self.embed_tokens.weight.dtype)
            per_layer_inputs = self.per_layer_inputs(input_ids, hidden)
        else:
            hidden = inputs_embeds
            per_layer_inputs = self.per_layer_inputs(None, hidden)
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
    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        g = self.config.gemma4
        assert g is not None
        sharing = {f"model.layers.{i}.self_attn." for i, source in enumerate(g.kv_sources) if source is not None}
        keys_as_values = {f"model.layers.{i}.self_attn.k_proj." for i, same in enumerate(g.k_eq_v) if same}
        for name, tensor in weights:
            if name.startswith(_TOWER_PREFIXES):
                continue
            if name.startswith(_LANGUAGE_MODEL_PREFIX):
                name = "model." + name[len(_LANGUAGE_MODEL_PREFIX):]
            prefix = name[: name.find(".self_attn.") + len(".self_attn.")] if ".self_attn." in name else ""
            # (A sharing layer's own keys and values are never computed, as in transformers: not read.)
            if prefix in sharing and name[len(prefix):].split(".", 1)[0] in ("k_proj", "v_proj", "k_norm", "v_norm"):
                continue
            yield name, tensor
            # (attention_k_eq_v: a full layer's values are its keys' projection, read as both.)
            if prefix and name.startswith(tuple(keys_as_values)):
                yield name.replace(".self_attn.k_proj.", ".self_attn.v_proj."), tensor

    def attention_layers(self) -> list[PagedAttention]:
        """The layers holding a cache: those computing their own keys and values."""
        return [layer.self_attn.attn for layer in self.model.layers if layer.self_attn.attn is not None]
