"""Layers in isolation: paged attention against dense causal attention, TP shard arithmetic."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gpu_worker.attn_metadata import build_attention_metadata, compute_slot_mapping
from gpu_worker.layers.activation import SiluAndMul, gated_activation
from gpu_worker.layers.attention import PagedAttention
from gpu_worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from gpu_worker.layers.layernorm import GemmaRMSNorm, RMSNorm
from gpu_worker.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from gpu_worker.layers.rotary import RotaryEmbedding

H, KVH, D, BS = 4, 2, 8, 4


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                    window: int | None = None, scale: float | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None,
                    alibi: torch.Tensor | None = None) -> torch.Tensor:
    """q: [n, H, D] for positions start..start+n-1; k, v: [start+n, KVH, D] (all keys so far); a
    sliding window lets position p see keys p - window + 1 .. p; scores are scaled by ``scale``
    (1 / sqrt(D) by default) and soft-capped where ``softcap`` is given; ``sinks`` [H]: each head's
    softmax has one more term, exp(sink), with no value; ``alibi`` [H]: each score gains its head's
    slope times the key's position (BLOOM's form: the query's own position moves no softmax)."""
    n, s = q.shape[0], k.shape[0]
    rep = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(rep, 1).transpose(0, 1)
    vv = v.repeat_interleave(rep, 1).transpose(0, 1)
    scores = q.transpose(0, 1) @ kk.transpose(1, 2) * (scale or 1 / math.sqrt(q.shape[-1]))
    if alibi is not None:
        scores = scores + alibi[:, None, None] * torch.arange(s, dtype=torch.float32)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    allowed = torch.arange(s)[None, :] <= (start + torch.arange(n))[:, None]
    if window is not None:
        allowed &= torch.arange(s)[None, :] > (start + torch.arange(n))[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return (scores.softmax(-1) @ vv).transpose(0, 1).reshape(n, -1)
    denominator = scores.exp().sum(-1, keepdim=True) + sinks.exp()[:, None, None]
    return ((scores.exp() / denominator) @ vv).transpose(0, 1).reshape(n, -1)


def run_batch(attn: PagedAttention, reqs: list[dict], decode_in_place: bool = False, num_decodes: int | None = None):
    """reqs: dicts with start, q, k, v (new tokens only), blocks; decodes (1 token) must come first
    (``num_decodes``: the requests attending as decodes, by default the one-token ones). Returns the
    output and the metadata (built for the layer's sliding window)."""
    if num_decodes is None:
        num_decodes = sum(1 for r in reqs if r["q"].shape[0] == 1)
    nblocks = np.array([len(r["blocks"]) for r in reqs])
    table = np.zeros((len(reqs), nblocks.max()), dtype=np.int64)
    for i, r in enumerate(reqs):
        table[i, : len(r["blocks"])] = r["blocks"]
    lens = np.array([r["q"].shape[0] for r in reqs])
    qsl = np.concatenate([[0], np.cumsum(lens)])
    starts = np.array([r["start"] for r in reqs])
    req_index = np.repeat(np.arange(len(reqs)), lens)
    positions = starts[req_index] + np.arange(qsl[-1]) - qsl[req_index]
    slots = compute_slot_mapping(table, req_index, positions, BS)
    meta = build_attention_metadata(table, nblocks, qsl, starts, num_decodes, slots, BS, torch.device("cpu"),
                                    decode_in_place, window=attn.sliding_window)
    out = attn(torch.cat([r["q"] for r in reqs]), torch.cat([r["k"] for r in reqs]),
               torch.cat([r["v"] for r in reqs]), meta)
    return out, meta


@pytest.fixture
def attn():
    layer = PagedAttention(H, KVH, D, D ** -0.5)
    layer.kv_cache = (torch.zeros(32, BS, KVH, D), torch.zeros(32, BS, KVH, D))
    return layer


def test_mixed_batch_matches_dense(attn):
    """Decodes of different lengths plus prefill chunks at arbitrary offsets, in one call."""
    torch.manual_seed(0)
    seqs = {name: (torch.randn(n, H, D), torch.randn(n, KVH, D), torch.randn(n, KVH, D))
            for name, n in [("a", 11), ("b", 6), ("c", 13), ("d", 9)]}
    blocks = {"a": [7, 3, 20], "b": [1, 30], "c": [4, 5, 6, 2], "d": [9, 8, 12]}
    # Step 1: prefix of each request (a chunk from 0 for all).
    first = {"a": 10, "b": 5, "c": 6, "d": 3}
    reqs = [dict(start=0, q=seqs[n][0][:m], k=seqs[n][1][:m], v=seqs[n][2][:m], blocks=blocks[n])
            for n, m in first.items()]
    run_batch(attn, reqs)
    # Step 2: a and b decode (different lengths), c and d continue prefilling mid-block.
    step2 = {"a": (10, 11), "b": (5, 6), "c": (6, 13), "d": (3, 9)}
    reqs = [dict(start=s, q=seqs[n][0][s:e], k=seqs[n][1][s:e], v=seqs[n][2][s:e], blocks=blocks[n])
            for n, (s, e) in step2.items()]
    out, _ = run_batch(attn, reqs)
    expected = torch.cat([dense_reference(seqs[n][0][s:e], seqs[n][1][:e], seqs[n][2][:e], s)
                          for n, (s, e) in step2.items()])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_same_step_prefix_hit_sees_keys_written_in_that_step(attn):
    """B shares A's first two blocks, which A writes in the very call where B reads them."""
    torch.manual_seed(1)
    n_a, shared = 10, 8
    qa, ka, va = torch.randn(n_a, H, D), torch.randn(n_a, KVH, D), torch.randn(n_a, KVH, D)
    tail_q, tail_k, tail_v = torch.randn(3, H, D), torch.randn(3, KVH, D), torch.randn(3, KVH, D)
    reqs = [dict(start=0, q=qa, k=ka, v=va, blocks=[0, 1, 2]),
            dict(start=shared, q=tail_q, k=tail_k, v=tail_v, blocks=[0, 1, 3])]
    out, _ = run_batch(attn, reqs)
    kb = torch.cat([ka[:shared], tail_k])
    vb = torch.cat([va[:shared], tail_v])
    torch.testing.assert_close(out[n_a:], dense_reference(tail_q, kb, vb, shared), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 6], ids=["full", "window"])
@pytest.mark.parametrize("decode_in_place", [True, False], ids=["kernel", "gather"])
def test_a_few_query_tokens_attend_as_decodes_of_their_own_positions(decode_in_place, window):
    """A pass verifying drafts: after a one-token decode, a request of 3 tokens (its last token and two
    drafts) and one of 2 attend as decode rows, each row seeing its request's keys up to its own
    position (the rows after it are written in the same call, not seen), beside a prefill from 0."""
    layer = PagedAttention(H, KVH, D, D ** -0.5, sliding_window=window)
    layer.kv_cache = (torch.zeros(32, BS, KVH, D), torch.zeros(32, BS, KVH, D))
    torch.manual_seed(8)
    seqs = {name: (torch.randn(n, H, D), torch.randn(n, KVH, D), torch.randn(n, KVH, D))
            for name, n in [("a", 15), ("b", 13), ("c", 11), ("d", 11)]}
    blocks = {"a": [7, 3, 20, 11], "b": [1, 30, 14, 15], "c": [4, 5, 6], "d": [9, 8, 12]}
    first = {"a": 14, "b": 10, "c": 9}
    run_batch(layer, [dict(start=0, q=seqs[n][0][:m], k=seqs[n][1][:m], v=seqs[n][2][:m], blocks=blocks[n])
                      for n, m in first.items()], decode_in_place)
    step2 = {"a": (14, 15), "b": (10, 13), "c": (9, 11), "d": (0, 11)}
    reqs = [dict(start=s, q=seqs[n][0][s:e], k=seqs[n][1][s:e], v=seqs[n][2][s:e], blocks=blocks[n])
            for n, (s, e) in step2.items()]
    out, meta = run_batch(layer, reqs, decode_in_place, num_decodes=3)
    expected = torch.cat([dense_reference(seqs[n][0][s:e], seqs[n][1][:e], seqs[n][2][:e], s, window)
                          for n, (s, e) in step2.items()])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert meta.num_decodes == 6 and len(meta.prefills) == 1
    if decode_in_place:
        assert meta.decode_seq_lens.tolist() == [15, 11, 12, 13, 10, 11]
        assert meta.decode_block_table[1:4].tolist() == [[1, 30, 14, 15]] * 3


def _two_steps_of_four_requests(layer: PagedAttention, decode_in_place: bool, seed: int):
    """Prefill a (14 tokens), b (4) and c (9) from 0; then a and b decode, c continues from 9 and d
    (11 tokens) starts, in one call. Returns that call's (out, meta), the requests' q/k/v and the
    second step's (start, end) per request."""
    layer.kv_cache = (torch.zeros(32, BS, KVH, D), torch.zeros(32, BS, KVH, D))
    torch.manual_seed(seed)
    seqs = {name: (torch.randn(n, H, D), torch.randn(n, KVH, D), torch.randn(n, KVH, D))
            for name, n in [("a", 15), ("b", 5), ("c", 18), ("d", 11)]}
    blocks = {"a": [7, 3, 20, 11], "b": [1, 30], "c": [4, 5, 6, 2, 13], "d": [9, 8, 12]}
    first = {"a": 14, "b": 4, "c": 9}
    run_batch(layer, [dict(start=0, q=seqs[n][0][:m], k=seqs[n][1][:m], v=seqs[n][2][:m], blocks=blocks[n])
                      for n, m in first.items()], decode_in_place)
    step2 = {"a": (14, 15), "b": (4, 5), "c": (9, 18), "d": (0, 11)}
    reqs = [dict(start=s, q=seqs[n][0][s:e], k=seqs[n][1][s:e], v=seqs[n][2][s:e], blocks=blocks[n])
            for n, (s, e) in step2.items()]
    out, meta = run_batch(layer, reqs, decode_in_place)
    return out, meta, seqs, step2


@pytest.mark.parametrize("decode_in_place", [True, False], ids=["kernel", "gather"])
def test_sliding_window_attends_the_window_and_reads_only_its_blocks(decode_in_place):
    """Window 6, block size 4: decodes at several depths, a chunk that starts past the window and a
    prefill from 0 longer than the window, in one call, against dense attention with the window's mask.
    The metadata hands the layer only the blocks holding a window's keys."""
    window = 6
    layer = PagedAttention(H, KVH, D, D ** -0.5, sliding_window=window)
    # a and b decode (a at position 14: keys 9..14), c continues from 9 (keys from 4 on), d starts (11 > 6).
    out, meta, seqs, step2 = _two_steps_of_four_requests(layer, decode_in_place, seed=2)
    expected = torch.cat([dense_reference(seqs[n][0][s:e], seqs[n][1][:e], seqs[n][2][:e], s, window)
                          for n, (s, e) in step2.items()])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    full = torch.cat([dense_reference(seqs[n][0][s:e], seqs[n][1][:e], seqs[n][2][:e], s)
                      for n, (s, e) in step2.items()])
    assert not torch.allclose(out, full, atol=1e-3)  # the window changes the result
    c, d = meta.prefills
    assert c.block_ids.tolist() == [5, 6, 2, 13] and c.num_keys == 14  # c's first key is 4: block 0 skipped
    assert d.block_ids.tolist() == [9, 8, 12] and d.mask is not None
    if decode_in_place:
        assert meta.decode_key_starts.tolist() == [9, 0]
    else:  # a's row starts at its block 2 (keys 8..14), b's at block 0
        assert meta.decode_block_table.tolist() == [[20, 11], [1, 30]] and meta.decode_max_seq_len == 7


@pytest.mark.parametrize("tiled", [False, True], ids=["one-tile", "row-tiles"])
@pytest.mark.parametrize("window", [None, 6], ids=["full", "window"])
@pytest.mark.parametrize("decode_in_place", [True, False], ids=["kernel", "gather"])
def test_soft_capped_scores_on_every_path(monkeypatch, decode_in_place, window, tiled):
    """Gemma 2's cap * tanh(score / cap) on the scores: decodes (in C, or gathered) and prefill chunks
    from 0 and from an offset, with and without a window, against dense attention with the cap.
    Scale 1 and cap 2 make the cap bind on most scores. Prefill scores are held a tile of queries at
    a time: here all at once, or (a tiny tile budget) one query row per tile."""
    from gpu_worker.layers import attention

    if tiled:
        monkeypatch.setattr(attention, "_SCORES_PER_TILE", 40)
    layer = PagedAttention(H, KVH, D, 1.0, sliding_window=window, softcap=2.0)
    out, _, seqs, step2 = _two_steps_of_four_requests(layer, decode_in_place, seed=4)

    def expected(softcap):
        return torch.cat([dense_reference(seqs[n][0][s:e], seqs[n][1][:e], seqs[n][2][:e], s, window, 1.0, softcap)
                          for n, (s, e) in step2.items()])

    torch.testing.assert_close(out, expected(2.0), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, expected(None), atol=1e-2)  # the cap changes the result


@pytest.mark.parametrize("tiled", [False, True], ids=["one-tile", "row-tiles"])
@pytest.mark.parametrize("window", [None, 6], ids=["full", "window"])
@pytest.mark.parametrize("decode_in_place", [True, False], ids=["kernel", "gather"])
def test_attention_sinks_on_every_path(monkeypatch, decode_in_place, window, tiled):
    """GPT-OSS's sinks (one more softmax term per head, with no value): decodes (in C, or gathered) and
    prefill chunks from 0 and from an offset, with and without a window, against dense attention with
    the sinks. Each head's sink differs, so a sink given to the wrong head shows."""
    from gpu_worker.layers import attention

    if tiled:
        monkeypatch.setattr(attention, "_SCORES_PER_TILE", 40)
    layer = PagedAttention(H, KVH, D, D ** -0.5, sliding_window=window, sinks=True)
    sinks = torch.tensor([-1.0, 0.5, 2.0, 1.0])
    layer.sinks.copy_(sinks)
    out, _, seqs, step2 = _two_steps_of_four_requests(layer, decode_in_place, seed=6)

    def expected(sinks):
        return torch.cat([dense_reference(seqs[n][0][s:e], seqs[n][1][:e], seqs[n][2][:e], s, window, None, None,
                                          sinks) for n, (s, e) in step2.items()])

    torch.testing.assert_close(out, expected(sinks), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, expected(None), atol=1e-2)  # the sinks change the result
    assert not torch.allclose(out, expected(sinks.flip(0)), atol=1e-2)  # each head its own


@pytest.mark.parametrize("tiled", [False, True], ids=["one-tile", "row-tiles"])
@pytest.mark.parametrize("decode_in_place", [True, False], ids=["kernel", "gather"])
def test_alibi_on_every_path(monkeypatch, decode_in_place, tiled):
    """ALiBi's per-head slopes: decodes at several lengths (in C, or gathered with a padding mask)
    and prefill chunks from 0 and from an offset, against dense attention with BLOOM's bias (slope times
    the key's absolute position). Slopes given to the wrong heads, or none, show."""
    from gpu_worker.layers import attention

    if tiled:
        monkeypatch.setattr(attention, "_SCORES_PER_TILE", 40)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    layer = PagedAttention(H, KVH, D, D ** -0.5, alibi_slopes=slopes)
    out, _, seqs, step2 = _two_steps_of_four_requests(layer, decode_in_place, seed=8)

    def expected(alibi):
        return torch.cat([dense_reference(seqs[n][0][s:e], seqs[n][1][:e], seqs[n][2][:e], s, alibi=alibi)
                          for n, (s, e) in step2.items()])

    torch.testing.assert_close(out, expected(slopes), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, expected(None), atol=1e-2)
    assert not torch.allclose(out, expected(slopes.flip(0)), atol=1e-2)


def test_alibi_slopes_are_bloom_and_mpt_slopes():
    """One formula for every head count: BLOOM's (and Falcon's) builder and MPT's, as transformers
    writes them, head counts of powers of two and not (BLOOM-176B's 112, falcon-rw's 32, 12, 71)."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    from gpu_worker.layers.attention import alibi_slopes

    for heads in (1, 4, 12, 32, 71, 112):
        bloom = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), heads, torch.float32)[:, 0, 1]
        torch.testing.assert_close(alibi_slopes(heads), bloom, atol=0, rtol=1e-6)
        mpt = build_mpt_alibi_tensor(heads, 2)[:, 0, 0]  # (key 0 of 2: -slope)
        torch.testing.assert_close(alibi_slopes(heads), -mpt, atol=0, rtol=1e-6)
    mpt_16 = -build_mpt_alibi_tensor(12, 2, alibi_bias_max=16)[:, 0, 0]
    torch.testing.assert_close(alibi_slopes(12, 16.0), mpt_16, atol=0, rtol=1e-6)
    with pytest.raises(ValueError, match="sliding window"):
        PagedAttention(H, KVH, D, 1.0, sliding_window=6, alibi_slopes=torch.ones(H))


def test_gemma_rmsnorm_and_geglu_match_transformers():
    """Gemma's norm scales by 1 + w in fp32 before casting (bit for bit with transformers' in bf16,
    where Llama's order would differ); GeGLU is gelu (tanh-approximated, or exact) times up."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as HFGemmaRMSNorm

    torch.manual_seed(0)
    hf = HFGemmaRMSNorm(64, eps=1e-6)
    hf.weight.data = torch.randn(64).to(torch.bfloat16)
    hf = hf.to(torch.bfloat16)
    ours = GemmaRMSNorm(64, eps=1e-6)
    ours.weight_loader(ours.weight, hf.weight.data)
    x, res = torch.randn(5, 64).to(torch.bfloat16), torch.randn(5, 64).to(torch.bfloat16)
    assert torch.equal(ours(x), hf(x))
    out, summed = ours(x, res)
    assert torch.equal(summed, x + res) and torch.equal(out, hf(x + res))
    # fp32 takes RMSNorm's fused path, with 1 + w as its weight.
    x32 = x.float()
    torch.testing.assert_close(ours(x32), hf.float()(x32), atol=1e-5, rtol=1e-5)
    gu = torch.randn(3, 16)
    torch.testing.assert_close(gated_activation("gelu_pytorch_tanh")(gu),
                               F.gelu(gu[:, :8], approximate="tanh") * gu[:, 8:])
    torch.testing.assert_close(gated_activation("gelu")(gu), F.gelu(gu[:, :8]) * gu[:, 8:])
    assert not torch.equal(gated_activation("gelu")(gu), gated_activation("gelu_pytorch_tanh")(gu))


def test_metadata_for_a_window_it_was_not_built_for_is_refused():
    layer = PagedAttention(H, KVH, D, D ** -0.5, sliding_window=6)
    layer.kv_cache = (torch.zeros(4, BS, KVH, D), torch.zeros(4, BS, KVH, D))
    meta = build_attention_metadata(np.array([[0, 1]]), np.array([2]), np.array([0, 5]), np.array([0]), 0,
                                    np.arange(5), BS, torch.device("cpu"))
    with pytest.raises(ValueError, match="window None, not for a layer with window 6"):
        layer(torch.randn(5, H, D), torch.randn(5, KVH, D), torch.randn(5, KVH, D), meta)


def test_rotary_matches_transformers():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16, "rope_theta": 10000.0}
    hf_cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters=rope, max_position_embeddings=128)
    hf_rope = LlamaRotaryEmbedding(hf_cfg)
    ours = RotaryEmbedding(16, 128, 10000.0, rope)
    positions = torch.tensor([0, 5, 17, 100, 127])
    x = torch.randn(5, 3, 16)
    cos, sin = hf_rope(x, positions[None])
    ref, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(ours(positions, x.clone()), ref[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


def test_longrope_picks_each_tokens_rows_by_the_sequence_up_to_it():
    """Pretrained length 24, short rows from 256 on: a short prompt's tokens stay short through
    position 23 and go long from 24 (the step whose sequence is 25 long), even within one chunk
    (drafts, a recompute after preemption); a longer prompt's are all long; exactly 24 is short."""
    import numpy as np

    from gpu_worker.layers.rotary import longrope_rows

    chunk = np.arange(20, 28)
    assert longrope_rows(chunk, np.full(8, 10), 256, 24).tolist() == [276, 277, 278, 279, 24, 25, 26, 27]
    assert longrope_rows(np.arange(0, 4), np.full(4, 30), 256, 24).tolist() == [0, 1, 2, 3]
    assert longrope_rows(np.array([23, 24]), np.array([24, 24]), 256, 24).tolist() == [279, 24]


def test_column_and_row_parallel_shards_compose_to_full_linear():
    torch.manual_seed(0)
    x = torch.randn(5, 12)
    w1, b1 = torch.randn(8, 12), torch.randn(8)
    w2, b2 = torch.randn(6, 8), torch.randn(6)
    full = F.linear(F.linear(x, w1, b1), w2, b2)
    partial = []
    for rank in range(2):
        col = ColumnParallelLinear(12, 8, bias=True, tp_rank=rank, tp_size=2)
        col.weight_loader(col.weight, w1)
        col.weight_loader(col.bias, b1)
        row = RowParallelLinear(8, 6, bias=True, tp_rank=rank, tp_size=2)
        row.weight_loader(row.weight, w2)
        row.bias.weight_loader(row.bias, b2)
        partial.append(F.linear(col(x), row.weight))
    # The all-reduce sums the ranks' partial products; the bias is added once, after it.
    torch.testing.assert_close(partial[0] + partial[1] + row.bias, full)
    # Without the reduction here (a MoE block sums routed and shared experts, then reduces once),
    # rank 0 alone adds the bias.
    unreduced = []
    for rank in range(2):
        row = RowParallelLinear(8, 6, bias=True, reduce_results=False, tp_rank=rank, tp_size=2)
        row.weight_loader(row.weight, w2)
        row.bias.weight_loader(row.bias, b2)
        col = ColumnParallelLinear(12, 8, bias=True, tp_rank=rank, tp_size=2)
        col.weight_loader(col.weight, w1)
        col.weight_loader(col.bias, b1)
        unreduced.append(row.forward(col.forward(x)))
    torch.testing.assert_close(unreduced[0] + unreduced[1], full)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_qkv_and_merged_loaders_shard_heads(tp_size):
    torch.manual_seed(0)
    hidden, heads, kv_heads, d = 16, 4, 2, 4
    wq, wk, wv = torch.randn(heads * d, hidden), torch.randn(kv_heads * d, hidden), torch.randn(kv_heads * d, hidden)
    for rank in range(tp_size):
        qkv = QKVParallelLinear(hidden, d, heads, kv_heads, tp_rank=rank, tp_size=tp_size)
        for shard, w in (("q", wq), ("k", wk), ("v", wv)):
            qkv.weight_loader(qkv.weight, w, shard)
        q, k, v = qkv.weight.split([qkv.q_size, qkv.kv_size, qkv.kv_size])
        q_heads = heads // tp_size
        torch.testing.assert_close(q, wq[rank * q_heads * d:(rank + 1) * q_heads * d])
        # With more ranks than KV heads, each rank holds the KV head its query heads use.
        kv_head = (rank * q_heads) // (heads // kv_heads)
        assert qkv.num_kv_heads == max(1, kv_heads // tp_size)
        torch.testing.assert_close(k[:d], wk[kv_head * d:(kv_head + 1) * d])
        torch.testing.assert_close(v[:d], wv[kv_head * d:(kv_head + 1) * d])
    wg, wu = torch.randn(8, hidden), torch.randn(8, hidden)
    merged = MergedColumnParallelLinear(hidden, [8, 8], tp_rank=tp_size - 1, tp_size=tp_size)
    merged.weight_loader(merged.weight, wg, 0)
    merged.weight_loader(merged.weight, wu, 1)
    n = 8 // tp_size
    torch.testing.assert_close(merged.weight, torch.cat([wg[-n:], wu[-n:]]))


def test_vocab_parallel_embedding_and_head_shards():
    """Ranks built with tp_size=2 in one process (collectives are no-ops here): summing their
    embeddings and concatenating their logits must give the unsharded results."""
    torch.manual_seed(0)
    table = torch.randn(11, 4)  # 11 rows over 2 ranks: padded to 12
    ids = torch.tensor([0, 5, 6, 10])
    hidden = torch.randn(2, 4)
    embedded, logits = [], []
    for rank in range(2):
        emb = VocabParallelEmbedding(11, 4, tp_rank=rank, tp_size=2)
        emb.weight_loader(emb.weight, table)
        embedded.append(emb(ids))
        head = ParallelLMHead(11, 4, tp_rank=rank, tp_size=2)
        head.tie_to(emb)
        assert head.weight is emb.weight
        logits.append(F.linear(hidden, head.weight))
    torch.testing.assert_close(embedded[0] + embedded[1], F.embedding(ids, table))
    torch.testing.assert_close(torch.cat(logits, -1)[:, :11], F.linear(hidden, table))


def test_rmsnorm_residual_and_swiglu():
    torch.manual_seed(0)
    norm = RMSNorm(8, eps=1e-5)
    norm.weight.data = torch.randn(8)
    x, res = torch.randn(3, 8), torch.randn(3, 8)
    out, new_res = norm(x, res)
    s = x + res
    torch.testing.assert_close(new_res, s)
    torch.testing.assert_close(out, norm.weight * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5))
    # bf16 takes the HF-ordered path (statistics in fp32).
    out_bf16 = norm.to(torch.bfloat16)(s.to(torch.bfloat16))
    torch.testing.assert_close(out_bf16.float(), out, atol=0.05, rtol=0.05)
    gu = torch.randn(3, 16)
    torch.testing.assert_close(SiluAndMul()(gu), F.silu(gu[:, :8]) * gu[:, 8:])
