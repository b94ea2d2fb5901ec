"""DeepSeek-V2 / V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM: DeepSeek-V2(-Lite), -V2.5, -V3,
-V3.1, -R1, Kimi K2): the Llama block with multi-head latent attention (MLA) and DeepSeek's routed
experts (SparseMoeBlock's grouped top-k: V3's sigmoid scores through a correction bias, V2's softmax;
ungated shared experts; dense MLPs in the first layers).

MLA, as vLLM runs it (the "absorbed" form), so that the KV cache holds the latent rather than every
head's keys and values:

* each token's latent ``c`` (kv_lora_rank values, normed) and one rotated key part ``k_pe``
  (qk_rope_head_dim values) shared by every head: ``kv_a_proj_with_mqa``;
* head h's key is [W_UK[h] c, k_pe] and its value W_UV[h] c (``kv_b_proj`` holds W_UK and W_UV), so
  q_h . k_h = [W_UK[h]^T q_nope_h, q_pe_h] . [c, k_pe]: each query is moved into the latent's space
  and attends, as one of num_heads query heads over one KV "head" of kv_lora_rank + qk_rope_head_dim
  values (the cache's rows), whose first kv_lora_rank values serve as the value; W_UV[h] then maps
  the head's output back. The paged attention (the CPU decode kernel, SDPA, the prefix cache) runs
  unchanged, but that on CUDA prefills attend in bounded tiles of scores (PagedAttention's
  tiled_prefill_on: no FlashAttention kernel takes such wide heads, and SDPA's fallback would hold
  every head's scores over a whole chunk at once). The cache stores each row twice (as key and as
  value): one row of kv_lora_rank + qk_rope_head_dim values per token and layer where vLLM stores
  it once, and either way about a fiftieth of what the heads' keys and values would take.
* DeepSeek's checkpoints lay each rotary part out in pairs (``rope_interleave``); the rows of the
  projections that make them are reordered into halves at load, so Llama's rotation applies (the
  dot products of queries and keys are the same under any reordering applied to both).

Under tensor parallelism each rank holds its heads' query, W_UK / W_UV and output rows; the latent's
projection is replicated, as is the cache's one row per token.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.layers.attention import PagedAttention
from gpu_worker.layers.layernorm import RMSNorm
from gpu_worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from gpu_worker.layers.rotary import RotaryEmbedding, pairs_to_halves_order
from gpu_worker.layers.weight_utils import WeightLike, materialize
from gpu_worker.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    SkipsMtpLayers,
)

_LATENT_NORM_EPS = 1e-6


class MLAAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0, norm_class: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora = config.kv_lora_rank
        # (Kimi-Linear's MLA rotates nothing: its rope part is a plain part of the key, shared by the heads.)
        self.rotates = not config.rope_layers or config.rope_layers[layer]
        qk = self.nope + self.rope
        # (The latent norms' epsilon is RMSNorm's default, 1e-6, whatever rms_norm_eps says: in DeepSeek's
        # own code and in transformers' for every MLA family; vLLM reads rms_norm_eps.)
        if config.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=config.qkv_bias).requires_grad_(False)
            self.q_a_layernorm = norm_class(config.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, heads * qk)
            self.q_proj = None
        else:
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
            self.q_proj = ColumnParallelLinear(hidden, heads * qk)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora + self.rope,
                                            bias=config.qkv_bias).requires_grad_(False)
        self.kv_a_layernorm = norm_class(self.kv_lora, _LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora, heads * (self.nope + self.v_dim))
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, bias=config.o_proj_bias)
        self.num_heads = self.kv_b_proj.output_size_per_partition // (self.nope + self.v_dim)
        # (Ling 3's: a sigmoid gate per head on its output, from the layer's input; each rank its heads'.)
        self.g_proj = ColumnParallelLinear(hidden, heads) if config.mla_head_gate else None
        # (Under DeepSeek Sparse Attention the cache row also holds the indexer's key: deepseek_v32.)
        self.attn = PagedAttention(self.num_heads, 1, self.kv_lora + self.rope + config.index_head_dim,
                                   config.attention_scale,
                                   tiled_prefill_on=("cuda",))

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens, heads, nope = hidden.shape[0], self.num_heads, self.nope
        q_resid = None
        if self.q_proj is None:
            q_resid = self.q_a_layernorm.forward(self.q_a_proj.forward(hidden))
            q = self.q_b_proj.forward(q_resid)
        else:
            q = self.q_proj.forward(hidden)
        q = q.view(num_tokens, heads, nope + self.rope)
        latent = self.kv_a_proj_with_mqa.forward(hidden)
        c = self.kv_a_layernorm.forward(latent[:, : self.kv_lora].contiguous())
        k_pe = latent[:, self.kv_lora:].reshape(num_tokens, 1, self.rope)
        q_pe = q[..., nope:]
        if self.rotates:
            RotaryEmbedding.rotate_(q_pe, rope[0], rope[1])
            RotaryEmbedding.rotate_(k_pe, rope[0], rope[1])
        w = self.kv_b_proj.weight.view(heads, nope + self.v_dim, self.kv_lora)
        # Each head's query in the latent's space: [heads, tokens, nope] @ [heads, nope, kv_lora].
        q_latent = torch.bmm(q[..., :nope].transpose(0, 1), w[:, :nope]).transpose(0, 1)
        key = torch.cat((c.unsqueeze(1), k_pe), dim=-1)
        out = self.attend(rope, hidden, q_resid, torch.cat((q_latent, q_pe), dim=-1), key, meta)
        out = out.view(num_tokens, heads, self.attn.head_dim)[..., : self.kv_lora]
        # Back from the latent, per head: [heads, tokens, kv_lora] @ [heads, kv_lora, v].
        out = torch.bmm(out.transpose(0, 1), w[:, nope:].transpose(1, 2))
        if self.g_proj is not None:  # ([heads, tokens, v] times each head's gate)
            out = out * torch.sigmoid(self.g_proj.forward(hidden).float()).to(out.dtype).t()[:, :, None]
        return self.o_proj.forward(out.transpose(0, 1).reshape(num_tokens, heads * self.v_dim))

    def attend(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, q_resid: torch.Tensor | None,
               query: torch.Tensor, key: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The latent queries [T, heads, kv_lora + rope] over the cached rows, the new ``key`` rows [T, 1,
        kv_lora + rope] written first: [T, heads * head width] (the value is each row's first kv_lora).
        DeepSeek Sparse Attention's layer adds its indexer here (``hidden``, ``q_resid``: the layer's
        input and the normed query bottleneck)."""
        return self.attn.forward(query, key, key, meta)


class DeepseekDecoderLayer(LlamaDecoderLayer):
    attention_class = MLAAttention  # type: ignore[assignment]


class DeepseekModel(LlamaModel):
    layer_class = DeepseekDecoderLayer


class DeepseekV2ForCausalLM(SkipsMtpLayers, LlamaForCausalLM):
    model_class = DeepseekModel
    # (No fused q/k/v: only the MLPs' gate and up are loaded into one projection.)
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        """(``rope_interleave``) the rotary rows of the query and latent projections reordered from
        pairs into halves (other pipeline stages' layers are not read, so not reordered)."""
        return rotary_rows_in_halves(self.config, weights, self.pp_missing_prefixes)

    def lora_b_rows(self, module: str, b: torch.Tensor) -> torch.Tensor:
        """A LoRA adapter's B for ``module``, its rows in the order the base weight's were loaded in."""
        if self.config.rope_interleave and module.endswith(".self_attn.q_proj"):
            return query_rows_in_halves(self.config, b)
        return b


def query_rows_in_halves(config: ModelConfig, rows: torch.Tensor) -> torch.Tensor:
    """A query projection's rows (or a LoRA B's), each head's rotary rows from pairs into halves."""
    per_head = rows.reshape(-1, config.qk_nope_head_dim + config.qk_rope_head_dim, *rows.shape[1:])
    rotary = per_head[:, config.qk_nope_head_dim:].index_select(1, pairs_to_halves_order(config.qk_rope_head_dim))
    return torch.cat((per_head[:, : config.qk_nope_head_dim], rotary), dim=1).reshape(rows.shape)


def rotary_rows_in_halves(config: ModelConfig, weights: Iterable[tuple[str, WeightLike]],
                          skipped: tuple[str, ...] = ()) -> Iterator[tuple[str, WeightLike]]:
    """The checkpoint with (``rope_interleave``) the rotary rows of the query and latent projections
    reordered from pairs into halves (not those of tensors named from ``skipped``)."""
    if not config.rope_interleave:
        yield from weights
        return
    order = pairs_to_halves_order(config.qk_rope_head_dim)
    for name, tensor in weights:
        if skipped and name.startswith(skipped):
            yield name, tensor
        elif name.endswith((".self_attn.q_proj.weight", ".self_attn.q_b_proj.weight")):
            yield name, query_rows_in_halves(config, materialize(tensor))
        elif name.endswith((".self_attn.kv_a_proj_with_mqa.weight", ".self_attn.kv_a_proj_with_mqa.bias")):
            rows = materialize(tensor)
            yield name, torch.cat((rows[: config.kv_lora_rank], rows[config.kv_lora_rank:].index_select(0, order)))
        else:
            yield name, tensor


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.7-Flash (Glm4MoeLiteForCausalLM): DeepSeek-V3's latent attention (rotary values in pairs)
    with GLM-4.5's experts (sigmoid scores through the correction bias, one group) beside a shared one
    in the layers mlp_layer_types calls sparse; its MTP layer drafts as DeepSeek-V3's."""


class YoutuForCausalLM(DeepseekV2ForCausalLM):
    """Tencent's Youtu-LLM (Youtu-LLM-2B and its base): DeepSeek-V3's latent attention (rotary values in
    pairs unless rope_interleave is false) in Llama's layers, dense MLPs everywhere, a tied head."""


class AXK1DecoderLayer(DeepseekDecoderLayer):
    """A.X-K1's layer: DeepSeek-V3's, its routed layers' MLP output (experts and shared expert summed)
    normed before the residual add (``post_mlp_layernorm``)."""

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        self.post_mlp_layernorm = (RMSNorm(config.hidden_size, config.rms_norm_eps) if config.layer_is_moe(layer)
                                   else None)

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = super().forward(rope, hidden, residual, meta)
        return (hidden if self.post_mlp_layernorm is None else self.post_mlp_layernorm.forward(hidden)), residual


class AXK1Model(LlamaModel):
    layer_class = AXK1DecoderLayer


class AXK1ForCausalLM(DeepseekV3ForCausalLM):
    """SK Telecom's A.X-K1 (AXK1ForCausalLM): DeepSeek-V3 (latent attention with a query LoRA, grouped
    sigmoid routing beside a shared expert per mlp_layer_types) whose routed layers norm their MLP's
    output; the norm read as released (``layers.N.post_mlp_layernorm``) or under transformers' name
    (``layers.N.mlp.post_mlp_layernorm``). As released, the dense layers store a norm they do not use
    (not read) and the routers no correction bias (zero where absent, as transformers keeps it)."""

    model_class = AXK1Model

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        for module in self.modules():
            bias = getattr(getattr(module, "gate", None), "e_score_correction_bias", None)
            if isinstance(bias, nn.Parameter):
                bias.optional_in_checkpoint = True  # (weights.load_weights: zero where the checkpoint has none)

    def reads_checkpoint_tensor(self, name: str) -> bool:
        if not super().reads_checkpoint_tensor(name):
            return False
        parts = name.split(".")
        if ("post_mlp_layernorm" in parts and "layers" in parts and parts[parts.index("layers") + 1].isdigit()):
            return self.config.layer_is_moe(int(parts[parts.index("layers") + 1]))
        return True

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        return super().checkpoint_tensors(
            (name.replace(".mlp.post_mlp_layernorm.", ".post_mlp_layernorm."), tensor) for name, tensor in weights)


class MiniCPM3ForCausalLM(DeepseekV2ForCausalLM):
    """MiniCPM3 (openbmb/MiniCPM3-4B): MLA with its rotary values in halves (no reordering), dense
    MLPs, and MiniCPM's scalings of the embeddings, residual adds and logits (ModelConfig's Granite
    multipliers)."""
