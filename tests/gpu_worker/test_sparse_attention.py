"""DeepSeek Sparse Attention's split of a step (gpu_worker/models/deepseek_v32.py): which queries the dense
paged attention answers and which the sparse path does: each exactly once."""

from __future__ import annotations

import numpy as np
import torch

from gpu_worker.attn_metadata import build_attention_metadata, compute_slot_mapping
from gpu_worker.config import ModelConfig
from gpu_worker.models.deepseek_v32 import SparseMLAAttention
from tests.gpu_worker.utils import save_tiny_model

BLOCK = 4


def _step(num_computed: list[int], query_lens: list[int], num_decodes: int, decode_in_place: bool = False):
    """The metadata of a step whose request i has num_computed[i] keys cached and query_lens[i] new tokens
    (the first num_decodes requests decoding), each request's blocks its own."""
    seq_lens = np.array(num_computed) + np.array(query_lens)
    blocks = -(-seq_lens // BLOCK)
    table = np.zeros((len(seq_lens), int(blocks.max())), dtype=np.int64)
    first = 0
    for i, n in enumerate(blocks):
        table[i, :n] = np.arange(first, first + n)
        first += n
    qsl = np.concatenate(([0], np.cumsum(query_lens)))
    req = np.repeat(np.arange(len(seq_lens)), query_lens)
    positions = np.concatenate([np.arange(c, c + q) for c, q in zip(num_computed, query_lens, strict=True)])
    slots = compute_slot_mapping(table, req, positions, BLOCK)
    return build_attention_metadata(table, blocks, qsl, np.array(num_computed), num_decodes, slots, BLOCK,
                                    torch.device("cpu"), decode_in_place=decode_in_place), positions


def test_every_query_is_answered_once_densely_or_sparsely(tmp_path):
    """index_topk 6: decodes at 3 and 9 keys (one past: both take the sparse path), a chunk of positions 4..8
    (its queries at 7, 8 and 9 keys sparse, the first two dense over 5 and 6 keys), a first chunk of 5
    tokens (dense, as it was); a step within 6 keys everywhere keeps its metadata."""
    config = ModelConfig.from_pretrained(save_tiny_model(tmp_path, "deepseek_v32"))
    assert config.index_topk == 6
    attention = SparseMLAAttention(config)
    meta, positions = _step([2, 8, 4, 0], [1, 1, 5, 5], num_decodes=2)
    dense = attention._step_of(meta).dense
    assert dense.num_decodes == 0 and dense.decode_block_table is None and dense.decode_seq_lens is None
    cut, whole = dense.prefills
    assert (cut.token_start, cut.token_end, cut.num_keys) == (2, 4, 6) and cut.mask.shape == (2, 6)
    assert torch.equal(cut.mask, meta.prefills[0].mask[:2, :6])
    assert whole is meta.prefills[1]
    answered_densely = set(range(cut.token_start, cut.token_end)) | set(range(whole.token_start, whole.token_end))
    sparse = {i for i, p in enumerate(positions) if p + 1 > 6 or (i < 2 and meta.decode_max_seq_len > 6)}
    assert answered_densely | sparse == set(range(len(positions))) and not answered_densely & sparse
    assert torch.equal(dense.slot_mapping, meta.slot_mapping)  # (every token's row still written)
    short, _ = _step([2, 1], [1, 5], num_decodes=1)
    assert attention._step_of(short).dense is short


def test_the_dense_pass_returns_every_row_when_it_answers_only_the_decodes(tmp_path):
    """A short decode beside a chunk whose every query is past index_topk keys (a long prompt's later
    chunk): the dense pass answers the decode alone, writes every token's row, and still returns a row per
    token (on both decode paths), the sparse path filling the chunk's."""
    from gpu_worker.kv_cache import allocate_kv_cache

    config = ModelConfig.from_pretrained(save_tiny_model(tmp_path, "deepseek_v32"))
    attention = SparseMLAAttention(config)
    width = attention.attn.head_dim
    for in_place in (False, True):
        attention.attn.kv_cache = allocate_kv_cache(1, 8, BLOCK, 1, width, torch.float32, torch.device("cpu"))[0]
        meta, _ = _step([2, 8], [1, 3], num_decodes=1, decode_in_place=in_place)
        dense = attention._step_of(meta).dense
        assert dense.num_decodes == 1 and dense.prefills == []
        q = torch.randn(4, attention.num_heads, width)
        row = torch.randn(4, 1, width)
        out = attention.attn.forward(q, row, row, dense)
        assert out.shape == (4, attention.num_heads * width)
        written = attention.attn.kv_cache[0].view(-1, width)[meta.slot_mapping]
        assert torch.equal(written, row[:, 0])
