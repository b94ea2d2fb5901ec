"""LFM2's gated short convolution (Liquid AI's LFM2 "conv" layers), over a flat batch of requests.

in_proj gives each token B, C and x (hidden_size channels each); B * x runs through a causal
depthwise convolution of conv_L_cache taps (no activation), whose output is gated by C and
projected back by out_proj. A request carries the convolution's last conv_L_cache - 1 inputs from
token to token, in its row of the layer's state (``MambaState``'s conv part; the recurrent part has
no values), which the model runner binds, zeroes at token 0 and indexes by the request's row of the
block table, as it does for the Mamba-2 layers (gpu_worker.layers.mamba).
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.layers.linear import ColumnParallelLinear, RowParallelLinear, tp_rank_and_size
from gpu_worker.layers.mamba import DepthwiseConv, MambaState, MambaStepMetadata, causal_conv, rank_rows
from gpu_worker.layers.weight_utils import copy_into
from gpu_worker.mamba_config import ShortConvConfig


class ShortConv(nn.Module):
    """The gated short convolution; checkpoint names as transformers' Lfm2ShortConv (``in_proj``,
    ``conv``, ``out_proj``). Under tensor parallelism each rank holds channels / tp of B, C and x
    (their rows of in_proj, the convolution's channels) and out_proj's columns for them; out_proj's
    all-reduce sums the ranks' shares."""

    # The projections LoRA adapters may train (gpu_worker.lora.manager.wrap_model).
    lora_targets = ("in_proj", "out_proj")

    def __init__(self, hidden_size: int, config: ShortConvConfig, eps: float = 0.0) -> None:
        super().__init__()
        rank, tp_size = tp_rank_and_size(None, None)
        self.config = m = config.per_rank(tp_size)
        width = m.channels
        # (this rank's rows of B, of C and of x, in the checkpoint's in_proj)
        in_sections = [(part * config.channels + rank * width, width) for part in range(3)]
        self.in_proj = ColumnParallelLinear(hidden_size, 3 * width, bias=m.bias, tp_rank=0, tp_size=1)
        for param in (self.in_proj.weight, self.in_proj.bias):
            if param is not None:
                param.weight_loader = lambda p, loaded, shard=None: copy_into(p, rank_rows(loaded, in_sections))
        # (The checkpoint's rows, which a LoRA adapter's B must have: gpu_worker.lora.manager.)
        self.in_proj.weight.checkpoint_rows = 3 * config.channels
        self.conv = DepthwiseConv(width, m.conv_kernel, m.bias, [(rank * width, width)])
        self.out_proj = RowParallelLinear(config.channels, hidden_size, bias=m.bias)
        # Bound by the model runner (as PagedAttention's kv_cache).
        self.state: MambaState | None = None

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, meta) -> torch.Tensor:
        """``hidden`` [T, hidden_size] -> [T, hidden_size]; ``meta.mamba`` says where each request's
        tokens lie and which state row it owns (``rope`` is not used)."""
        if self.state is None:
            raise RuntimeError("short-convolution state is not bound: call initialize_cache() first")
        step: MambaStepMetadata = meta.mamba
        b, c, x = self.in_proj.forward(hidden).chunk(3, dim=-1)
        mixed = causal_conv(self.state, self.conv, b * x, step)
        return self.out_proj.forward((c.float() * mixed).to(hidden.dtype))
