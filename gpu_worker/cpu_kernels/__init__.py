"""Small C kernels for the CPU path, compiled on first use with the machine's C compiler.

Only what torch cannot do well on the CPU lives here: decode attention that reads the paged KV
cache in place (torch needs a gather that copies every request's blocks per layer per step), and
RMSNorm with the residual add fused in (torch's dispatch costs more than the arithmetic on the few
rows of a decode step).

The shared library is built with ``-march=native``, so it is cached per CPU: the cache key covers
the source, the flags, the compiler and the CPU's feature flags. Building takes well under a
second; concurrent builders (Ray workers starting together) each write a private temp file and
rename it into place. When no compiler is found, or ``LLM_CLUSTER_CPU_KERNELS=0``, callers get
``None`` and keep the pure-torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from gpu_worker.gguf_loader import default_cache_root
from gpu_worker.kv_cache import FP8_DTYPES

logger = logging.getLogger(__name__)

_SOURCES = tuple(Path(__file__).with_name(name) for name in ("paged_decode_attention.c", "rms_norm.c"))
_CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared")
ENV_SWITCH = "LLM_CLUSTER_CPU_KERNELS"

DecodeAttentionFn = Callable[..., torch.Tensor]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _library_name(compiler: str) -> str:
    key = hashlib.blake2b(digest_size=12)
    for part in (*(source.read_bytes() for source in _SOURCES), " ".join(_CFLAGS).encode(), compiler.encode(),
                 platform.machine().encode(), _cpu_flags().encode()):
        key.update(part)
        key.update(b"\0")
    return f"llmc-kernels-{key.hexdigest()}.so"


def _writable_dirs() -> list[Path]:
    # The user cache first; a read-only home (some containers) falls back to the temp dir.
    return [default_cache_root() / "kernels", Path(tempfile.gettempdir()) / "llm-cluster-kernels"]


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        result = subprocess.run([compiler, *_CFLAGS, "-o", tmp, *map(str, _SOURCES), "-lm"],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[:2000]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def _load_library() -> ctypes.CDLL | None:
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        logger.info("CPU kernels disabled by %s", ENV_SWITCH)
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: CPU decode attention uses the slower gather path")
        return None
    name = _library_name(compiler)
    lib = None
    for directory in _writable_dirs():
        target = directory / name
        try:
            if not target.exists():
                _build(compiler, target)
            # torch is imported (above) before this load, so libgomp resolves to torch's copy.
            lib = ctypes.CDLL(str(target))
            break
        except OSError as exc:  # not writable (read-only home), or not a directory
            logger.info("cannot build or load the kernel in %s (%s): trying the next place", directory, exc)
        except (RuntimeError, subprocess.SubprocessError) as exc:
            logger.warning("could not build the CPU attention kernel (%s): using the gather path", exc)
            return None
    if lib is None:
        logger.warning("nowhere writable to build the CPU attention kernel: using the gather path")
        return None
    fn = lib.llmc_paged_decode_attention_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_float,
                   ptr, ptr, ctypes.c_int]
    fn.restype = ctypes.c_int
    fn8 = lib.llmc_paged_decode_attention_fp8
    fn8.argtypes = [ptr, ptr, ptr, ctypes.c_int, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float,
                    ctypes.c_float, ptr, ptr, ctypes.c_int]
    fn8.restype = ctypes.c_int
    lib.llmc_fp8_to_float.argtypes = [ctypes.c_uint8, ctypes.c_int]
    lib.llmc_fp8_to_float.restype = ctypes.c_float
    norm = lib.llmc_add_rms_norm_f32
    norm.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int]
    norm.restype = None
    return lib


def cpu_kernels_available() -> bool:
    """Whether this process has the kernels (built or loaded); without, callers keep torch's path."""
    return _load_library() is not None


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           key_starts: torch.Tensor | None = None, softcap: float | None = None,
                           sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None
                           ) -> torch.Tensor:
    """One query token per request against its paged keys/values, read where they lie.

    q: [num_reqs, num_heads, head_dim] fp32; k_cache/v_cache: [num_blocks, block_size, num_kv_heads,
    head_dim] fp32, or both fp8 (e4m3 or e5m2, widened in C);
    block_table: [num_reqs, >= ceil(max(seq_lens) / block_size)] int64; seq_lens:
    [num_reqs] int64; key_starts: [num_reqs] int64 first key of each request (a sliding window's
    start; None: 0), whose earlier blocks are not read; softcap: scores become softcap * tanh(score /
    softcap) before the softmax (Gemma 2); sinks: [num_heads] fp32 attention sinks (GPT-OSS: one more
    logit in each head's softmax, with no value); alibi_slopes: [num_heads] fp32 ALiBi slopes (each
    score gains slope * (key position - the query's), after the scale). Returns [num_reqs, num_heads,
    head_dim].
    """
    if _load_library() is None:
        raise RuntimeError("the CPU paged attention kernel is not available")
    if q.dtype != torch.float32 or q.device.type != "cpu":
        raise TypeError(f"q must be a float32 CPU tensor, got {q.dtype} on {q.device}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in (torch.float32, *FP8_DTYPES) or t.dtype != k_cache.dtype or t.device.type != "cpu":
            raise TypeError(f"{name} must be a float32 or fp8 CPU tensor (both caches alike), "
                            f"got {t.dtype} on {t.device}")
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens), ("key_starts", key_starts)):
        if t is not None and (t.dtype != torch.int64 or t.device.type != "cpu"):
            raise TypeError(f"{name} must be an int64 CPU tensor, got {t.dtype} on {t.device}")
    num_reqs, _, head_dim = q.shape
    if k_cache.shape[-1] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError("q, k_cache and v_cache disagree on head_dim or shape")
    if block_table.dim() != 2 or block_table.shape[0] != num_reqs or seq_lens.shape != (num_reqs,):
        raise ValueError("block_table must be [num_reqs, max_blocks] and seq_lens [num_reqs]")
    if key_starts is not None and key_starts.shape != (num_reqs,):
        raise ValueError("key_starts must be [num_reqs]")
    for name, t in (("sinks", sinks), ("alibi_slopes", alibi_slopes)):
        if t is not None and (t.dtype != torch.float32 or t.shape != (q.shape[1],)):
            raise ValueError(f"{name} must be float32 [num_heads]")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache must be contiguous")
    return paged_decode_attention_unchecked(q, k_cache, v_cache, block_table.contiguous(), seq_lens.contiguous(),
                                            scale, None if key_starts is None else key_starts.contiguous(), softcap,
                                            None if sinks is None else sinks.contiguous(),
                                            None if alibi_slopes is None else alibi_slopes.contiguous())


def paged_decode_attention_unchecked(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                     block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                                     key_starts: torch.Tensor | None = None,
                                     softcap: float | None = None, sinks: torch.Tensor | None = None,
                                     alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """``paged_decode_attention`` for callers that guarantee its argument rules: the attention layer,
    whose block table and lengths the metadata builder makes once per step for every layer (and whose
    sinks and ALiBi slopes are contiguous float32)."""
    q = q.contiguous()
    out = torch.empty_like(q)
    num_reqs, num_heads, head_dim = q.shape
    if num_reqs == 0:
        return out
    _, block_size, num_kv_heads, _ = k_cache.shape
    lib = _load_library()
    starts = None if key_starts is None else key_starts.data_ptr()
    cap = float(softcap or 0.0)
    sink_ptr = None if sinks is None else sinks.data_ptr()
    slopes_ptr = None if alibi_slopes is None else alibi_slopes.data_ptr()
    if k_cache.dtype == torch.float32:
        status = lib.llmc_paged_decode_attention_f32(  # type: ignore[union-attr]
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(), block_table.stride(0),
            seq_lens.data_ptr(), starts, out.data_ptr(), num_reqs, num_heads, num_kv_heads, head_dim, block_size,
            float(scale), cap, sink_ptr, slopes_ptr, torch.get_num_threads())
    elif k_cache.dtype in FP8_DTYPES:
        status = lib.llmc_paged_decode_attention_fp8(  # type: ignore[union-attr]
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), int(k_cache.dtype == torch.float8_e5m2),
            block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(), starts, out.data_ptr(), num_reqs,
            num_heads, num_kv_heads, head_dim, block_size, float(scale), cap, sink_ptr, slopes_ptr,
            torch.get_num_threads())
    else:
        raise TypeError(f"the decode kernel reads float32 or fp8 caches, not {k_cache.dtype}")
    if status == 5:  # checked in C: a host-side max() per layer per step would cost more than the check
        raise ValueError("a sequence is longer than its block table row covers")
    if status == 6:
        raise ValueError("a key start is negative or not before its sequence's end")
    if status != 0:
        raise RuntimeError(f"paged decode attention kernel failed with status {status}")
    return out


def fp8_byte_value(byte: int, dtype: torch.dtype) -> float:
    """What the decode kernel reads an fp8 cache byte as (``dtype``: torch.float8_e4m3fn or e5m2)."""
    if _load_library() is None:
        raise RuntimeError("the CPU kernels are not available")
    return _load_library().llmc_fp8_to_float(byte, int(dtype == torch.float8_e5m2))  # type: ignore[union-attr]


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of ``x`` (+ ``residual`` when given) over the last dim, times ``weight``, in one pass.

    Returns (normed, x + residual) — the second is None without a residual. fp32 CPU tensors; x and
    residual [..., hidden] contiguous, weight [hidden].
    """
    if _load_library() is None:
        raise RuntimeError("the CPU kernels are not available")
    cols = weight.shape[0]
    for name, t in (("x", x), ("weight", weight), ("residual", residual)):
        if t is None:
            continue
        if t.dtype != torch.float32 or not t.is_cpu:
            raise TypeError(f"{name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")
        if not t.is_contiguous() or t.shape[-1] != cols:
            raise ValueError(f"{name} must be contiguous with last dim {cols}, got {tuple(t.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    return add_rms_norm_unchecked(x, weight, eps, residual)


def add_rms_norm_unchecked(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``add_rms_norm`` for callers that guarantee its argument rules (the per-layer hot path)."""
    out = torch.empty_like(x)
    summed = None if residual is None else torch.empty_like(x)
    cols = weight.shape[0]
    _load_library().llmc_add_rms_norm_f32(  # type: ignore[union-attr]
        x.data_ptr(), None if residual is None else residual.data_ptr(), None if summed is None else summed.data_ptr(),
        weight.data_ptr(), out.data_ptr(), x.numel() // cols, cols, eps, torch.get_num_threads())
    return out, summed
