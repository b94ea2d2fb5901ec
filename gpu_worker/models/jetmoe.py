"""JetMoE (JetMoeForCausalLM: jetmoe-8b and its chat model): mixtures of experts in both sublayers.

* Attention is a mixture of attention heads (MoA): each token's router picks its top k experts; each
  expert projects the token to num_key_value_heads query heads of kv_channels (its own
  ``input_linear``) and projects their outputs back (``output_linear``), weighted by the softmax over
  the chosen logits, plus a bias; keys and values are one projection shared by all experts
  (``kv_proj``: the keys' rows, then the values'). The token's k x num_key_value_heads query heads
  attend to the shared heads, head h of every expert to key head h: held here as query heads grouped by
  key head (h's k queries together), which PagedAttention's grouped-query attention reads as such.
* The MLP is routed experts of gated SiLU (``input_linear``: gate rows, then up rows) with a bias added
  after them (SparseMoeBlock, its renormalised top k).

Under tensor parallelism each expert's query heads (and the shared key heads) are split across ranks
as a Llama attention's are (one key head: the attention replicated on every rank), and the routed MLP as
FusedMoE splits it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from gpu_worker import distributed
from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.layers.attention import PagedAttention
from gpu_worker.layers.layernorm import RMSNorm
from gpu_worker.layers.linear import MergedColumnParallelLinear
from gpu_worker.layers.rotary import RotaryEmbedding
from gpu_worker.layers.weight_utils import WeightLike, copy_into, load_sharded
from gpu_worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, SparseMoeBlock
from gpu_worker.models.renamed_checkpoint import rename_first


class FusedKVLinear(MergedColumnParallelLinear):
    """Keys and values of one projection ([keys' rows; values' rows] in the checkpoint), each split across
    ranks by heads."""

    def weight_loader(self, param: nn.Parameter, loaded: WeightLike, shard_id: int | str | None = None) -> None:
        if shard_id is not None:
            return super().weight_loader(param, loaded, shard_id)
        size = self.output_sizes[0]
        for part in (0, 1):
            super().weight_loader(param, loaded.narrow(0, part * size, size), part)
        return None


def _stacked(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class MixtureOfAttentionHeads(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0, norm_class: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = distributed.get_tp_rank(), distributed.get_tp_world_size()
        experts, self.top_k, hidden = config.num_experts, config.num_experts_per_tok, config.hidden_size
        self.head_dim = config.head_dim
        # Each expert's heads split across ranks; one key head (each expert one query head) replicated on
        # every rank, which then computes the whole attention (no all-reduce).
        self.replicated = config.num_key_value_heads == 1 and self.tp_size > 1
        if config.num_key_value_heads % self.tp_size and not self.replicated:
            raise ValueError(f"num_key_value_heads ({config.num_key_value_heads}) must be divisible by the "
                             f"tensor-parallel size ({self.tp_size}), or be 1")
        shards, shard = (1, 0) if self.replicated else (self.tp_size, self.tp_rank)
        self.heads = config.num_key_value_heads // shards  # (each expert's query heads on this rank)
        width = self.heads * self.head_dim
        self.router = nn.Linear(hidden, experts, bias=False).requires_grad_(False)
        # Each expert's query projection [experts, width, hidden] and output projection [experts, hidden, width]:
        # this rank's heads of each.
        self.q_experts = _stacked(experts, width, hidden)
        self.q_experts.weight_loader = lambda param, loaded, shard_id=None: load_sharded(param, loaded, 1, shard)
        self.o_experts = _stacked(experts, hidden, width)
        self.o_experts.weight_loader = lambda param, loaded, shard_id=None: load_sharded(param, loaded, 2, shard)
        self.o_bias = _stacked(hidden)
        self.o_bias.weight_loader = lambda param, loaded, shard_id=None: copy_into(param, loaded.narrow(0, 0, hidden))
        total = config.num_key_value_heads * self.head_dim
        self.kv_proj = FusedKVLinear(hidden, [total, total], tp_rank=shard, tp_size=shards)
        self.attn = PagedAttention(self.top_k * self.heads, self.heads, self.head_dim, config.attention_scale,
                                   config.layer_sliding_window(layer))

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n, k, heads, d = hidden.shape[0], self.top_k, self.heads, self.head_dim
        logits = self.router.forward(hidden).float()
        top_logits, chosen = logits.topk(k, dim=-1)
        gates = torch.softmax(top_logits, dim=-1).to(hidden.dtype)
        # Each expert's (token, slot) pairs, found once (one sync with the host a layer).
        order = chosen.flatten().argsort()
        counts = torch.bincount(chosen.flatten(), minlength=self.q_experts.shape[0]).tolist()
        groups = [(expert, pairs) for expert, pairs in enumerate(order.split(counts)) if len(pairs)]
        # Each (token, slot)'s queries from its expert: [n, k, heads * d].
        q = hidden.new_empty(n * k, heads * d)
        for expert, pairs in groups:
            q[pairs] = hidden[pairs // k] @ self.q_experts[expert].t()
        q = q.view(n, k, heads * d)
        keys, values = self.kv_proj.forward(hidden).split(heads * d, dim=-1)
        # Query heads grouped by key head: [n, heads, k, d] -> heads x k query heads, h's k queries together.
        qk = torch.cat((q.view(n, k, heads, d).transpose(1, 2).reshape(n, heads * k, d), keys.view(n, heads, d)),
                       dim=1)
        RotaryEmbedding.rotate_(qk, rope[0], rope[1])
        out = self.attn.forward(qk[:, : heads * k], qk[:, heads * k:], values.reshape(n, heads, d), meta)
        per_slot = out.view(n, heads, k, d).transpose(1, 2).reshape(n * k, heads * d)
        weights = gates.flatten()
        result = torch.zeros_like(hidden)
        for expert, pairs in groups:
            projected = per_slot[pairs] @ self.o_experts[expert].t()
            result.index_add_(0, pairs // k, projected * weights[pairs, None])
        if self.tp_size > 1 and not self.replicated:
            distributed.all_reduce(result)
        return result + self.o_bias


class JetMoeMoE(SparseMoeBlock):
    """Routed experts (the softmax over the top k logits) with a bias added after them."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.bias = _stacked(config.hidden_size)
        self.bias.weight_loader = lambda param, loaded, shard_id=None: copy_into(param, loaded.narrow(
            0, 0, config.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.bias


class JetMoeDecoderLayer(LlamaDecoderLayer):
    attention_class = MixtureOfAttentionHeads  # type: ignore[assignment]
    moe_class = JetMoeMoE

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        # (transformers' layers' norms take RMSNorm's default epsilon, 1e-6, whatever rms_norm_eps says;
        # the final norm takes rms_norm_eps)
        self.input_layernorm = RMSNorm(config.hidden_size, 1e-6)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, 1e-6)


class JetMoeModel(LlamaModel):
    layer_class = JetMoeDecoderLayer


class JetMoeForCausalLM(LlamaForCausalLM):
    model_class = JetMoeModel
    # (No fused q/k/v or gate/up projections of Llama's names here.)
    packed_modules_mapping: dict[str, tuple[str, int | str]] = {}

    _RENAMED = ((".self_attention.experts.input_linear.weight", ".self_attn.q_experts"),
                (".self_attention.experts.output_linear.weight", ".self_attn.o_experts"),
                (".self_attention.experts.router.layer.", ".self_attn.router."),
                (".self_attention.experts.bias", ".self_attn.o_bias"),
                (".self_attention.", ".self_attn."),
                (".mlp.input_linear.weight", ".mlp.experts.gate_up_proj"),
                (".mlp.output_linear.weight", ".mlp.experts.down_proj"),
                (".mlp.router.layer.", ".mlp.gate."))

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        return ((rename_first(name, self._RENAMED), tensor) for name, tensor in weights)
