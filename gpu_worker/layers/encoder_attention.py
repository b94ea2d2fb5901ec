"""Bidirectional attention within each prompt (encoders: BERT, ModernBERT, EmbeddingGemma).

Every token of a prompt attends to every other (or, with a ``window``, to those at most ``window``
positions away either side), over the pass's own q/k/v: nothing is cached, since an encoder's
prompt runs whole in one pass. The pass's prompts are attended as its EncoderMetadata lays them
out: one after another (CPU), or in padded batches (CUDA), each a 4-D attention call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.encoder_metadata import EncoderMetadata


class EncoderAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 window: int | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # Query i sees key j where |i - j| <= window (None: every key of its prompt).
        self.window = window
        self.gqa = num_kv_heads != num_heads

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim], the pass's prompts one after
        another. Returns [T, num_heads * head_dim]."""
        num_tokens, width = q.shape[0], self.num_heads * self.head_dim
        if not meta.batches:  # each prompt where it lies
            if len(meta.spans) == 1:
                return self._attend(q, k, v, meta).reshape(num_tokens, width)
            out = torch.empty_like(q)
            for start, end in meta.spans:
                out[start:end] = self._attend(q[start:end], k[start:end], v[start:end], meta)
            return out.reshape(num_tokens, width)
        out = torch.empty_like(q)
        for batch in meta.batches:
            qb, kb, vb = (x.index_select(0, batch.gather_rows).view(batch.batch, batch.length, x.shape[1],
                                                                     self.head_dim).transpose(1, 2)
                          for x in (q, k, v))
            attended = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=batch.mask(self.window), scale=self.scale,
                                                      enable_gqa=self.gqa)
            flat = attended.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim)
            out.index_copy_(0, batch.real_rows, flat.index_select(0, batch.real_slots))
        return out.reshape(num_tokens, width)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        """One prompt's q [L, num_heads, head_dim], k, v [L, num_kv_heads, head_dim] -> [L, num_heads, head_dim],
        as one 4-D call (the layout the fused kernels take)."""
        out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                             v.transpose(0, 1).unsqueeze(0),
                                             attn_mask=meta.window_mask(q.shape[0], self.window), scale=self.scale,
                                             enable_gqa=self.gqa)
        return out[0].transpose(0, 1)
