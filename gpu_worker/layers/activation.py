"""Gated activations over a fused gate/up projection output: SwiGLU, and Gemma's GeGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:], where the input is the merged [gate; up] projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)


class GeluAndMul(nn.Module):
    """gelu(x[..., :d]) * x[..., d:] (GeGLU), ``approximate`` "tanh" (Gemma's gelu_pytorch_tanh) or "none"."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate).mul_(up)


def ungated_activation(name: str):
    """An ungated MLP's activation for a config's ``hidden_act``: relu (OPT's), relu(x)^2 (Nemotron-H's, Arcee's), exact
    gelu, or its tanh form (StarCoder2's gelu_pytorch_tanh, Phi's gelu_new, GPT-NeoX-20B's gelu_fast)."""
    if name == "relu2":
        return lambda x: torch.relu(x).square_()
    if name == "relu":  # (OPT's)
        return torch.relu
    if name in ("gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        approximate = "none" if name == "gelu" else "tanh"
        return lambda x: F.gelu(x, approximate=approximate)
    raise ValueError(f"unsupported activation {name!r}")


def gated_activation(name: str) -> nn.Module:
    """The gated activation for a config's ``hidden_act`` (gpu_worker.config.SUPPORTED_ACTIVATIONS)."""
    if name == "silu":
        return SiluAndMul()
    if name in ("gelu_pytorch_tanh", "gelu"):
        return GeluAndMul("tanh" if name == "gelu_pytorch_tanh" else "none")
    raise ValueError(f"unsupported activation {name!r}")
