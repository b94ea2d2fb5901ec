"""Vocab-parallel token embedding and LM head.

The vocab is padded to a multiple of the TP size so every rank owns an equal contiguous range;
padded rows are zero and their logits are cut off after the gather.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker import distributed
from gpu_worker.layers.linear import new_weight, tp_rank_and_size
from gpu_worker.layers.weight_utils import WeightLike, copy_into


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int,
                 tp_rank: int | None = None, tp_size: int | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_rank, tp_size)
        self.num_embeddings = num_embeddings
        self.num_embeddings_padded = -(-num_embeddings // self.tp_size) * self.tp_size
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: WeightLike, shard_id: int | str | None = None) -> None:
        if loaded.shape[0] != self.num_embeddings:
            raise ValueError(f"embedding has {loaded.shape[0]} rows, config vocab_size is {self.num_embeddings}")
        n = self.vocab_end - self.vocab_start
        param.data[n:].zero_()
        copy_into(param.data[:n], loaded.narrow(0, self.vocab_start, n))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Tokens owned by another rank look up row 0 here and are zeroed; the all-reduce fills them in.
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill_(outside, 0)
        out = F.embedding(local, self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return distributed.all_reduce(out)


class PositionEmbedding(nn.Module):
    """A learned row per position, added to the token embeddings (GPT-2's ``wpe``); whole on every TP
    rank (a table of positions is small beside the vocabulary's). ``offset``: the table's first rows
    are never read, position p is row p + offset (OPT's 2)."""

    def __init__(self, num_positions: int, embedding_dim: int, offset: int = 0) -> None:
        super().__init__()
        self.offset = offset
        self.weight = nn.Parameter(torch.empty(num_positions + offset, embedding_dim), requires_grad=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions + self.offset if self.offset else positions, self.weight)


class SinusoidalPositionEmbedding(nn.Module):
    """fairseq's fixed sinusoidal positions (XGLM's): row r is [sin(r w_0..w_{h-1}), cos(r w_0..w_{h-1})],
    w_i = 10000 ** (-i / (h - 1)) for h = dim / 2 (a zero column after an odd dim), the row ``padding_row``
    zero; position p is row p + offset. A buffer computed here, not read from a checkpoint."""

    def __init__(self, num_positions: int, embedding_dim: int, offset: int = 2, padding_row: int | None = None) -> None:
        super().__init__()
        self.offset = offset
        half = embedding_dim // 2
        rates = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000) / (half - 1)))
        angles = torch.arange(num_positions + offset, dtype=torch.float32).unsqueeze(1) * rates.unsqueeze(0)
        table = torch.cat((torch.sin(angles), torch.cos(angles), torch.zeros(len(angles), embedding_dim % 2)), dim=1)
        if padding_row is not None and 0 <= padding_row < len(table):
            table[padding_row] = 0
        # (computed in fp32, held in the model's dtype: the one it is built in)
        self.register_buffer("weight", table.to(torch.get_default_dtype()), persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions + self.offset, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> logits. Each rank computes its vocab slice; rank 0 gathers the full row.
    ``bias``: a logit bias per token (Phi-2's head), split as the rows are."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False,
                 tp_rank: int | None = None, tp_size: int | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, tp_rank, tp_size)
        # An untied head is only ever multiplied by, so it takes the GEMM-friendly layout; a tied
        # head shares the row-major embedding table (tie_to) instead.
        self.weight = new_weight(self.num_embeddings_per_partition, embedding_dim)
        self.weight.weight_loader = self.weight_loader
        self.bias = (nn.Parameter(torch.zeros(self.num_embeddings_per_partition), requires_grad=False) if bias
                     else None)
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding matrix (tie_word_embeddings): one parameter, loaded once."""
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = F.linear(hidden_states, self.weight, self.bias)
        logits = distributed.gather(logits, dim=-1)
        if logits is None:
            return None
        return logits[..., : self.num_embeddings]
