"""RMSNorm with the residual add fused in (the decoder's add + norm pattern): one C pass on the
CPU in fp32 (gpu_worker.cpu_kernels), torch otherwise."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.cpu_kernels import add_rms_norm_unchecked, cpu_kernels_available
from gpu_worker.layers.weight_utils import WeightLike, copy_into, materialize


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: WeightLike, shard_id: int | str | None = None) -> None:
        copy_into(param, materialize(loaded))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused kernel; in fp32 it is the same arithmetic as the reference below.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Same order of operations as HF (statistics in fp32, weight applied in the input dtype),
        # so bf16 results match the reference bit for bit where possible.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if (x.dtype == torch.float32 and x.is_cpu and x.is_contiguous() and cpu_kernels_available()
                and (residual is None or residual.is_contiguous())):
            # CPU fp32: the add and the norm in one C pass (torch's dispatch dominates at decode sizes).
            out, summed = add_rms_norm_unchecked(x, self.weight, self.eps, residual)
            return out if summed is None else (out, summed)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class LayerNorm(RMSNorm):
    """LayerNorm, (x - mean) / sqrt(var + eps) * w + b (the classic transformer's: StarCoder2's,
    StableLM's), computed as torch's nn.LayerNorm computes it; ``bias`` False: without b. With
    ``residual``, the add fused in as RMSNorm's."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__(hidden_size, eps)
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class LayerNorm1P(LayerNorm):
    """Nemotron's LayerNorm1P: the checkpoint stores w and the norm scales by (1 + w); the parameter
    holds 1 + w, computed in the parameter's dtype as transformers adds it."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(hidden_size, eps)
        self.weight.weight_loader = self.weight_plus_one_loader

    def weight_plus_one_loader(self, param: nn.Parameter, loaded: WeightLike,
                               shard_id: int | str | None = None) -> None:
        copy_into(param, materialize(loaded).to(param.dtype) + 1.0)


class ParameterFreeLayerNorm(LayerNorm):
    """OLMo's LayerNorm without a weight or a bias, computed in fp32 and cast back (transformers'
    OlmoLayerNorm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(hidden_size, eps, bias=False)
        self.weight = None  # (no parameters)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), x.shape[-1:], None, None, self.eps).to(x.dtype)


class WeightlessRMSNorm(RMSNorm):
    """RMSNorm without a learnt weight (nanochat's): x / rms(x) in fp32, cast back.
    Its weight is a buffer of ones, not read from a checkpoint, so RMSNorm's kernels serve it unchanged
    (a product by one is exact)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        del self.weight
        self.register_buffer("weight", torch.ones(hidden_size), persistent=False)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint stores w and the norm scales by (1 + w), all in fp32 before
    the cast back (Llama's casts first, then scales). The parameter holds 1 + w in fp32, so the fp32
    path is RMSNorm's, fused kernel included, and other dtypes match transformers' arithmetic."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: WeightLike, shard_id: int | str | None = None) -> None:
        copy_into(param, materialize(loaded).float() + 1.0)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)
