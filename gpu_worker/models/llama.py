"""Llama-architecture decoder (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3, Phi-3, Granite, and the
mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE, Granite MoE and GLM-4.5).

The variants differ only in config flags (QKV bias, o_proj bias, Qwen3's per-head q/k norms, tied
embeddings, RoPE scaling, a sliding window on all or some layers, routed experts in place of some
or all layers' MLPs, a gated shared expert), which ``ModelConfig`` has already resolved, so one
implementation serves all of them.

Submodules are called through ``.forward`` rather than ``__call__``: this code registers no hooks,
and nn.Module's call path costs a few microseconds per call, about 30 calls per decode step of a
two-layer model (on the CPU, where a small model's step is dominated by such overheads).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from gpu_worker import distributed
from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.layers.activation import gated_activation, ungated_activation
from gpu_worker.layers.attention import PagedAttention, alibi_slopes
from gpu_worker.layers.embedding import (
    ParallelLMHead,
    PositionEmbedding,
    SinusoidalPositionEmbedding,
    VocabParallelEmbedding,
)
from gpu_worker.layers.encoder_attention import EncoderAttention
from gpu_worker.layers.fused_moe import FusedMoE, select_experts, select_experts_grouped, select_experts_sparsemixer
from gpu_worker.layers.layernorm import LayerNorm, RMSNorm
from gpu_worker.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from gpu_worker.layers.mamba import MambaMixer2
from gpu_worker.layers.rotary import RotaryEmbedding, llama_4_query_scale
from gpu_worker.layers.weight_utils import WeightLike, gate_and_up
from gpu_worker.models.renamed_checkpoint import rename_first, rename_parts


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0, norm_class: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        heads = config.layer_attention_heads(layer)  # (Laguna's differ by layer)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, heads, config.num_key_value_heads,
                                          bias=config.qkv_bias)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(heads * config.head_dim, config.hidden_size, bias=config.o_proj_bias)
        # BLOOM's, MPT's, falcon-rw's ALiBi: the slopes of this rank's heads.
        slopes = None
        if config.alibi_bias_max is not None:
            first = self.qkv_proj.tp_rank * self.num_heads
            slopes = alibi_slopes(config.num_attention_heads, config.alibi_bias_max)[first: first + self.num_heads]
            slopes = slopes * config.alibi_slope_scale
        # (A decoder run as an encoder, EmbeddingGemma, attends both ways within each prompt: no cache.)
        self.attn = (EncoderAttention(self.num_heads, self.num_kv_heads, self.head_dim, config.attention_scale,
                                      config.layer_sliding_window(layer)) if config.encoder_only else
                     PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, config.attention_scale,
                                    config.layer_sliding_window(layer), config.attn_logit_softcapping,
                                    config.attention_sinks, alibi_slopes=slopes))
        # Qwen3 (and Gemma 3): one norm over each query head and one over each key head (weights of
        # head_dim, the same on every TP rank), before RoPE.
        self.q_norm = norm_class(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = norm_class(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        # SmolLM3's NoPE layers attend without positions.
        self.rotates = not config.rope_layers or config.rope_layers[layer]
        # OLMo's and OLMoE's: q, k (after their norms) and v clamped to [-clip, clip].
        self.clip_qkv = config.clip_qkv

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``rope``: (cos, sin) of each token's position, and under Llama 4's attention temperature
        (Ministral 3) each token's query scale after them (LlamaModel.forward)."""
        return self.o_proj.forward(self.attend(rope, hidden, meta))

    def attend(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The heads' outputs [tokens, heads * head_dim], before o_proj."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj.forward(hidden)
        if self.q_norm is None:
            if self.clip_qkv is not None:
                qkv = qkv.clamp_(-self.clip_qkv, self.clip_qkv)
            # q and k are adjacent in the fused output: rotate them as one tensor of heads.
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads,
                                                           self.head_dim)
        else:
            q = self.q_norm.forward(qkv[:, : self.q_size].reshape(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm.forward(qkv[:, self.q_size: self.q_size + self.kv_size].reshape(
                num_tokens, self.num_kv_heads, self.head_dim))
            qk = torch.cat((q, k), dim=1)
            if self.clip_qkv is not None:  # (after the norms, v alike)
                qk.clamp_(-self.clip_qkv, self.clip_qkv)
                qkv[:, self.q_size + self.kv_size:].clamp_(-self.clip_qkv, self.clip_qkv)
        if self.rotates:
            RotaryEmbedding.rotate_(qk, rope[0], rope[1])
        q = qk[:, : self.num_heads]
        if len(rope) > 2:  # (a scale of the queries' dtype multiplies them in it; an fp32 one in fp32: Beam's)
            q = q * rope[2] if rope[2].dtype == q.dtype else (q.float() * rope[2]).to(q.dtype)
        k = qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        return self.attn.forward(q, k, v, meta)


class GatedOutputAttention(LlamaAttention):
    """Llama's attention whose heads' outputs are scaled by activation(gate(x)) before o_proj (AFMoE's,
    Laguna's, LFM3's): one value per head, broadcast over its channels (``gate_per_head``), or one per
    channel. The gate projection, named as the checkpoint names it (``gate_name``), splits its rows
    across tensor-parallel ranks as the query heads are; a model without one (``gated`` false) attends
    as Llama's. Subclasses read these from their config; the base is AFMoE's (a sigmoid per channel)."""

    gate_name = "gate_proj"

    def __init__(self, config: ModelConfig, layer: int = 0, norm_class: type[RMSNorm] = RMSNorm) -> None:
        super().__init__(config, layer, norm_class)
        self.per_head = self.gate_per_head(config)
        heads = config.layer_attention_heads(layer)
        setattr(self, self.gate_name, ColumnParallelLinear(config.hidden_size, heads if self.per_head
                                                           else heads * config.head_dim)
                if self.gated(config) else None)

    @staticmethod
    def gated(config: ModelConfig) -> bool:
        return True

    @staticmethod
    def gate_per_head(config: ModelConfig) -> bool:
        return False

    @staticmethod
    def activation(gate: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(gate)

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        out = self.attend(rope, hidden, meta)
        gate_proj = getattr(self, self.gate_name)  # (looked up by name: LoRA may have wrapped it)
        if gate_proj is not None:
            gate = self.activation(gate_proj.forward(hidden)).to(out.dtype)
            if self.per_head:
                out = (out.view(out.shape[0], -1, self.head_dim) * gate.unsqueeze(-1)).view(out.shape[0], -1)
            else:
                out = out * gate
        return self.o_proj.forward(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None, reduce_results: bool = True) -> None:
        super().__init__()
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size] * 2, bias=config.mlp_bias)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=config.mlp_bias,
                                           reduce_results=reduce_results)
        self.act = gated_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.act.forward(self.gate_up_proj.forward(x)))


class UngatedMLP(nn.Module):
    """down(act(up(x))): no gate (Nemotron-H's and Arcee's relu^2, StarCoder2's gelu); its projections
    named ``in_name`` / ``out_name`` as the checkpoint names them. ``reduce_results`` False: the caller
    all-reduces (an MoE block sums it with the experts' partial outputs first)."""

    in_name, out_name = "up_proj", "down_proj"

    def __init__(self, config: ModelConfig, width: int | None = None, reduce_results: bool = True) -> None:
        super().__init__()
        width = width or config.intermediate_size
        up = ColumnParallelLinear(config.hidden_size, width, bias=config.mlp_bias)
        down = RowParallelLinear(width, config.hidden_size, bias=config.mlp_bias, reduce_results=reduce_results)
        setattr(self, self.in_name, up)
        setattr(self, self.out_name, down)
        self.act = ungated_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (Looked up by name each time: LoRA replaces a projection with its wrapper on this module.)
        return getattr(self, self.out_name).forward(self.act(getattr(self, self.in_name).forward(x)))


class SparseMoeBlock(nn.Module):
    """Routed experts in place of the MLP (Mixtral's block_sparse_moe, Qwen-MoE's mlp): a router
    (``gate``, replicated on every rank) picks each token's top-k experts; Qwen2-MoE adds a shared
    expert every token goes through, scaled by sigmoid(``shared_expert_gate``); GPT-OSS's router and
    experts have biases (ModelConfig.moe_bias) and a clamped SwiGLU; GLM-4.5's and DeepSeek's
    routers choose within groups of experts (DeepSeek-V3's and GLM's by sigmoid scores through a
    correction bias: an fp32 router, ``gate.weight`` and ``gate.e_score_correction_bias``), and their
    shared experts are ungated. Each rank computes
    its partial sums of both (the shared expert split by width even under expert parallelism, as
    vLLM does), and one all-reduce adds them up."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.renormalize = config.norm_topk_prob
        self.grouped_topk, self.scoring = config.moe_grouped_topk, config.moe_scoring
        # (An fp32 router: the grouped ones', Hunyuan MoE's.)
        self.fp32_router = self.grouped_topk or config.moe_router_fp32
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=config.moe_bias,
                              dtype=torch.float32 if self.fp32_router else None).requires_grad_(False)
        if config.moe_correction_bias:
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts, dtype=torch.float32),
                                                             requires_grad=False)
        self.num_groups, self.topk_groups = config.moe_num_groups, config.moe_topk_groups
        self.jitter_eps = config.sparsemixer_jitter_eps
        self.routed_scaling_factor = config.routed_scaling_factor
        # (Laguna's: cap * tanh(logit / cap) on the router's logits; 0: none.)
        self.logit_softcap = config.moe_router_logit_softcapping
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, expert_parallel=config.expert_parallel,
                                bias=config.moe_bias, activation=config.moe_activation,
                                swiglu_alpha=config.swiglu_alpha, swiglu_limit=config.swiglu_limit)
        self.tp_size = self.experts.tp_size
        # Qwen2-MoE's gated shared expert (``shared_expert``), or GLM's and DeepSeek's ungated ones
        # (``shared_experts``): the checkpoint's names, which LoRA adapters use too.
        self.shared_expert = self.shared_expert_gate = self.shared_experts = None
        if config.shared_expert_intermediate_size and config.shared_expert_gated:
            self.shared_expert = LlamaMLP(config, config.shared_expert_intermediate_size, reduce_results=False)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
            self.shared_expert_gate.weight.requires_grad_(False)
        elif config.shared_expert_intermediate_size:
            self.shared_experts = LlamaMLP(config, config.shared_expert_intermediate_size, reduce_results=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.grouped_topk:
            logits = self.gate.forward(x.float())
            if self.logit_softcap:
                logits = torch.tanh(logits / self.logit_softcap).mul_(self.logit_softcap)
            weights, ids = select_experts_grouped(
                logits, self.experts.top_k, self.renormalize,
                getattr(self.gate, "e_score_correction_bias", None), self.num_groups, self.topk_groups,
                self.routed_scaling_factor, self.scoring)
        elif self.scoring == "sparsemixer":
            weights, ids = select_experts_sparsemixer(self.gate.forward(x), self.jitter_eps)
        else:
            weights, ids = select_experts(self.gate.forward(x.float() if self.fp32_router else x), self.experts.top_k,
                                          self.renormalize)
        out = self.experts.forward(x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert.forward(x)
            out += shared.mul_(torch.sigmoid(self.shared_expert_gate.forward(x)))
        elif self.shared_experts is not None:
            out += self.shared_experts.forward(x)
        if self.tp_size > 1:
            distributed.all_reduce(out)
        return out


class LlamaDecoderLayer(nn.Module):
    # The norms' kind (Gemma's scale by 1 + w), and the attention's (OLMo 2's norms its projections).
    norm_class: type[RMSNorm] = RMSNorm
    attention_class: type[LlamaAttention] = LlamaAttention
    # The recurrent mixer of the layers ModelConfig.mamba_layers names: Mamba-2 (Granite 4.0-H), Gated
    # DeltaNet (Qwen3-Next).
    recurrent_class: type[nn.Module] = MambaMixer2
    # The dense MLP (Arcee's is ungated), and the routed experts' block (Llama 4's is its own).
    mlp_class: type[nn.Module] = LlamaMLP
    moe_class: type[nn.Module] = SparseMoeBlock

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        # Granite 4.0-H, Qwen3-Next: a recurrent mixer in place of self-attention in their Mamba-2 /
        # linear-attention layers.
        self.mamba = (self.recurrent_class(config.hidden_size, config.mamba, config.rms_norm_eps)
                      if config.layer_is_mamba(layer) and config.mamba is not None else None)
        self.self_attn = self.attention_class(config, layer, self.norm_class) if self.mamba is None else None
        self.mlp = self.moe_class(config) if config.layer_is_moe(layer) else self.mlp_class(config)
        self.input_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        # Granite scales each attention and MLP output before its residual add.
        self.residual_multiplier = config.residual_multiplier
        # Gemma 3's and OLMo 3's sliding-window layers rotate with their own plain RoPE.
        self.local_rope = (config.local_rope_theta is not None and bool(config.sliding_window_layers)
                           and config.sliding_window_layers[layer])

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) in and out: the layer's input is their sum (the residual add is fused
        into the next norm)."""
        hidden, residual = self._attention(rope, hidden, residual, meta)
        if self.residual_multiplier != 1.0:  # (both outputs are this layer's own tensors)
            hidden.mul_(self.residual_multiplier)
        hidden, residual = self.post_attention_layernorm.forward(hidden, residual)
        hidden = self.mlp.forward(hidden)
        if self.residual_multiplier != 1.0:
            hidden.mul_(self.residual_multiplier)
        return hidden, residual

    def parallel_forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, residual: torch.Tensor | None,
                         meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention and MLP side by side, both added to the residual: x + attention(norm(x)) +
        mlp(norm(x)) with one norm (Cohere's, Phi's, GPT-J's, StableLM 2 12B's, falcon-7b's layers:
        post_attention_layernorm None), x + attention(norm_1(x)) + mlp(norm_2(x)) with two (GPT-NeoX's
        parallel residual, falcon-40b's)."""
        if residual is None:
            residual, normed = hidden, self.input_layernorm.forward(hidden)
        else:
            normed, residual = self.input_layernorm.forward(hidden, residual)
        mlp_input = normed if self.post_attention_layernorm is None else self.post_attention_layernorm.forward(residual)
        return self.self_attn.forward(rope, normed, meta) + self.mlp.forward(mlp_input), residual

    def sandwich_forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, residual: torch.Tensor | None,
                         meta: AttentionMetadata, after_mixer: nn.Module, before_mlp: nn.Module,
                         after_mlp: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer with four norms (Gemma 2 / 3's, GLM-4's, AFMoE's, LFM3's, HyperCLOVA X's): the token
        mixer's output normed by ``after_mixer`` before its residual add, the MLP's input by ``before_mlp``
        (which adds the residual), its output by ``after_mlp``; each normed output times Granite's
        residual_multiplier where it is not 1 (HyperCLOVA X's). (hidden, residual) in and out, as forward's."""
        hidden, residual = self._attention(rope, hidden, residual, meta)
        hidden = after_mixer.forward(hidden)
        if self.residual_multiplier != 1.0:  # (the norms' outputs are this layer's own tensors)
            hidden.mul_(self.residual_multiplier)
        hidden, residual = before_mlp.forward(hidden, residual)
        hidden = after_mlp.forward(self.mlp.forward(hidden))
        if self.residual_multiplier != 1.0:
            hidden.mul_(self.residual_multiplier)
        return hidden, residual

    def _attention(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, residual: torch.Tensor | None,
                   meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The input norm (adding the residual) and the token mixer: (its output, residual)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm.forward(hidden)
        else:
            hidden, residual = self.input_layernorm.forward(hidden, residual)
        return self._mix(rope, hidden, meta), residual

    def _mix(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Self-attention, or the recurrent mixer in its place."""
        mixer = self.self_attn if self.mamba is None else self.mamba
        return mixer.forward(rope, hidden, meta)


class PPMissingLayer(nn.Identity):
    """A decoder layer (or the embedding, norm or head) another pipeline stage holds: no weights,
    never run; it keeps the layers' indices, so parameter names match the checkpoint's."""


# The models with recurrent layers whose decoder is not the Llama stack (gpu_worker.models.single_stage):
# Nemotron-H's blocks (Mamba-2 and Mamba-1 language models too), Zamba2's shared blocks. The others'
# recurrent layers split into stages as attention layers do: each stage keeps its own layers' states.
SINGLE_STAGE_RECURRENT_ARCHITECTURES = ("NemotronHForCausalLM", "Mamba2ForCausalLM", "MambaForCausalLM",
                                        "FalconMambaForCausalLM", "Zamba2ForCausalLM")


def pipeline_refusal(config: ModelConfig, pp_size: int, pooling: bool = False) -> str | None:
    """Why a model cannot be split into ``pp_size`` pipeline stages (None: it can)."""
    if config.encoder_only or config.embedding_only or pooling or config.labels:
        return "pipeline parallelism serves generative decoders, not encoders, pooling-only or classifier models"
    if config.vision is not None:
        return "pipeline parallelism serves text decoders; a vision-language model's encoder is not split into stages"
    if config.architecture in SINGLE_STAGE_RECURRENT_ARCHITECTURES:  # (their decoder stacks are their own)
        return f"pipeline parallelism does not split {config.architecture}'s layers yet"
    if config.num_hidden_layers < pp_size:
        return f"the model has only {config.num_hidden_layers} layers to split into {pp_size} stages"
    if config.architecture == "LongcatFlashForCausalLM":  # (a shortcut crosses from each even half-layer on)
        return "pipeline parallelism does not split LongCat-Flash's layers (their shortcut experts) yet"
    return None


class PipelineStage:
    """What a pipeline stage of a decoder holds: layers [start, end), the embedding on the first
    stage, the final norm and LM head on the last (and the embedding there too when the head is
    tied to it: the head's weights are the embedding's). One stage holds everything."""

    def __init__(self, config: ModelConfig) -> None:
        self.start, self.end = distributed.pp_layer_range(config.num_hidden_layers)
        self.first, self.last = distributed.is_first_stage(), distributed.is_last_stage()
        self.holds_embedding = self.first or (self.last and config.tie_word_embeddings)

    def layers(self, config: ModelConfig, layer_class: type[nn.Module]) -> nn.ModuleList:
        return nn.ModuleList(layer_class(config, i) if self.start <= i < self.end else PPMissingLayer()
                             for i in range(config.num_hidden_layers))

    def missing_prefixes(self, config: ModelConfig) -> tuple[str, ...]:
        """Checkpoint names this stage does not load (they belong to other stages)."""
        missing = [f"model.layers.{i}." for i in range(config.num_hidden_layers) if not self.start <= i < self.end]
        if not self.holds_embedding:
            missing.append("model.embed_tokens.")
        if not self.first:
            missing += ["model.embed_positions.", "model.embed_norm."]
        if not self.last:
            missing += ["model.norm.", "lm_head."]
        return tuple(missing)


class LlamaModel(nn.Module):
    layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.stage = stage = PipelineStage(config)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size) if stage.holds_embedding
                             else PPMissingLayer())
        # GPT-2's, GPTBigCode's, OPT's and BioGPT's learned positions (XGLM's fixed sinusoids), added to the
        # first layer's input.
        self.embed_positions = ((SinusoidalPositionEmbedding(config.max_position_embeddings, config.hidden_size,
                                                             config.position_offset, config.position_padding_row)
                                 if config.sinusoidal_positions else
                                 PositionEmbedding(config.max_position_embeddings, config.hidden_size,
                                                   config.position_offset))
                                if config.learned_positions and stage.first else None)
        # BioGPT's and XGLM's token embeddings times sqrt(hidden_size) (not prompt embeddings given).
        self.token_embedding_scale = config.token_embedding_scale
        # BLOOM's LayerNorm over the first layer's input (the tokens' embeddings, or those given).
        self.embed_norm = (self.layer_class.norm_class(config.hidden_size, config.rms_norm_eps)
                           if config.embedding_norm and stage.first else None)
        # (Where no layer rotates, a table without columns: Kimi-Linear's would be a million rows.)
        rotates = not config.rope_layers or any(config.rope_layers)
        self.rotary_emb = RotaryEmbedding((config.rotary_dim or config.head_dim) if rotates else 0,
                                          config.max_context_len,
                                          config.rope_theta, config.rope_scaling,
                                          mrope_section=config.mrope_section,
                                          mrope_interleaved=config.mrope_interleaved)
        # OLMo 3: its sliding-window layers' plain RoPE (the others': rope_theta and rope_scaling); Laguna's
        # over their own share of each head.
        self.local_rotary_emb = (None if config.local_rope_theta is None else
                                 RotaryEmbedding(config.local_rotary_dim or config.rotary_dim or config.head_dim,
                                                 config.max_context_len, config.local_rope_theta))
        self.layers = stage.layers(config, self.layer_class)
        # (The layers' kind of norm: Cohere's, StarCoder2's LayerNorms.)
        self.norm = (self.layer_class.norm_class(config.hidden_size, config.rms_norm_eps) if stage.last
                     else PPMissingLayer())
        self.llama_4_scaling = config.llama_4_scaling
        # Granite: the first layer's input (embeddings, or the prompt embeddings given) times this.
        self.embedding_multiplier = config.embedding_multiplier
        # Speculative decoding's EAGLE-3 head reads the inputs of these layers (ascending; set when it
        # loads): each pass keeps them, in this order, in aux_hidden_states.
        self.aux_layer_ids: tuple[int, ...] = ()
        self.aux_hidden_states: list[torch.Tensor] = []

    def query_scale(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """Each token's query scale by position ([tokens, 1, 1]; None: none): Ministral 3's attention
        temperature (Llama 4's, ModelConfig.llama_4_scaling)."""
        return None if self.llama_4_scaling is None else llama_4_query_scale(positions, *self.llama_4_scaling, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                deepstack: tuple[torch.Tensor, torch.Tensor] | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``positions``: each token's row of the rotary table (its position, except for LongRoPE's
        short-factor rows: see layers.rotary; [3, tokens] under M-RoPE). ``inputs_embeds``: the rows
        to run instead of the tokens' (prompt embeddings, images). Under pipeline parallelism a stage
        after the first starts from the previous stage's ``intermediate`` (hidden, residual), and a
        stage before the last returns its own instead of the final hidden states. ``deepstack``
        (Qwen3-VL): (rows [m], values [layers, m, hidden]): after layer i, the rows' hidden states
        gain values[i] (an image's features from its tower's inner blocks)."""
        if intermediate is None:
            hidden = self.embed_tokens.forward(input_ids) if inputs_embeds is None else inputs_embeds
            if inputs_embeds is None and self.token_embedding_scale != 1.0:
                hidden = hidden * self.token_embedding_scale
            if self.embed_positions is not None:
                hidden = hidden + self.embed_positions.forward(positions)
            if self.embed_norm is not None:
                hidden = self.embed_norm.forward(hidden)
            if self.embedding_multiplier != 1.0:
                hidden = hidden * self.embedding_multiplier
            residual = None
        else:
            hidden, residual = intermediate
        rope: tuple[torch.Tensor, ...] = self.rotary_emb.cos_sin(positions)
        scale = self.query_scale(positions, hidden.dtype)
        if scale is not None:  # (each token's query scale, beside its cos and sin)
            rope = (*rope, scale)
        layers = self.layers[self.stage.start:self.stage.end]
        local = None if self.local_rotary_emb is None else self.local_rotary_emb.cos_sin(positions)
        if deepstack is None and not self.aux_layer_ids:
            for layer in layers:
                hidden, residual = layer.forward(rope if local is None or not layer.local_rope else local, hidden,
                                                 residual, meta)
        else:
            rows, values = deepstack if deepstack is not None else (None, ())
            self.aux_hidden_states = []
            for i, layer in enumerate(layers):
                if i in self.aux_layer_ids:  # (the layer's input: EAGLE-3's feature; no pipeline stages then)
                    self.aux_hidden_states.append(hidden if residual is None else hidden + residual)
                hidden, residual = layer.forward(rope if local is None or not layer.local_rope else local, hidden,
                                                 residual, meta)
                if i < len(values):  # (the layer's output is hidden + residual: one of them gains them)
                    hidden = hidden.index_add(0, rows, values[i].to(hidden.dtype))
        if not self.stage.last:
            return hidden, residual
        hidden, _ = self.norm.forward(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # HF checkpoint projection name -> (our fused parameter, shard id within it).
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # The decoder stack (Gemma's differs).
    model_class: type[nn.Module] = LlamaModel
    # Whether the LM head adds a bias to each token's logit (Phi-2's).
    lm_head_bias = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_class(config)
        stage: PipelineStage = self.model.stage
        # Checkpoint tensors of other pipeline stages' layers: not loaded here (weights.load_weights).
        self.pp_missing_prefixes = stage.missing_prefixes(config)
        # An embedding-only model has no head (its checkpoint may carry one: it is not loaded); nor has
        # a pipeline stage before the last.
        self.lm_head = (None if config.embedding_only or not stage.last
                        else ParallelLMHead(config.vocab_size, config.hidden_size, bias=self.lm_head_bias))
        if config.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.tie_to(self.model.embed_tokens)
        # A classifier's head (transformers' *ForSequenceClassification / *ForTokenClassification
        # ``score``, a reward model's MLP): one logit per class from a pooled final hidden state, or
        # from each token's; whole on every TP rank.
        self.score = _score_head(config) if config.labels else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                deepstack: tuple[torch.Tensor, torch.Tensor] | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if deepstack is not None:
            return self.model.forward(input_ids, positions, meta, inputs_embeds, intermediate, deepstack)
        return self.model.forward(input_ids, positions, meta, inputs_embeds, intermediate)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding's rows for ``input_ids`` (what transformers' ``get_input_embeddings()`` gives):
        what a prompt given as embeddings replaces (BLOOM's norm over them, and GPT-2's positions, are
        still applied to the rows given, as transformers applies them to ``inputs_embeds``)."""
        rows = self.model.embed_tokens.forward(input_ids)
        scale = self.config.token_embedding_scale  # (BioGPT's, XGLM's: their embedding module scales)
        return rows if scale == 1.0 else rows * scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocab logits on TP rank 0, None on the other ranks."""
        if self.lm_head is None:
            raise RuntimeError("this model is served for embeddings only: it has no LM head")
        logits = self.lm_head(hidden)
        if self.config.logits_scaling != 1.0 and logits is not None:  # (Granite)
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcapping  # (Gemma 2 / 3 / 3n / 4's, nanochat's, Beam's)
        if cap is not None and logits is not None:
            # (In fp32, the capped logits returned so: near the cap, bf16's tanh would round the top
            # logits to steps of a tenth; transformers' Beam caps in fp32 for that reason, its Gemma and
            # vLLM in the model's dtype. In place: the head's output is this call's own tensor.)
            logits = logits.float().div_(cap).tanh_().mul_(cap)
        return logits

    def classify(self, pooled: torch.Tensor, per_token: bool = False) -> torch.Tensor:
        """A classifier's class logits for pooled hidden states [n, hidden] -> [n, classes] (the same
        head on each token's, ``per_token``)."""
        if self.score is None:
            raise RuntimeError("this model has no classification head")
        return self.score.forward(pooled.to(next(self.score.parameters()).dtype))

    def attention_layers(self) -> list[PagedAttention]:
        """The layers reading the paged KV cache (none when run as an encoder)."""
        if self.config.encoder_only:
            return []
        stage = self.model.stage
        return [layer.self_attn.attn for layer in self.model.layers[stage.start:stage.end]
                if layer.self_attn is not None]

    def mamba_layers(self) -> list[MambaMixer2]:
        """The Mamba-2 mixers, which keep a state per request instead of KV (Granite 4.0-H)."""
        stage = self.model.stage
        return [layer.mamba for layer in self.model.layers[stage.start:stage.end]
                if getattr(layer, "mamba", None) is not None]


def _score_head(config: ModelConfig) -> nn.Module:
    """The classifier head ModelConfig.score_head names, [.., hidden] -> [.., classes], in fp32
    whatever the model's dtype (as vLLM runs pooling heads: a reward MLP in bf16 loses the small
    differences between rewards)."""
    width, outputs = config.hidden_size, len(config.labels)
    if config.score_head == "relu_mlp":
        head: nn.Module = nn.Sequential(nn.Linear(width, width, dtype=torch.float32), nn.ReLU(),
                                        nn.Linear(width, outputs, dtype=torch.float32))
    else:
        head = nn.Linear(width, outputs, bias=config.score_head == "linear_bias", dtype=torch.float32)
    return head.requires_grad_(False)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is the Llama block; v0.1 attends through a 4096-token sliding window in every layer."""


class MinistralForCausalLM(MistralForCausalLM):
    """Ministral (transformers' MinistralForCausalLM: Ministral-8B-Instruct-2410 as transformers names it)
    is Mistral whose window covers the layers ``layer_types`` names (every layer where it names none)."""


class Ministral3ForCausalLM(MistralForCausalLM):
    """Ministral 3 (the language model of Ministral 3 3B / 8B / 14B) is Mistral with YaRN and Llama 4's
    attention temperature: queries past the pretrained length are scaled up by position
    (ModelConfig.llama_4_scaling)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 is the Llama block with a q/k/v bias (resolved in ModelConfig)."""


class SeedOssForCausalLM(LlamaForCausalLM):
    """ByteDance's Seed-OSS (Seed-OSS-36B): the Llama block with q/k/v biases (attention_bias) and
    o_proj's apart (attention_out_bias)."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (dense) is the Llama block with RMSNorms on the query and key heads (ModelConfig.qk_norm)
    and its own head_dim (128 in every size, whatever hidden_size / num_attention_heads is)."""


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 and Phi-4 are the Llama block, with q/k/v and gate/up stored fused in the checkpoint
    (``qkv_proj``, ``gate_up_proj``): they are split into the shards the loader places per TP rank."""

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        config = self.config
        q = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        for name, tensor in weights:
            if ".qkv_proj." in name:
                for part, start, size in (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)):
                    yield name.replace(".qkv_proj.", f".{part}."), tensor.narrow(0, start, size)
            elif ".gate_up_proj." in name:
                yield from gate_and_up(name, tensor)
            else:
                yield name, tensor


class NormAfterRopeAttention(LlamaAttention):
    """Llama's attention whose per-head q/k norms come after RoPE rather than before (HunYuan's)."""

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj.forward(hidden)
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        RotaryEmbedding.rotate_(qk, rope[0], rope[1])
        q = self.q_norm.forward(qk[:, : self.num_heads])
        k = self.k_norm.forward(qk[:, self.num_heads:])
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj.forward(self.attn.forward(q, k, v, meta))


class HunYuanDenseV1DecoderLayer(LlamaDecoderLayer):
    attention_class = NormAfterRopeAttention


class HunYuanDenseV1Model(LlamaModel):
    layer_class = HunYuanDenseV1DecoderLayer


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    """Tencent's Hunyuan dense models (Hunyuan-0.5B / 1.8B / 4B / 7B and their instruct releases): the
    Llama block with per-head RMSNorms on the queries and keys after RoPE (``query_layernorm``,
    ``key_layernorm``) and NTK RoPE by a fixed alpha (a larger base: ModelConfig)."""

    model_class = HunYuanDenseV1Model

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        for name, tensor in weights:
            yield (name.replace(".self_attn.query_layernorm.", ".self_attn.q_norm.")
                   .replace(".self_attn.key_layernorm.", ".self_attn.k_norm.")), tensor


class HunYuanMoEV1ForCausalLM(HunYuanDenseV1ForCausalLM):
    """Tencent's Hunyuan MoE (Hunyuan-A13B-Instruct): the dense model's attention with routed experts
    in every layer (the softmax's top k, renormalised) beside a shared MLP (``shared_mlp``: our
    shared_experts), the router ``gate.wg``."""

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        for name, tensor in super().checkpoint_tensors(weights):
            yield (name.replace(".mlp.shared_mlp.", ".mlp.shared_experts.")
                   .replace(".mlp.gate.wg.", ".mlp.gate.")), tensor


class CwmForCausalLM(LlamaForCausalLM):
    """Meta's Code World Model (facebook/cwm): Llama 3's block with llama3 RoPE, three layers of four
    attending through a window (layer_types: every fourth from the first attends fully)."""


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """SmolLM3 is the Llama block with every fourth layer (``no_rope_layers``) attending without RoPE."""


class GraniteForCausalLM(LlamaForCausalLM):
    """IBM Granite 3.x is the Llama block with four scalars (ModelConfig's embedding, residual and
    attention multipliers and logits scaling)."""


class MiniCPMForCausalLM(LlamaForCausalLM):
    """OpenBMB's MiniCPM (MiniCPM-1B / 2B, MiniCPM4, and MiniCPM-MoE-8x2B's Mixtral experts, named
    ``mlp.experts.N.w1 / w3 / w2`` beside ``mlp.gate``): the Llama block with MiniCPM's scalings of
    the embeddings, residual adds and logits (ModelConfig's Granite multipliers)."""


def sinks_under_attention(weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
    """A checkpoint's attention sinks (``self_attn.sinks``; MiMo-V2-Flash's released
    ``self_attn.attention_sink_bias``, Flint's ``self_attn.softmax_offset``) read as PagedAttention's
    (``self_attn.attn.sinks``)."""
    for name, tensor in weights:
        if name.endswith((".self_attn.sinks", ".self_attn.attention_sink_bias", ".self_attn.softmax_offset")):
            name = name.rsplit(".", 1)[0] + ".attn.sinks"
        yield name, tensor


class GraniteSWAForCausalLM(GraniteForCausalLM):
    """IBM's GraniteSWA (granite-swash): Granite with windowed layers (layer_types), a learnt sink per
    query head in every layer (one more logit in each head's softmax) and a RoPE base per layer kind
    (layer_rope_theta; 0: no positions)."""

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        return sinks_under_attention(weights)


class FlintForCausalLM(LlamaForCausalLM):
    """RecursiveSI's Flint (FlintForCausalLM): Qwen3-MoE's attention (per-head q/k norms) with a learnt
    sink per query head in every layer, the windowed layers rotating and the full ones attending without
    positions; dense MLPs in mlp_only_layers, elsewhere routed experts chosen by their sigmoid scores
    (renormalised) beside an ungated shared expert; its sinks read as released (``softmax_offset``) or
    under transformers' name."""

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        return sinks_under_attention((self.lora_module_name(name), tensor) for name, tensor in weights)

    @staticmethod
    def lora_module_name(name: str) -> str:
        """A checkpoint's (or an adapter's) name as ours: the shared expert's ``shared_expert`` our
        ``shared_experts``."""
        return name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")


class GraniteMoeForCausalLM(GraniteForCausalLM):
    """IBM Granite 3.x MoE (granite-3.1-1b-a400m, -3b-a800m): Granite with routed experts in every
    layer, each layer's experts stored whole (``block_sparse_moe.input_linear``: every expert's gate
    and up rows, ``output_linear``: their down projections, ``router.layer``: the router)."""

    # The checkpoint's names -> ours (every expert's gate and up rows, then every expert's down
    # projection: FusedMoE loads such stacks whole), as released and as transformers 5 names them.
    _RENAMED = ((".block_sparse_moe.input_linear.weight", ".mlp.experts.gate_up_proj"),
                (".block_sparse_moe.output_linear.weight", ".mlp.experts.down_proj"),
                (".block_sparse_moe.router.layer.weight", ".mlp.gate.weight"),
                (".block_sparse_moe.experts.", ".mlp.experts."),
                (".block_sparse_moe.router.weight", ".mlp.gate.weight"))

    # An adapter's modules (and a stacked parameter's module): the routed experts' and the router's.
    _RENAMED_MODULES = ((".block_sparse_moe.experts.", ".mlp.experts."),
                        (".block_sparse_moe.router.layer.", ".mlp.gate."), (".block_sparse_moe.router.", ".mlp.gate."))

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        return ((rename_first(name, self._RENAMED), tensor) for name, tensor in weights)

    def lora_module_name(self, module: str) -> str:
        return rename_first(f"{module}.", self._RENAMED_MODULES)[:-1]


class GraniteMoeSharedForCausalLM(GraniteMoeForCausalLM):
    """Granite MoE Shared: Granite MoE with an ungated shared expert beside the routed ones
    (``shared_mlp``: input_linear holds its gate rows, then its up rows; output_linear its down)."""

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        # (A model without routed experts has the shared MLP alone: it is the layer's MLP.)
        shared = ".mlp.shared_experts." if self.config.num_experts else ".mlp."
        for name, tensor in super().checkpoint_tensors(weights):
            if ".shared_mlp.input_linear." in name:
                yield from gate_and_up(name, tensor, ".shared_mlp.input_linear.", f"{shared}gate_proj.",
                                       f"{shared}up_proj.")
            elif ".shared_mlp.output_linear." in name:
                yield name.replace(".shared_mlp.output_linear.", f"{shared}down_proj."), tensor
            else:
                yield name, tensor

    def lora_module_name(self, module: str) -> str:
        """An adapter's shared-MLP projections as ours: input_linear (its gate rows, then its up rows)
        our fused gate_up_proj, output_linear our down_proj."""
        shared = ".mlp.shared_experts." if self.config.num_experts else ".mlp."
        return (f"{super().lora_module_name(module)}.".replace(".shared_mlp.input_linear.", f"{shared}gate_up_proj.")
                .replace(".shared_mlp.output_linear.", f"{shared}down_proj."))[:-1]


class GraniteMoeSWAForCausalLM(GraniteMoeSharedForCausalLM):
    """GraniteMoeSWA: Granite MoE Shared with GraniteSWA's attention (windowed layers, sinks, a RoPE
    base per layer kind)."""

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        return sinks_under_attention(super().checkpoint_tensors(weights))


class GraniteMoeHybridForCausalLM(GraniteMoeSharedForCausalLM):
    """IBM Granite 4.0 (granite-4.0-h-micro / -tiny / -small, and the attention-only granite-4.0-micro):
    Granite MoE Shared whose ``mamba`` layers are Mamba-2 mixers (gpu_worker.layers.mamba) in place of
    self-attention, attending without positions unless position_embedding_type is "rope"; a model
    without routed experts has the shared MLP alone."""


class BambaForCausalLM(LlamaForCausalLM):
    """IBM's Bamba (Bamba-9B): the Llama block with Mamba-2 mixers in place of self-attention in all but
    the layers attn_layer_indices names, whose RoPE turns the first half of each head; its tensors
    named as transformers' (``feed_forward``, ``pre_ff_layernorm``, ``final_layernorm``)."""

    _RENAMED = ((".feed_forward.", ".mlp."), (".pre_ff_layernorm.", ".post_attention_layernorm."),
                ("model.final_layernorm.", "model.norm."))

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        for name, tensor in weights:
            yield self.lora_module_name(name), tensor

    def lora_module_name(self, name: str) -> str:
        """A checkpoint's (or an adapter's) name as ours: its feed_forward our mlp."""
        for theirs, ours in self._RENAMED:
            name = f"{name}.".replace(theirs, ours)[:-1]
        return name


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral is Mistral with every MLP replaced by routed experts (``block_sparse_moe``, whose
    experts name their projections w1 = gate, w3 = up, w2 = down)."""

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        for name, tensor in weights:
            yield self.lora_module_name(name), tensor

    @staticmethod
    def lora_module_name(name: str) -> str:
        """Transformers 4's Mixtral named the MLP ``block_sparse_moe`` (as do adapters trained on it)."""
        return name.replace(".block_sparse_moe.", ".mlp.")


class PhimoeDecoderLayer(LlamaDecoderLayer):
    norm_class = LayerNorm


class PhimoeModel(LlamaModel):
    layer_class = PhimoeDecoderLayer


class PhimoeForCausalLM(MixtralForCausalLM):
    """Microsoft's Phi-3.5-MoE (Phi-3.5-MoE-instruct): Mixtral's layers (``block_sparse_moe``) with
    LayerNorms, q/k/v/o biases (attention_bias), an LM head with a bias (lm_head_bias), LongRoPE with
    its mscale, and sparsemixer's routing (ModelConfig.moe_scoring)."""

    model_class = PhimoeModel

    @property
    def lm_head_bias(self) -> bool:  # (read as the head is built: the config's)
        return bool(self.config.raw.get("lm_head_bias"))


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    """Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention, routed experts plus a gated
    shared expert in the sparse layers, dense MLPs in ``mlp_only_layers``."""


def is_mtp_layer_tensor(name: str, num_layers: int) -> bool:
    """Whether a checkpoint tensor is a multi-token-prediction layer's (numbered from ``num_layers``
    on, after the decoder's)."""
    parts = name.split(".")
    index = parts.index("layers") + 1 if "layers" in parts else 0
    return bool(index) and index < len(parts) and parts[index].isdigit() and int(parts[index]) >= num_layers


class SkipsMtpLayers:
    """A model whose checkpoints hold multi-token-prediction layers after its decoder's (GLM-4.5,
    DeepSeek-V3, MiniMax-M2): it does not read them (weights.read_by; speculative decoding's mtp
    drafter reads GLM's and DeepSeek's first, gpu_worker/models/mtp.py)."""

    config: ModelConfig

    def reads_checkpoint_tensor(self, name: str) -> bool:
        return not is_mtp_layer_tensor(name, self.config.num_hidden_layers)


class Glm4MoeForCausalLM(SkipsMtpLayers, LlamaForCausalLM):
    """GLM-4.5 / 4.6 / 4.7 and GLM-4.5-Air: the Llama block with q/k/v biases, RoPE over half of each
    head, optional q/k norms, dense MLPs in the first layers and then routed experts beside ungated
    shared ones, chosen by sigmoid scores through a correction bias (SparseMoeBlock)."""


class SolarOpenForCausalLM(LlamaForCausalLM):
    """Upstage's Solar Open (Solar-Open-100B): GLM-4.5's layers without its q/k norms and dense layers,
    RoPE over whole heads: routed experts in every layer beside an ungated shared one, chosen by sigmoid
    scores through a correction bias (SparseMoeBlock); q/k/v biases under attention_bias, none on o_proj."""


class Dots1ForCausalLM(LlamaForCausalLM):
    """rednote's dots.llm1 (dots.llm1.base / .inst): Qwen3's attention (per-head q/k norms) with
    DeepSeek-V3's experts: dense MLPs in the first layers, then routed experts beside shared ones,
    chosen by sigmoid scores through a correction bias (SparseMoeBlock)."""


class HYV3ForCausalLM(SkipsMtpLayers, LlamaForCausalLM):
    """Tencent's Hy3 (HYV3ForCausalLM: Hy3-preview): Qwen3's attention (per-head q/k norms) with routed
    experts where mlp_layer_types says sparse, chosen by sigmoid scores through a correction bias,
    renormalised and times router_scaling_factor, beside an ungated shared expert; its tensors read
    under transformers' names or as released (``router.gate``, ``expert_bias``, ``shared_mlp``); its
    multi-token-prediction layer (numbered after the decoder's) is not read."""

    _RENAMED = ((".mlp.router.gate.", ".mlp.gate."), (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"),
                (".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
                (".mlp.shared_mlp.", ".mlp.shared_experts."))

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        return ((rename_parts(name, self._RENAMED), tensor) for name, tensor in weights)

    def lora_module_name(self, module: str) -> str:
        """An adapter's module (its router's, its shared MLP's) as ours."""
        return rename_parts(f"{module}.", self._RENAMED)[:-1]


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, routed experts."""
