"""A Mamba-2 mixer's geometry, as a model config states it (read by gpu_worker.config)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Mamba2Config:
    """A Mamba-2 mixer's geometry (transformers' names: mamba_n_heads, mamba_d_head, ...)."""

    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_kernel: int
    chunk_size: int
    conv_bias: bool = True
    proj_bias: bool = False
    # dt is clamped to this range after softplus ((0, inf): not at all).
    time_step_limit: tuple[float, float] = (0.0, float("inf"))

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """The convolution's channels: x, then B and C of every group."""
        return self.intermediate_size + 2 * self.num_groups * self.state_size

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One request's conv state and SSM state, per layer."""
        return (self.conv_dim, self.conv_kernel - 1), (self.num_heads, self.head_dim, self.state_size)

    def state_bytes(self, dtype: torch.dtype) -> int:
        """One request's state in one layer: the conv state in ``dtype``, the SSM state in fp32."""
        conv, ssm = self.state_shapes()
        return conv[0] * conv[1] * dtype.itemsize + ssm[0] * ssm[1] * ssm[2] * 4
