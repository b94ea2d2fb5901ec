"""Soft-capped decode attention (Gemma 2) against the same attention without the cap, in one run.

Gemma 2 caps its attention scores (cap * tanh(score / cap)) before the softmax, which SDPA cannot
do, so its layers take our own paths: ``eager_attention`` in torch (bf16 on the CPU, and CUDA)
and the CPU decode kernel (fp32). Each is timed beside the uncapped attention it replaces on the
same queries, keys and values (SDPA for torch, the kernel without a cap), so the ratio is the price
of the cap; the two answers are also compared with a float64 reference.

    .venv/bin/python benchmarks/bench_softcap_attention.py
    .venv/bin/python benchmarks/bench_softcap_attention.py --requests 32 --keys 4096 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from gpu_worker.cpu_kernels import cpu_kernels_available, paged_decode_attention
from gpu_worker.layers.attention import eager_attention


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def _reference(q, k, v, scale, cap):
    scores = torch.einsum("bkgd,bknd->bkgn", q.double(), k.double()) * scale
    scores = torch.tanh(scores / cap) * cap
    return torch.einsum("bkgn,bknd->bkgd", scores.softmax(-1), v.double())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--keys", type=int, default=2048, help="keys each request attends (its sequence length)")
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--groups", type=int, default=2, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--cap", type=float, default=50.0)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    b, kvh, g, n, d = args.requests, args.kv_heads, args.groups, args.keys, args.head_dim
    scale = d ** -0.5
    q = torch.randn(b, kvh, g, d, dtype=dtype) * 4
    k = torch.randn(b, kvh, n, d, dtype=dtype)
    v = torch.randn(b, kvh, n, d, dtype=dtype)
    print(f"requests={b} keys={n} kv_heads={kvh} groups={g} head_dim={d} dtype={args.dtype} cap={args.cap} "
          f"threads={torch.get_num_threads()}")
    reference = _reference(q, k, v, scale, args.cap)

    capped = eager_attention(q, k, v, None, scale, args.cap)
    plain_ms = _median_ms(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale), args.repeats)
    capped_ms = _median_ms(lambda: eager_attention(q, k, v, None, scale, args.cap), args.repeats)
    error = (capped.double() - reference).abs().max().item()
    print(f"torch   | SDPA, no cap {plain_ms:8.2f} ms | eager_attention {capped_ms:8.2f} ms | "
          f"ratio {capped_ms / plain_ms:5.2f}x | max error vs float64 {error:.2e}")

    if not cpu_kernels_available():
        print("C kernel | not available (no C compiler)")
        return
    # The kernel's layout: one block of `keys` slots per request, fp32.
    qk = q.float().reshape(b, kvh * g, d)
    kc = k.float().transpose(1, 2).contiguous()  # [b, n, kvh, d]: request r's keys are block r
    vc = v.float().transpose(1, 2).contiguous()
    table = torch.arange(b, dtype=torch.int64).view(b, 1)
    lens = torch.full((b,), n, dtype=torch.int64)
    out = paged_decode_attention(qk, kc, vc, table, lens, scale, softcap=args.cap)
    plain_ms = _median_ms(lambda: paged_decode_attention(qk, kc, vc, table, lens, scale), args.repeats)
    capped_ms = _median_ms(lambda: paged_decode_attention(qk, kc, vc, table, lens, scale, softcap=args.cap),
                           args.repeats)
    error = (out.double().view(b, kvh, g, d) - reference).abs().max().item()
    print(f"C kernel| no cap       {plain_ms:8.2f} ms | capped               {capped_ms:8.2f} ms | "
          f"ratio {capped_ms / plain_ms:5.2f}x | max error vs float64 {error:.2e} (fp32 of {args.dtype} inputs)")


if __name__ == "__main__":
    main()
