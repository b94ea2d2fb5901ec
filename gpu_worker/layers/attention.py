"""Attention over the paged KV cache.

Cache layout per layer: K and V of shape [num_blocks, block_size, num_kv_heads, head_dim], in the
model's dtype or the one ``--kv-cache-dtype`` chose (fp8: converted on write, widened on read). The new
K/V of the whole batch are written through ``slot_mapping`` before any request attends, because the
scheduler can hand request B prefix-cache blocks that request A fills in this very step.

Gemma 2 caps attention scores softly (cap * tanh(score / cap)) before the softmax, and GPT-OSS adds
an attention sink to each head's softmax (one more logit, learnt per head, with no value: it only
takes probability away from the keys), which SDPA cannot do: those layers attend through
``eager_attention`` (or the CPU decode kernel, which caps and sinks in C). So do the ALiBi layers
(BLOOM, MPT, falcon-rw: no rotary positions; each head's score of a key gains its slope times the
key's distance behind the query, added in fp32 to the scaled scores; vLLM's kernels take the slopes
alike).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.attn_metadata import AttentionMetadata, Window
from gpu_worker.cpu_kernels import paged_decode_attention_unchecked
from gpu_worker.kv_cache import FP8_DTYPES, read_kv, store_kv
from gpu_worker.layers.linear import tp_rank_and_size
from gpu_worker.layers.weight_utils import WeightLike, copy_into


def gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int, dtype: torch.dtype) -> torch.Tensor:
    """[..., num_blocks] block ids -> [..., num_kv_heads, seq_len, head_dim] in ``dtype`` (a copy of
    those blocks; an fp8 cache is gathered as bytes, then widened)."""
    _, block_size, num_kv_heads, head_dim = cache.shape
    lead = block_ids.shape[:-1]
    if cache.dtype in FP8_DTYPES:
        kv = cache.view(torch.uint8).index_select(0, block_ids.reshape(-1)).view(cache.dtype)
    else:
        kv = cache.index_select(0, block_ids.reshape(-1))
    kv = kv.view(*lead, block_ids.shape[-1] * block_size, num_kv_heads, head_dim)[..., :seq_len, :, :]
    return read_kv(kv, dtype).transpose(-3, -2)


def alibi_slopes(num_heads: int, bias_max: float = 8.0) -> torch.Tensor:
    """ALiBi's slope of each head, fp32 [num_heads] (Press et al.): with n the power of two at or above
    num_heads, 2^(-bias_max * i / n) for i = 1..n; where num_heads is not a power of two, the even i's
    then the odd ones, the first num_heads of them. MPT's form (``alibi_bias_max``); BLOOM's and
    Falcon's (a base of 2^(-8 / n) and the in-between powers for the remaining heads) give the same
    values, their bias_max being 8."""
    n = 2 ** math.ceil(math.log2(num_heads))
    slopes = torch.pow(2.0, -torch.arange(1, n + 1, dtype=torch.float64) * (bias_max / n))
    if n != num_heads:
        slopes = torch.cat((slopes[1::2], slopes[::2]))[:num_heads]
    return slopes.float()


def alibi_bias(slopes: torch.Tensor, behind: torch.Tensor) -> torch.Tensor:
    """fp32 biases slope * distance: ``slopes`` broadcast against ``behind`` (key position minus
    query position, <= 0 where the key is seen)."""
    return slopes * behind.to(torch.float32)


# Eager prefill holds its scores in memory (fp32 for the softmax): 2^24 of them (64 MiB) at most at once
# (under ALiBi an fp32 bias tile and the biased scores beside them, as large each).
_SCORES_PER_TILE = 1 << 24


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float, softcap: float | None = None, sinks: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with its scores materialised, as transformers' eager Gemma 2 and GPT-OSS compute it
    (the softmax in fp32). q: [B, num_kv_heads, R, head_dim], the rows of every query head sharing a KV
    head stacked (so one matmul per KV head reads its keys once); k, v: [B, num_kv_heads, N,
    head_dim]; mask: bool (True = attend), broadcastable to [B, num_kv_heads, R, N], or None; softcap:
    scores become softcap * tanh(score / softcap); sinks: each row's sink logit, fp32 broadcastable to
    [B, num_kv_heads, R, 1] (one more softmax term, with no value); bias: fp32, broadcastable to the
    scores, added to them in fp32 after the scale (ALiBi's). Returns [B, num_kv_heads, R, head_dim]."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if bias is not None:
        scores = bias + scores  # (fp32: a bf16 score cannot hold a bias of hundreds to the precision asked)
    if softcap is not None:
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:
        sink_column = sinks.expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat((scores.float(), sink_column), dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(q.dtype), v)


def query_heads_loader(param: nn.Parameter, loaded: WeightLike, shard_id: int | str | None = None) -> None:
    """This rank's query heads' values of a tensor of one value a head (sinks, Beam's gate biases): the
    heads are split across ranks as the q projection's."""
    rank, _ = tp_rank_and_size(None, None)
    heads = param.shape[0]
    copy_into(param.data, loaded.narrow(0, rank * heads, heads), "one value a query head")


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: Window | None = None, softcap: float | None = None, sinks: bool = False,
                 tiled_prefill_on: tuple[str, ...] = (), alibi_slopes: torch.Tensor | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_groups = num_heads // num_kv_heads
        # The query at position p sees the keys in (p - sliding_window, p] (under chunked attention, a
        # ChunkedWindow: those of its chunk); None: all keys up to p.
        self.sliding_window = sliding_window
        # Scores become softcap * tanh(score / softcap) before the softmax (Gemma 2); None: no cap.
        self.softcap = softcap
        # GPT-OSS: a learnt sink logit per query head of this rank, held in fp32 whatever the model's
        # dtype (the checkpoint's ``self_attn.sinks``).
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32), requires_grad=False)
            self.sinks.weight_loader = query_heads_loader
        else:
            self.register_parameter("sinks", None)
        # ALiBi: the slope of each of this rank's query heads, fp32 [num_heads] (None: no ALiBi).
        if alibi_slopes is not None and alibi_slopes.shape != (num_heads,):
            raise ValueError(f"alibi_slopes must hold one slope per head ({num_heads}), "
                             f"got {tuple(alibi_slopes.shape)}")
        if alibi_slopes is not None and sliding_window is not None:
            raise ValueError("ALiBi with a sliding window is not served")
        self.register_buffer("alibi_slopes", None if alibi_slopes is None else alibi_slopes.float(), persistent=False)
        # Scores not through SDPA: soft-capped, sunk or biased.
        self.eager = softcap is not None or sinks or alibi_slopes is not None
        # Device types on which prefills take their scores in bounded tiles (eager) rather than SDPA:
        # MLA's 576-value heads over one KV head on CUDA, where no FlashAttention kernel takes heads
        # wider than 256 and SDPA's fallback would hold every query head's scores over the whole
        # chunk at once (on the CPU, SDPA's own kernel tiles them).
        self.tiled_prefill_on = tiled_prefill_on
        # Bound by the model runner once the cache is allocated; under the hybrid KV cache manager, with
        # the KV cache group whose blocks this layer's cache holds (gpu_worker/kv_cache_groups.py).
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.kv_group = 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim]. Returns [T, num_heads * head_dim]."""
        if self.kv_cache is None:
            raise RuntimeError("KV cache is not bound: call initialize_cache() first")
        k_cache, v_cache = self.kv_cache
        if meta.groups is not None:  # (the hybrid KV cache manager: this layer's group's blocks)
            group_meta = meta.groups[self.kv_group]
            assert group_meta is not None, "a layer's KV cache group has metadata on its own stage"
            meta = group_meta
        elif meta.window != self.sliding_window:
            meta = meta.for_window(self.sliding_window)
        num_kv_heads, head_dim = self.num_kv_heads, self.head_dim
        store_kv(k_cache, meta.slot_mapping, k)
        store_kv(v_cache, meta.slot_mapping, v)

        num_tokens = q.shape[0]
        nd = meta.num_decodes
        decode_out = None
        if nd:
            if meta.decode_seq_lens is not None:
                # The CPU kernel reads each request's blocks where they lie: no per-layer gather copy.
                decode_out = paged_decode_attention_unchecked(q[:nd], k_cache, v_cache, meta.decode_block_table,
                                                              meta.decode_seq_lens, self.scale,
                                                              meta.decode_key_starts, self.softcap, self.sinks,
                                                              self.alibi_slopes)
            else:
                kd = gather_kv(k_cache, meta.decode_block_table, meta.decode_max_seq_len, q.dtype)
                vd = gather_kv(v_cache, meta.decode_block_table, meta.decode_max_seq_len, q.dtype)
                # One query token per request: the query heads sharing a KV head become that head's
                # "query rows", so grouped-query attention needs no K/V repetition.
                qd = q[:nd].view(nd, num_kv_heads, self.num_groups, head_dim)
                if not self.eager:
                    decode_out = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask,
                                                                scale=self.scale)
                else:  # (the one query token's heads are the rows of their KV head)
                    sinks = None if self.sinks is None else self.sinks.view(num_kv_heads, self.num_groups, 1)
                    decode_out = eager_attention(qd, kd, vd, meta.decode_mask, self.scale, self.softcap, sinks,
                                                 self._decode_alibi_bias(meta))
            # (reshape: CUDA's SDPA kernels write [nd, groups, kv_heads, head_dim] in memory and hand
            # it back transposed, which no view can flatten.)
            if not meta.prefills and nd == num_tokens:
                return decode_out.reshape(nd, self.num_heads * head_dim)
        out = torch.empty_like(q)
        if decode_out is not None:
            # (One strided copy, whatever its layout: [nd, heads, hd], or SDPA's [nd, kv_heads, groups, hd].)
            out[:nd].unflatten(1, decode_out.shape[1:-1]).copy_(decode_out)
        gqa = self.num_groups > 1
        for span in meta.prefills:
            s, e = span.token_start, span.token_end
            kp = gather_kv(k_cache, span.block_ids, span.num_keys, q.dtype).unsqueeze(0)
            vp = gather_kv(v_cache, span.block_ids, span.num_keys, q.dtype).unsqueeze(0)
            if self.eager or q.device.type in self.tiled_prefill_on:
                out[s:e] = self._eager_prefill(q[s:e], kp, vp, span.mask)
                continue
            qp = q[s:e].transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=span.mask, is_causal=span.mask is None,
                                                scale=self.scale, enable_gqa=gqa)
            out[s:e] = op[0].transpose(0, 1)
        return out.reshape(num_tokens, self.num_heads * head_dim)

    def _decode_alibi_bias(self, meta: AttentionMetadata) -> torch.Tensor | None:
        """[num_decodes, num_kv_heads, groups, decode_max_seq_len] ALiBi biases of the gathered decode
        keys (None without ALiBi): each row's query is its last key (its length from the padding mask)."""
        if self.alibi_slopes is None:
            return None
        keys = torch.arange(meta.decode_max_seq_len, device=self.alibi_slopes.device)
        if meta.decode_mask is None:  # (every row reads all its keys)
            behind = keys - (meta.decode_max_seq_len - 1)
        else:
            behind = keys - (meta.decode_mask.sum(-1, keepdim=True).view(-1, 1, 1, 1) - 1)
        slopes = self.alibi_slopes.view(1, self.num_kv_heads, self.num_groups, 1)
        return alibi_bias(slopes, behind)

    def _eager_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
                            ) -> torch.Tensor:
        """One prefill chunk's q [L, num_heads, head_dim] against its keys [1, num_kv_heads, N, head_dim];
        ``mask`` [L, N] (None: causal over exactly the chunk). Returns [L, num_heads, head_dim]."""
        num_queries, num_keys = q.shape[0], k.shape[2]
        groups, kv_heads, head_dim = self.num_groups, self.num_kv_heads, self.head_dim
        # [kv_heads, groups, L, head_dim]: each KV head's query heads, their rows stacked per tile.
        grouped = q.view(num_queries, kv_heads, groups, head_dim).permute(1, 2, 0, 3)
        # The scores are materialised: queries go in tiles of at most _SCORES_PER_TILE scores.
        tile = max(1, _SCORES_PER_TILE // (self.num_heads * num_keys))
        # [kv_heads, groups, 1]: each query head's sink, for the rows of its tile.
        sinks = None if self.sinks is None else self.sinks.view(kv_heads, groups, 1)
        # (ALiBi: the chunk is the last num_queries of the keys, query i at key num_keys - num_queries + i.)
        slopes = None if self.alibi_slopes is None else self.alibi_slopes.view(kv_heads, groups, 1, 1)
        keys = None if slopes is None else torch.arange(num_keys, device=q.device)
        outs = []
        for i in range(0, num_queries, tile):
            rows = min(tile, num_queries - i)
            if mask is None:  # causal over exactly the chunk: query i + r sees keys 0 .. i + r
                tile_mask = (torch.arange(num_keys, device=q.device)[None, :]
                             <= torch.arange(i, i + rows, device=q.device)[:, None])
            else:
                tile_mask = mask[i: i + rows]
            tile_sinks = None if sinks is None else sinks.expand(kv_heads, groups, rows).reshape(kv_heads, -1, 1)
            bias = None
            if slopes is not None:
                queries = torch.arange(num_keys - num_queries + i, num_keys - num_queries + i + rows, device=q.device)
                bias = alibi_bias(slopes, keys[None, :] - queries[:, None]).reshape(1, kv_heads, groups * rows,
                                                                                    num_keys)
            out = eager_attention(grouped[:, :, i: i + rows].reshape(1, kv_heads, groups * rows, head_dim),
                                  k, v, tile_mask.repeat(groups, 1), self.scale, self.softcap, tile_sinks, bias)
            outs.append(out.reshape(kv_heads, groups, rows, head_dim))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return out.permute(2, 0, 1, 3).reshape(num_queries, self.num_heads, head_dim)
