"""--kv-cache-dtype: K/V stored in fp8 (one byte per element) or bf16, written by the attention layer,
read back by the CPU decode kernel and by the gather path, sized by the worker."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

import gpu_worker.layers.attention as attention
from engine_core.config import KV_CACHE_DTYPE_NAMES
from gpu_worker.cpu_kernels import cpu_kernels_available, fp8_byte_value, paged_decode_attention
from gpu_worker.kv_cache import KV_CACHE_DTYPES, resolve_kv_cache_dtype, store_kv
from gpu_worker.worker import Worker
from tests.gpu_worker.utils import greedy_request, make_scheduler, run_to_completion, save_tiny_model

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
needs_kernels = pytest.mark.skipif(not cpu_kernels_available(), reason="no C compiler for the CPU kernels")


def test_names_resolve_as_vllms_flag():
    assert tuple(KV_CACHE_DTYPES) == KV_CACHE_DTYPE_NAMES  # the workers map every name the config takes
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.float32) is torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16) is torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16) is torch.float8_e5m2
    assert resolve_kv_cache_dtype("bfloat16", torch.float32) is torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        resolve_kv_cache_dtype("int8", torch.float32)


@pytest.mark.parametrize("dtype", FP8)
def test_writes_convert_and_saturate_and_the_gather_widens(dtype):
    torch.manual_seed(0)
    cache = torch.zeros(6, 4, 2, 8, dtype=dtype)  # 6 blocks of 4 slots, 2 KV heads of 8 dims
    x = torch.randn(5, 2, 8) * 4
    x[0, 0, 0], x[1, 1, 3] = 1e6, -1e6  # beyond the format's range: stored as its largest finite value
    slots = torch.tensor([5, 0, 17, 18, 3])
    store_kv(cache, slots, x)
    limit = torch.finfo(dtype).max
    stored = cache.view(-1, 2, 8).float()
    assert torch.equal(stored[slots], x.clamp(-limit, limit).to(dtype).float())
    assert stored[5, 0, 0] == limit and stored[0, 1, 3] == -limit
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[slots] = False
    assert not stored[untouched].any()
    # Blocks 1 and 0 (slots 4..7, then 0..3), the first 6 positions, as [num_kv_heads, 6, head_dim].
    gathered = attention.gather_kv(cache, torch.tensor([1, 0]), 6, torch.float32)
    assert gathered.dtype == torch.float32
    assert torch.equal(gathered, stored.view(6, 4, 2, 8)[[1, 0]].reshape(8, 2, 8)[:6].transpose(0, 1))


@needs_kernels
@pytest.mark.parametrize("dtype", FP8)
def test_the_decode_kernel_reads_every_fp8_byte_as_torch_does(dtype):
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float().tolist()
    finite = [b for b in range(256) if math.isfinite(values[b])]
    assert len(finite) == (254 if dtype == torch.float8_e4m3fn else 248)
    assert [fp8_byte_value(b, dtype) for b in finite] == [values[b] for b in finite]
    # inf and NaN (only an inf or NaN activation writes them: finite values saturate) stay so.
    for b in set(range(256)) - set(finite):
        got = fp8_byte_value(b, dtype)
        assert (math.isnan(got) and math.isnan(values[b])) or got == values[b], (b, got, values[b])


@needs_kernels
@pytest.mark.parametrize("num_reqs", [4, 1], ids=["per-request", "per-kv-head"])
@pytest.mark.parametrize("dtype", FP8)
def test_the_decode_kernel_on_an_fp8_cache_equals_sdpa_on_the_widened_cache(dtype, num_reqs):
    """With fewer requests than threads the kernel splits each request by KV head (its other layout
    of the fp8 rows it widens): both layouts, against SDPA on the widened cache."""
    torch.manual_seed(1)
    num_blocks, block_size, num_kv_heads, head_dim, num_heads = 24, 4, 2, 16, 6
    group = num_heads // num_kv_heads
    k = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim) * 3).to(dtype)
    v = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    q = torch.randn(num_reqs, num_heads, head_dim)
    table = torch.stack([torch.randperm(num_blocks)[:6] for _ in range(num_reqs)])
    seq_lens = torch.tensor([23, 1, 7, 16][:num_reqs])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # more threads than requests when num_reqs is 1
    try:
        out = paged_decode_attention(q, k, v, table, seq_lens, 0.25)
    finally:
        torch.set_num_threads(threads)
    for r in range(num_reqs):
        n = int(seq_lens[r])
        kr = k[table[r]].float().reshape(-1, num_kv_heads, head_dim)[:n].repeat_interleave(group, dim=1)
        vr = v[table[r]].float().reshape(-1, num_kv_heads, head_dim)[:n].repeat_interleave(group, dim=1)
        ref = F.scaled_dot_product_attention(q[r].unsqueeze(1), kr.transpose(0, 1), vr.transpose(0, 1), scale=0.25)
        torch.testing.assert_close(out[r], ref.squeeze(1), rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="float32 or fp8"):
        paged_decode_attention(q, k.float().to(torch.bfloat16), v.float().to(torch.bfloat16), table, seq_lens, 0.25)


def _answers(path, kv_cache_dtype, decode_in_place, requests, num_blocks=14, budget=12):
    worker = Worker(0, 1, str(path), device="cpu", dtype="float32", max_model_len=128, num_cpus=1,
                    kv_cache_dtype=kv_cache_dtype)
    worker.load_model()
    worker.initialize_cache(num_blocks, 4)
    runner = worker.runner
    if decode_in_place and not runner.decode_in_place:
        assert not cpu_kernels_available(), "the runner chose the gather path although the kernel applies"
        pytest.skip("no C compiler for the CPU kernels")
    runner.decode_in_place = decode_in_place
    # A small pool and budget: chunked prefills, prefix hits and recompute after preemption all
    # read the cache back.
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget)
    for rid, prompt, max_tokens in requests:
        sched.add_request(greedy_request(rid, prompt, max_tokens))
    seen = {"preempted": 0, "prefix_hits": 0}

    def on_step(_, so):
        seen["preempted"] += len(so.preempted_req_ids)
        seen["prefix_hits"] += sum(1 for new in so.scheduled_new_reqs if new.num_computed_tokens)

    answers = run_to_completion(sched, worker.execute_model, max_steps=3000, on_step=on_step)
    assert seen["preempted"] and seen["prefix_hits"], seen
    return answers, runner


@pytest.mark.parametrize(("name", "decode_in_place", "kind"), [
    ("fp8", True, "llama"), ("fp8", False, "llama"), ("fp8_e5m2", True, "llama"), ("fp8_e5m2", False, "llama"),
    ("bfloat16", False, "llama"),  # the CPU kernel reads fp32 and fp8 caches only: bf16 decodes gather
    ("fp8", True, "glm_moe_dsa"), ("fp8", False, "glm_moe_dsa"),
], ids=["fp8-kernel", "fp8-gather", "fp8_e5m2-kernel", "fp8_e5m2-gather", "bfloat16-gather",
        "fp8-kernel-sparse-attention", "fp8-gather-sparse-attention"])
def test_a_narrow_cache_answers_as_full_precision_attention_over_rounded_keys_and_values(
        tmp_path, monkeypatch, name, decode_in_place, kind):
    """The engine with a narrow cache (fp8 bytes or bf16, widened on read) against a reference that
    keeps an fp32 cache and only rounds what it stores through that dtype: the same greedy tokens,
    while plain fp32 answers differ under fp8 (so the rounding really happens). GLM-5's DeepSeek Sparse
    Attention too: its indexer scores the rounded keys it reads back."""
    path = save_tiny_model(tmp_path, kind)
    rng = random.Random(3)
    shared = [rng.randrange(256) for _ in range(9)]
    requests = [(f"r{i}", (shared if i % 2 else []) + [rng.randrange(256) for _ in range(rng.randrange(2, 20))],
                 rng.randrange(4, 24)) for i in range(6)]
    got, runner = _answers(path, name, decode_in_place, requests)
    narrow = KV_CACHE_DTYPES[name]
    assert all(k.dtype == narrow and v.dtype == narrow for k, v in runner.kv_caches)
    plain, _ = _answers(path, "auto", decode_in_place, requests)

    def store_rounded(cache, slot_mapping, x):
        limit = torch.finfo(narrow).max
        store_kv(cache, slot_mapping, x.clamp(-limit, limit).to(narrow).to(x.dtype))

    monkeypatch.setattr(attention, "store_kv", store_rounded)
    reference, ref_runner = _answers(path, "auto", decode_in_place, requests)
    assert ref_runner.kv_caches[0][0].dtype == torch.float32
    assert got == reference
    if narrow in FP8:
        assert got != plain


def test_the_worker_sizes_blocks_by_the_cache_dtype(tmp_path):
    path = save_tiny_model(tmp_path)
    per_block = {}
    for name in ("auto", "bfloat16", "fp8", "fp8_e5m2"):
        worker = Worker(0, 1, str(path), device="cpu", dtype="float32", max_model_len=128, num_cpus=1,
                        kv_cache_dtype=name)
        per_block[name] = worker.bytes_per_block(4)
        if name == "fp8":
            worker.load_model()
            budget = per_block["auto"] * 10  # ten fp32 blocks' worth of memory
            assert worker.determine_num_blocks(4, kv_cache_memory_bytes=budget) == 40
            worker.initialize_cache(40, 4)
            assert sum(k.nbytes + v.nbytes for k, v in worker.runner.kv_caches) == per_block["fp8"] * 40
    assert per_block["auto"] == 2 * per_block["bfloat16"] == 4 * per_block["fp8"] == 4 * per_block["fp8_e5m2"]
