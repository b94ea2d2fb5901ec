"""DeepSeek-V3.2 (DeepseekV32ForCausalLM: DeepSeek-V3.2-Exp, -V3.2, -V3.2-Speciale) and GLM-5
(GlmMoeDsaForCausalLM): DeepSeek-V3's layers whose latent attention is DeepSeek Sparse Attention (DSA).
Each layer's "lightning indexer" scores every earlier key for each query, and the query attends to the
``index_topk`` keys scoring best (2048 as released) rather than to all of them.

The indexer (checkpoint ``self_attn.indexer.*``, whole on every tensor-parallel rank as vLLM keeps it):
``index_n_heads`` query heads of ``index_head_dim`` values from the query bottleneck (``wq_b`` on the
normed ``q_a_proj`` output the attention's own queries start from), one key per token (``wk``, then a
LayerNorm with a bias), the first ``qk_rope_head_dim`` values of each rotated with the layer's RoPE
(in halves, as Llama's: the indexer's are not in pairs as the attention's are), and a weight per head
and token (``weights_proj``). A key's score is sum_h w_h * relu(q_h . k * index_head_dim^-0.5) *
index_n_heads^-0.5, in fp32. DeepSeek's own kernels rotate both by a Hadamard matrix and round them to
fp8 first: the rotation leaves dot products unchanged, and fp8 is their precision trade (transformers
and this engine score in fp32 from the model's dtype).

Where the keys live: each token's indexer key is stored in the cache row after its latent and rotary
key (the row is kv_lora_rank + qk_rope_head_dim + index_head_dim wide), so the paged cache, the prefix
cache, chunked prefill, preemption, KV offloading and P/D transfers carry it unchanged. The attention's
queries are zero over those values, so dense attention over the rows is MLA's own.

How a query attends: a query that sees at most ``index_topk`` keys attends to all of them (its top k
is every key it sees), so it takes the paged attention path of every layer, the indexer's queries not
computed. The queries that see more (their position at or past ``index_topk``) are left out of that
pass (a chunk cut before its first such query; every decode row once one is) and score their keys,
keep the top k and attend to those alone, in fp32 softmax, in tiles of bounded size: plain PyTorch
gathers (no FlashMLA sparse kernel here), so long contexts cost the indexer's full scoring per query
and layer, as they do in DeepSeek's design, plus a copy of the chosen rows, and no dense attention.

GLM-5 differs in two ways: its indexer's rotary values are in pairs (their rows reordered into halves
at load: the query projection's per head, the key projection's and its LayerNorm's, whose statistics
no order changes), and its config may mark layers "shared": those have no indexer and attend to the
keys the last indexing layer chose for the same query (the choices of a step kept on the model,
``SparseStep``; their cache rows' indexer values stay zero).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.layers.attention import eager_attention, gather_kv
from gpu_worker.layers.layernorm import LayerNorm, RMSNorm
from gpu_worker.layers.rotary import RotaryEmbedding, pairs_to_halves_order
from gpu_worker.layers.weight_utils import WeightLike, materialize
from gpu_worker.models.deepseek import DeepseekDecoderLayer, DeepseekV3ForCausalLM, MLAAttention
from gpu_worker.models.llama import LlamaModel

# The values one tile of the sparse path holds at once (index scores, chosen rows, attention scores):
# 2^24 of each (64 MiB in fp32).
_VALUES_PER_TILE = 1 << 24


@dataclass
class SparseStep:
    """What a model's sparse layers derive from a step's metadata, once for all of them (the model gives
    its layers one; the first layer to run in a step fills it): whether a query sees more than
    index_topk keys, the metadata of the dense pass (the others' queries left out), the decode rows'
    key counts. And, where layers share a choice (GLM-5: ``record_choices``), the last indexing layer's:
    per token row, the index_topk key positions ([tokens, index_topk] int64, or more rows: the buffer is
    kept) and which of them are keys it sees (bool). Only the rows that take the sparse path are written
    (those of a chunk past index_topk keys, every decode row once one is), and only they are read."""

    meta: AttentionMetadata | None = None
    any_sparse: bool = False
    dense: AttentionMetadata | None = None
    decode_counts: torch.Tensor | None = None
    record_choices: bool = False
    chosen: torch.Tensor | None = None
    seen: torch.Tensor | None = None


class LightningIndexer(nn.Module):
    """DSA's indexer: per token, its queries (from the attention's normed query bottleneck), its key and
    its heads' weights."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.wq_b = nn.Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False).requires_grad_(False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False).requires_grad_(False)
        self.k_norm = LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False).requires_grad_(False)
        # Both scales fold into the heads' weights: relu(a * s) = s * relu(a) for s > 0.
        self.weight_scale = self.num_heads ** -0.5 * self.head_dim ** -0.5

    def key(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor) -> torch.Tensor:
        """Each token's rotated key [T, 1, head_dim], in the model's dtype (what the cache keeps)."""
        k = self.k_norm.forward(self.wk.forward(hidden)).view(hidden.shape[0], 1, self.head_dim)
        return RotaryEmbedding.rotate_(k, rope[0], rope[1])

    def queries(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, q_resid: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's rotated queries [T, heads, head_dim] and its heads' weights [T, heads], both fp32 (the
        scales folded into the weights; an fp16 model's weights computed in fp32, as transformers keeps
        that projection)."""
        q = self.wq_b.forward(q_resid).view(hidden.shape[0], self.num_heads, self.head_dim)
        RotaryEmbedding.rotate_(q, rope[0], rope[1])
        if hidden.dtype == torch.float16:
            weights = F.linear(hidden.float(), self.weights_proj.weight.float())
        else:
            weights = self.weights_proj.forward(hidden).float()
        return q.float(), weights.mul_(self.weight_scale)


class SparseMLAAttention(MLAAttention):
    """MLA whose queries past ``index_topk`` keys attend to the keys its indexer picks."""

    def __init__(self, config: ModelConfig, layer: int = 0, norm_class: type[RMSNorm] = RMSNorm) -> None:
        super().__init__(config, layer, norm_class)
        shared = layer < len(config.indexer_shared_layers) and config.indexer_shared_layers[layer]
        # (A layer sharing another's choice has no indexer: its rows' indexer values are zero.)
        self.indexer = None if shared else LightningIndexer(config)
        self.index_topk, self.index_dim = config.index_topk, config.index_head_dim
        # The cache row: [latent, rotary key, indexer key].
        self.latent_width = self.kv_lora + self.rope
        # What the step's metadata gives every sparse layer of the model (the model's layers share one).
        self.step = SparseStep()

    def attend(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, q_resid: torch.Tensor | None,
               query: torch.Tensor, key: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        assert q_resid is not None  # (ModelConfig requires DSA's query bottleneck)
        num_tokens, heads, width = query.shape[0], self.num_heads, self.attn.head_dim
        step = self._step_of(meta)
        index_q = weights = None
        if self.indexer is None:
            index_k = key.new_zeros(num_tokens, 1, self.index_dim)
        else:
            index_k = self.indexer.key(rope, hidden)
            if step.any_sparse:  # (the queries only score keys past index_topk)
                index_q, weights = self.indexer.queries(rope, hidden, q_resid)
        padded = query.new_zeros(num_tokens, heads, width)
        padded[..., : self.latent_width] = query
        # Every token's row is written to the cache here (the indexer's key with the latent); the queries
        # that see at most index_topk keys attend densely, the others are then attended over their
        # chosen keys (their rows of ``out`` left to that).
        row = torch.cat((key, index_k), dim=-1)
        out = self.attn.forward(padded, row, row, step.dense).view(num_tokens, heads, width)
        if step.any_sparse:
            self._sparse_rows(padded, index_q, weights, meta, out)
        return out.view(num_tokens, heads * width)

    def _step_of(self, meta: AttentionMetadata) -> SparseStep:
        """The model's SparseStep, filled for ``meta`` by the first sparse layer that runs with it."""
        step = self.step
        if step.meta is not meta:
            topk, nd = self.index_topk, meta.num_decodes
            step.meta = meta
            step.any_sparse = ((nd > 0 and meta.decode_max_seq_len > topk)
                               or any(span.num_keys > topk for span in meta.prefills))
            step.dense = self._dense_part(meta) if step.any_sparse else meta
            step.decode_counts = None
            if nd and meta.decode_max_seq_len > topk:
                if meta.decode_seq_lens is not None:
                    step.decode_counts = meta.decode_seq_lens
                elif meta.decode_mask is None:
                    step.decode_counts = torch.full((nd,), meta.decode_max_seq_len, device=meta.slot_mapping.device)
                else:
                    step.decode_counts = meta.decode_mask.view(nd, -1).sum(-1)
        return step

    def _dense_part(self, meta: AttentionMetadata) -> AttentionMetadata:
        """The step's metadata without the queries the sparse path answers: no decode rows once one of
        them sees more than index_topk keys, and each prefill chunk cut before its first query that
        does (the slots of every token kept: all are written)."""
        topk = self.index_topk
        spans = []
        for span in meta.prefills:
            qlen = span.token_end - span.token_start
            dense = min(qlen, max(0, topk - (span.num_keys - qlen)))  # (its first queries, j0 of _sparse_rows)
            if dense == qlen:
                spans.append(span)
            elif dense:
                # (Query j sees keys up to num_keys - qlen + j: the kept queries' keys end before the cut's.)
                num_keys = span.num_keys - qlen + dense
                block_size = self.attn.kv_cache[0].shape[1] if self.attn.kv_cache is not None else None
                spans.append(dataclasses.replace(
                    span, token_end=span.token_start + dense, num_keys=num_keys,
                    block_ids=span.block_ids if block_size is None else span.block_ids[: -(-num_keys // block_size)],
                    mask=None if span.mask is None else span.mask[:dense, :num_keys]))
        # (No window in an MLA layer: the step's windowed metadata is not this layer's.)
        if meta.num_decodes and meta.decode_max_seq_len > topk:
            return dataclasses.replace(meta, num_decodes=0, decode_block_table=None, decode_max_seq_len=0,
                                       decode_mask=None, decode_seq_lens=None, decode_key_starts=None, prefills=spans,
                                       windowed=None)
        return dataclasses.replace(meta, prefills=spans, windowed=None)

    def _sparse_rows(self, query: torch.Tensor, index_q: torch.Tensor | None, weights: torch.Tensor | None,
                     meta: AttentionMetadata, out: torch.Tensor) -> None:
        """Overwrite ``out``'s rows of the queries that see more than index_topk keys with their
        attention over the keys the indexer picks (without an indexer: those the last indexing layer
        picked). Decode rows go together: once one of them sees more, they all take this path (a
        row seeing fewer keeps all its keys: the dense answer again, with no host sync to sort them)."""
        assert self.attn.kv_cache is not None
        cache, topk, dtype = self.attn.kv_cache[0], self.index_topk, query.dtype
        index_heads = self.indexer.num_heads if self.indexer is not None else 1
        nd = meta.num_decodes
        counts = self.step.decode_counts
        if counts is not None:
            # Each decode row reads its own blocks (a tile of rows at a time).
            num_keys = meta.decode_max_seq_len
            rows = max(1, _VALUES_PER_TILE // (num_keys * max(self.attn.head_dim, index_heads)))
            for start in range(0, nd, rows):
                end = min(nd, start + rows)
                keys = gather_kv(cache, meta.decode_block_table[start:end], num_keys, dtype)[:, 0]
                out[start:end] = self._attend_chosen(query, index_q, weights, keys, self._index_keys(keys),
                                                     counts[start:end], start)
        for span in meta.prefills:
            num_keys, qlen = span.num_keys, span.token_end - span.token_start
            # Query j of the chunk sees num_keys - qlen + j + 1 keys: the first past index_topk is j0.
            j0 = max(0, topk - (num_keys - qlen))
            if j0 >= qlen:
                continue
            keys = gather_kv(cache, span.block_ids, num_keys, dtype)  # [1, N, width]: one KV head
            index_keys = self._index_keys(keys)  # (once for the chunk's tiles)
            rows = max(1, _VALUES_PER_TILE // max(num_keys * index_heads,
                                                  topk * max(self.attn.head_dim, self.num_heads)))
            for j in range(j0, qlen, rows):
                k = min(qlen, j + rows)
                counts = torch.arange(num_keys - qlen + j + 1, num_keys - qlen + k + 1, device=query.device)
                first = span.token_start + j
                out[first: first + k - j] = self._attend_chosen(query, index_q, weights, keys, index_keys, counts,
                                                                first)

    def _index_keys(self, keys: torch.Tensor) -> torch.Tensor | None:
        """The indexer's keys of gathered cache rows, fp32 (None in a layer sharing another's choice)."""
        return None if self.indexer is None else keys[..., self.latent_width:].float()

    def _attend_chosen(self, query: torch.Tensor, index_q: torch.Tensor | None, weights: torch.Tensor | None,
                       keys: torch.Tensor, index_keys: torch.Tensor | None, counts: torch.Tensor,
                       first: int) -> torch.Tensor:
        """The R = len(counts) token rows from ``first``: of ``query`` [T, heads, width], ``index_q`` [T,
        index heads, index dim] fp32 and ``weights`` [T, index heads] fp32 (None: the shared choices),
        over ``keys`` [R or 1, N, width] the cache rows they may read (``index_keys`` their indexer
        values, fp32), of which row r sees the first ``counts[r]``. Returns [R, heads, width]: each row's
        attention over the index_topk keys its indexer scores best (a row seeing fewer keeps them all)."""
        num_rows, num_keys = counts.shape[0], keys.shape[-2]
        last = first + num_rows
        step = self.step
        if index_q is None or weights is None or index_keys is None:
            assert step.chosen is not None and step.seen is not None
            chosen, seen = step.chosen[first:last], step.seen[first:last]
        else:
            scores = torch.matmul(index_q[first:last], index_keys.transpose(-1, -2)).relu_()  # [R, index heads, N]
            index = torch.matmul(weights[first:last].unsqueeze(1), scores).squeeze(1)  # [R, N]
            visible = torch.arange(num_keys, device=query.device)[None, :] < counts[:, None]
            index.masked_fill_(~visible, float("-inf"))
            best, chosen = index.topk(min(self.index_topk, num_keys), dim=-1)  # [R, k]
            # (A row seeing fewer than k keys keeps all of them; the -inf picks beside them are masked.)
            seen = best > float("-inf")
            if step.record_choices:  # (for the layers sharing this choice: rows past index_topk keys choose k)
                if step.chosen is None or step.chosen.shape[0] < query.shape[0]:
                    # (kept across steps: a sharing layer reads only rows its indexing layer wrote this step)
                    step.chosen = query.new_empty(query.shape[0], self.index_topk, dtype=torch.int64)
                    step.seen = query.new_empty(query.shape[0], self.index_topk, dtype=torch.bool)
                assert step.seen is not None
                step.chosen[first:last] = chosen
                step.seen[first:last] = seen
        rows = torch.gather(keys.expand(num_rows, -1, -1), 1,
                            chosen.unsqueeze(-1).expand(-1, -1, keys.shape[-1]))  # [R, k, width]
        out = eager_attention(query[first:last].unsqueeze(1), rows.unsqueeze(1), rows.unsqueeze(1),
                              seen.view(num_rows, 1, 1, -1), self.attn.scale)
        return out[:, 0]


class DeepseekV32DecoderLayer(DeepseekDecoderLayer):
    attention_class = SparseMLAAttention  # type: ignore[assignment]


class DeepseekV32Model(LlamaModel):
    layer_class = DeepseekV32DecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        # (One SparseStep for the layers: each step's metadata read once, an indexing layer's choice
        # recorded for the layers sharing it.)
        step = SparseStep(record_choices=any(config.indexer_shared_layers))
        for layer in self.layers[self.stage.start:self.stage.end]:
            layer.self_attn.step = step


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    model_class = DeepseekV32Model


class GlmMoeDsaModel(DeepseekV32Model):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        if any(config.indexer_shared_layers) and config.indexer_shared_layers[self.stage.start]:
            raise ValueError(f"pipeline stage of layers {self.stage.start}..{self.stage.end - 1} starts with a "
                             f"layer sharing an earlier layer's top-k keys (indexer_types 'shared'), which "
                             f"another stage chooses: split the layers at an indexing ('full') layer")


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    """GLM-5 (zai-org's GLM-5 and its FP8 release): DeepSeek-V3.2's layers (GLM's widths: heads of 192 + 64
    query/key values and 256 value values, a 2048-value query bottleneck, experts in one group), its
    indexer's rotary values in pairs, layers that may share an indexing layer's choice."""

    model_class = GlmMoeDsaModel

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        """(Besides the attention's rows, DeepSeek's) the indexer's rotary rows from pairs into halves: each
        query head's, the key's, and its LayerNorm's weight and bias alike."""
        config = self.config
        rope, dim = config.qk_rope_head_dim, config.index_head_dim
        order = pairs_to_halves_order(rope)
        for name, tensor in super().checkpoint_tensors(weights):
            if not config.index_rope_interleave or ".self_attn.indexer." not in name \
                    or name.endswith("weights_proj.weight") or (self.pp_missing_prefixes
                                                                and name.startswith(self.pp_missing_prefixes)):
                yield name, tensor
                continue
            rows = materialize(tensor)
            per_head = rows.reshape(-1, dim, *rows.shape[1:])
            yield name, torch.cat((per_head[:, :rope].index_select(1, order), per_head[:, rope:]), dim=1
                                  ).reshape(rows.shape)
