"""The CPU kernels against float64 references: decode attention over gathered keys/values, and the
fused residual add + RMSNorm."""

from __future__ import annotations

import pytest
import torch

from gpu_worker import cpu_kernels
from gpu_worker.cpu_kernels import add_rms_norm, cpu_kernels_available, paged_decode_attention
from gpu_worker.layers.layernorm import RMSNorm


def reference(q, k_cache, v_cache, block_table, seq_lens, scale, key_starts=None, softcap=None, sinks=None,
              alibi=None):
    """Per request: gather its keys/values token by token (from its key start), repeat KV heads,
    softmax(q k^T) v (the scores capped at softcap * tanh(score / softcap) where given; each head's
    softmax with one more term, exp(sink), where ``sinks`` [H] are given; each score plus its head's
    slope times the key's position, where ALiBi slopes [H] are given: softmax is unmoved by the
    query's own position, the same for every key)."""
    num_reqs, num_heads, _ = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for r in range(num_reqs):
        n = int(seq_lens[r])
        pos = torch.arange(0 if key_starts is None else int(key_starts[r]), n)
        blocks = block_table[r, pos // block_size]
        k = k_cache[blocks, pos % block_size].repeat_interleave(num_heads // num_kv_heads, dim=1)  # [n, H, D]
        v = v_cache[blocks, pos % block_size].repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[r].double(), k.double()) * scale
        if alibi is not None:
            scores = scores + alibi.double()[:, None] * pos.double()[None, :]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if sinks is None:
            w = torch.softmax(scores, dim=-1)
        else:
            w = scores.exp() / (scores.exp().sum(-1, keepdim=True) + sinks.double().exp()[:, None])
        out[r] = torch.einsum("hn,nhd->hd", w, v.double()).float()
    return out


def random_case(num_reqs, num_heads, num_kv_heads, head_dim, block_size, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(lens) // block_size) + 1  # one spare column: rows are padded like the runner's
    num_blocks = num_reqs * max_blocks + 3
    k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    table = torch.randperm(num_blocks, generator=g)[: num_reqs * max_blocks].view(num_reqs, max_blocks).contiguous()
    q = torch.randn(num_reqs, num_heads, head_dim, generator=g)
    return q, k, v, table, torch.tensor(lens, dtype=torch.int64)


def test_kernel_builds_here():
    # CI machines have a C compiler; losing the kernel silently would lose most of the decode speed-up.
    assert cpu_kernels_available()


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size", "lens"), [
    (4, 4, 16, 4, [1, 5, 8, 13]),            # multi-head, lengths inside, at and past block edges
    (9, 3, 64, 16, [512, 475, 17, 1, 300]),  # SmolLM2's shape (grouped-query, 3 per KV head)
    (8, 1, 32, 8, [33, 7]),                  # multi-query
    (6, 2, 24, 5, [29, 30, 31]),             # head_dim and block size that are not powers of two
])
def test_matches_reference(num_heads, num_kv_heads, head_dim, block_size, lens):
    q, k, v, table, seq_lens = random_case(len(lens), num_heads, num_kv_heads, head_dim, block_size, lens)
    scale = head_dim ** -0.5
    got = paged_decode_attention(q, k, v, table, seq_lens, scale)
    torch.testing.assert_close(got, reference(q, k, v, table, seq_lens, scale), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("cache", ["float32", "fp8"])
def test_soft_capped_scores_match_reference(cache):
    """Gemma 2's soft cap, in C: large scores (queries scaled up) are where the cap changes the answer."""
    q, k, v, table, seq_lens = random_case(3, 8, 2, 16, 4, [9, 23, 4], seed=5)
    q = q * 4
    key_starts = torch.tensor([0, 15, 1], dtype=torch.int64)
    if cache == "fp8":
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    ref_k, ref_v = k.float(), v.float()
    got = paged_decode_attention(q, k, v, table, seq_lens, 0.25, key_starts, softcap=2.0)
    torch.testing.assert_close(got, reference(q, ref_k, ref_v, table, seq_lens, 0.25, key_starts, softcap=2.0),
                               atol=2e-5, rtol=1e-4)
    uncapped = reference(q, ref_k, ref_v, table, seq_lens, 0.25, key_starts)
    assert (got - uncapped).abs().max() > 0.05


@pytest.mark.parametrize("cache", ["float32", "fp8"])
def test_attention_sinks_match_reference(cache):
    """GPT-OSS's sinks, in C: each head's softmax starts from its sink (large and small against the
    scores), with key starts (a window) and a one-key request."""
    q, k, v, table, seq_lens = random_case(3, 8, 2, 16, 4, [9, 23, 1], seed=7)
    key_starts = torch.tensor([0, 15, 0], dtype=torch.int64)
    sinks = torch.linspace(-3.0, 4.0, 8)
    if cache == "fp8":
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    ref_k, ref_v = k.float(), v.float()
    got = paged_decode_attention(q, k, v, table, seq_lens, 0.25, key_starts, sinks=sinks)
    torch.testing.assert_close(got, reference(q, ref_k, ref_v, table, seq_lens, 0.25, key_starts, sinks=sinks),
                               atol=2e-5, rtol=1e-4)
    unsunk = reference(q, ref_k, ref_v, table, seq_lens, 0.25, key_starts)
    assert (got - unsunk).abs().max() > 0.05
    with pytest.raises(ValueError, match="sinks"):
        paged_decode_attention(q, k, v, table, seq_lens, 0.25, key_starts, sinks=sinks[:4])


@pytest.mark.parametrize("cache", ["float32", "fp8"])
def test_alibi_biases_match_reference(cache):
    """ALiBi's slopes, in C: each score gains its head's slope times the key's distance behind the
    query, over lengths crossing blocks, with key starts and a one-key request; slopes given to the wrong
    heads show."""
    from gpu_worker.layers.attention import alibi_slopes

    q, k, v, table, seq_lens = random_case(4, 8, 2, 16, 4, [9, 23, 1, 40], seed=9)
    key_starts = torch.tensor([0, 15, 0, 3], dtype=torch.int64)
    slopes = alibi_slopes(8)
    if cache == "fp8":
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    ref_k, ref_v = k.float(), v.float()
    got = paged_decode_attention(q, k, v, table, seq_lens, 0.25, key_starts, alibi_slopes=slopes)
    torch.testing.assert_close(got, reference(q, ref_k, ref_v, table, seq_lens, 0.25, key_starts, alibi=slopes),
                               atol=2e-5, rtol=1e-4)
    for other in (None, slopes.flip(0)):
        assert (got - reference(q, ref_k, ref_v, table, seq_lens, 0.25, key_starts, alibi=other)).abs().max() > 0.05
    with pytest.raises(ValueError, match="alibi_slopes"):
        paged_decode_attention(q, k, v, table, seq_lens, 0.25, key_starts, alibi_slopes=slopes[:4])


def test_non_contiguous_query_and_thread_counts():
    q, k, v, table, seq_lens = random_case(5, 6, 2, 16, 4, [3, 9, 16, 17, 40], seed=3)
    wide = torch.randn(5, 6, 48)
    wide[:, :, 8:24] = q
    strided = wide[:, :, 8:24]  # a view, like q sliced from a fused QKV projection
    assert not strided.is_contiguous()
    expected = reference(q, k, v, table, seq_lens, 0.25)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            torch.testing.assert_close(paged_decode_attention(strided, k, v, table, seq_lens, 0.25), expected,
                                       atol=2e-5, rtol=1e-4)
    finally:
        torch.set_num_threads(before)


def test_only_the_listed_blocks_are_read():
    q, k, v, table, seq_lens = random_case(2, 4, 2, 8, 4, [6, 10], seed=5)
    got = paged_decode_attention(q, k, v, table, seq_lens, 0.3)
    used = {int(b) for r, n in enumerate(seq_lens.tolist()) for b in table[r, : -(-n // 4)]}
    k2, v2 = k.clone(), v.clone()
    for b in set(range(k.shape[0])) - used:
        k2[b] = float("nan")
        v2[b] = float("nan")
    # Slots past seq_len inside a used block must not be read either.
    k2[table[0, 1], 2:] = float("nan")
    v2[table[0, 1], 2:] = float("nan")
    torch.testing.assert_close(paged_decode_attention(q, k2, v2, table, seq_lens, 0.3), got)


@pytest.mark.parametrize(("block_size", "lens", "starts"), [
    (4, [13, 9, 30, 5], [6, 8, 27, 0]),  # a start mid-block, at a block's last key, one key, none skipped
    (16, [512, 300, 17], [400, 256, 16]),  # block-aligned starts, a sliding window of 112
])
def test_key_starts_attend_only_the_window(block_size, lens, starts):
    """A sliding window: each request attends keys key_start..seq_len-1; the blocks before its start
    are not read (poisoned with NaN here), nor the slots before the start in the first block read."""
    q, k, v, table, seq_lens = random_case(len(lens), 6, 2, 16, block_size, lens, seed=7)
    key_starts = torch.tensor(starts, dtype=torch.int64)
    expected = reference(q, k, v, table, seq_lens, 0.25, key_starts)
    k2, v2 = k.clone(), v.clone()
    for r, start in enumerate(starts):
        for b in range(start // block_size):
            k2[table[r, b]] = float("nan")
            v2[table[r, b]] = float("nan")
        k2[table[r, start // block_size], : start % block_size] = float("nan")
        v2[table[r, start // block_size], : start % block_size] = float("nan")
    torch.testing.assert_close(paged_decode_attention(q, k2, v2, table, seq_lens, 0.25, key_starts), expected,
                               atol=2e-5, rtol=1e-4)
    # The window matters: attending every key gives other values.
    assert not torch.allclose(paged_decode_attention(q, k, v, table, seq_lens, 0.25), expected, atol=1e-3)


def test_key_starts_on_an_fp8_cache():
    q, k, v, table, seq_lens = random_case(3, 4, 2, 8, 4, [10, 17, 6], seed=9)
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    key_starts = torch.tensor([3, 12, 0], dtype=torch.int64)
    expected = reference(q, k8.float(), v8.float(), table, seq_lens, 0.3, key_starts)
    torch.testing.assert_close(paged_decode_attention(q, k8, v8, table, seq_lens, 0.3, key_starts), expected,
                               atol=2e-5, rtol=1e-4)


def test_rejects_what_it_cannot_handle():
    q, k, v, table, seq_lens = random_case(2, 4, 2, 8, 4, [6, 10])
    with pytest.raises(TypeError, match="float32"):
        paged_decode_attention(q.double(), k, v, table, seq_lens, 0.3)
    with pytest.raises(TypeError, match="int64"):
        paged_decode_attention(q, k, v, table.int(), seq_lens, 0.3)
    with pytest.raises(ValueError, match="longer than its block table"):
        paged_decode_attention(q, k, v, table[:, :1], seq_lens, 0.3)
    with pytest.raises(RuntimeError, match="status 3"):
        paged_decode_attention(q, k, v, table, torch.tensor([0, 4]), 0.3)
    with pytest.raises(ValueError, match="key start"):  # a start at (or past) the sequence's end
        paged_decode_attention(q, k, v, table, seq_lens, 0.3, torch.tensor([2, 10]))
    with pytest.raises(ValueError, match="key start"):
        paged_decode_attention(q, k, v, table, seq_lens, 0.3, torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match=r"key_starts must be \[num_reqs\]"):
        paged_decode_attention(q, k, v, table, seq_lens, 0.3, torch.tensor([0]))


def test_switch_off_leaves_the_gather_path(monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    cpu_kernels._load_library.cache_clear()
    try:
        assert not cpu_kernels_available()
    finally:
        monkeypatch.delenv(cpu_kernels.ENV_SWITCH)
        cpu_kernels._load_library.cache_clear()
    assert cpu_kernels_available()


def test_an_unusable_cache_dir_falls_back_to_the_temp_dir(monkeypatch, tmp_path):
    # A cache root below a regular file cannot be created, whoever runs this (root included).
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("LLM_CLUSTER_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(cpu_kernels.tempfile, "gettempdir", lambda: str(scratch))
    cpu_kernels._load_library.cache_clear()
    try:
        assert cpu_kernels_available()
        assert list((scratch / "llm-cluster-kernels").glob("llmc-kernels-*.so"))
    finally:
        cpu_kernels._load_library.cache_clear()


@pytest.mark.parametrize("rows", [1, 3, 8, 700])  # 700 x 576 rows go through the OpenMP split
@pytest.mark.parametrize("cols", [64, 100, 576])
@pytest.mark.parametrize("threads", [1, 2])
def test_add_rms_norm_matches_the_definition(rows, cols, threads):
    g = torch.Generator().manual_seed(rows * cols)
    x, residual = torch.randn(rows, cols, generator=g), torch.randn(rows, cols, generator=g) * 3
    weight = torch.randn(cols, generator=g)

    def definition(v):
        v = v.double()
        return (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()).float()

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        normed, summed = add_rms_norm(x, weight, 1e-5, residual)
        alone, none = add_rms_norm(x, weight, 1e-5)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(summed, x + residual) and none is None
    torch.testing.assert_close(normed, definition(x + residual), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(alone, definition(x), rtol=1e-5, atol=1e-5)


def test_rms_norm_module_takes_the_kernel_only_where_it_applies():
    norm = RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 32))
    x, residual = torch.randn(4, 32), torch.randn(4, 32)
    fused, summed = norm(x, residual)  # CPU fp32: the kernel
    torch.testing.assert_close(fused, torch.nn.functional.rms_norm(x + residual, (32,), norm.weight, 1e-6))
    assert torch.equal(summed, x + residual)
    strided = torch.randn(32, 4).t()  # not contiguous: the torch path, same result
    torch.testing.assert_close(norm(strided), torch.nn.functional.rms_norm(strided, (32,), norm.weight, 1e-6))
    bf16 = norm.to(torch.bfloat16)(x.bfloat16())
    assert bf16.dtype == torch.bfloat16


def test_add_rms_norm_rejects_what_it_cannot_handle():
    x, weight = torch.randn(2, 8), torch.ones(8)
    with pytest.raises(TypeError, match="float32"):
        add_rms_norm(x.double(), weight, 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        add_rms_norm(torch.randn(8, 2).t(), weight, 1e-6)
    with pytest.raises(ValueError, match="does not match"):
        add_rms_norm(x, weight, 1e-6, torch.randn(1, 8))
