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


class ClampedSiluAndMul(nn.Module):
    """min(silu(gate), limit) * clamp(up, -limit, limit) (Ling 3's and Step 3.7's SwiGLU with its clip
    after the activation)."""

    def __init__(self, limit: float) -> None:
        super().__init__()
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return clamped_silu_and_mul(gate, up, self.limit)


def clamped_silu_and_mul(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate).clamp_(max=limit).mul_(up.clamp(-limit, limit))


class GeluAndMul(nn.Module):
    """gelu(x[..., :d]) * x[..., d:] (GeGLU), ``approximate`` "tanh" (Gemma's gelu_pytorch_tanh) or "none"."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate).mul_(up)


class Relu2AndMul(nn.Module):
    """relu(x[..., :d])^2 * x[..., d:] (BitNet's gated relu^2)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return torch.relu(gate).square_().mul_(up)


class XIELU(nn.Module):
    """xIELU (Apertus's MLP activation): alpha_p x^2 + beta x for x > 0, else alpha_n (expm1(min(x,
    eps)) - x) + beta x, with alpha_p = softplus(a_p) and alpha_n = beta + softplus(a_n) from the learned
    scalars a_p, a_n (``alpha_p``, ``alpha_n``), as transformers' XIELUActivation computes it (beta 0.5,
    eps -1e-6: its fixed values)."""

    BETA, EPS = 0.5, -1e-6

    def __init__(self) -> None:
        super().__init__()
        self.alpha_p = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.alpha_n = nn.Parameter(torch.zeros(1), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.BETA + F.softplus(self.alpha_n)
        eps = torch.tensor(self.EPS, dtype=x.dtype, device=x.device)
        return torch.where(x > 0, alpha_p * x * x + self.BETA * x,
                           (torch.expm1(torch.minimum(x, eps)) - x) * alpha_n + self.BETA * x)


def ungated_activation(name: str):
    """An ungated MLP's activation for a config's ``hidden_act``: relu (OPT's), relu(x)^2 (Nemotron-H's, Arcee's), exact
    gelu, or its tanh form (StarCoder2's gelu_pytorch_tanh, Phi's gelu_new, GPT-NeoX-20B's gelu_fast)."""
    if name == "relu2":
        return lambda x: torch.relu(x).square_()
    if name == "relu":  # (OPT's)
        return torch.relu
    if name == "xielu":  # (Apertus's: learned scalars, a module of its own)
        return XIELU()
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
    if name == "relu2":  # (BitNet's, gpu_worker.config._activation)
        return Relu2AndMul()
    raise ValueError(f"unsupported activation {name!r}")
