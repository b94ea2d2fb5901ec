"""The recurrent mixers' geometry, as a model config states it (read by gpu_worker.config): Mamba-2's,
Gated DeltaNet's and LFM2's short convolution's, each with the per-request state shapes the model
runner allocates and the name its layers go by in messages (``layer_name``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class Mamba2Config:
    """A Mamba-2 mixer's geometry (transformers' names: mamba_n_heads, mamba_d_head, ...)."""

    layer_name: ClassVar[str] = "Mamba-2"

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

    def groups_split(self, tp_size: int) -> bool:
        """Whether tensor parallelism splits the groups of B and C among the ranks (else each rank
        holds the one group whole)."""
        return self.num_groups % tp_size == 0

    def per_rank(self, tp_size: int) -> Mamba2Config:
        """One tensor-parallel rank's share: num_heads / tp heads (and their x, z, dt), the groups
        split likewise when they divide, else (one group) replicated on every rank, as vLLM shards
        its MambaMixer2."""
        if tp_size == 1:
            return self
        if self.num_heads % tp_size:
            raise ValueError(f"Mamba-2's {self.num_heads} heads cannot be split evenly over "
                             f"tensor_parallel_size={tp_size}")
        if not self.groups_split(tp_size) and self.num_groups != 1:
            raise ValueError(f"Mamba-2's {self.num_groups} groups cannot be split evenly over "
                             f"tensor_parallel_size={tp_size} (one group is replicated; more must divide)")
        groups = self.num_groups // tp_size if self.groups_split(tp_size) else 1
        return dataclasses.replace(self, num_heads=self.num_heads // tp_size, num_groups=groups)

    def state_bytes(self, dtype: torch.dtype) -> int:
        """One request's state in one layer: the conv state in ``dtype``, the SSM state in fp32."""
        conv, ssm = self.state_shapes()
        return conv[0] * conv[1] * dtype.itemsize + ssm[0] * ssm[1] * ssm[2] * 4


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    """A Gated DeltaNet mixer's geometry (Qwen3-Next's linear-attention layers: transformers' names
    linear_num_key_heads, linear_key_head_dim, ...). Each key head serves num_v_heads / num_k_heads
    value heads; a request's state is [num_v_heads, head_k_dim, head_v_dim] beside the convolution's
    last inputs."""

    layer_name: ClassVar[str] = "Gated DeltaNet"

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    # The prefill scan's chunk (the reference kernels' 64).
    chunk_size: int = 64
    # Qwen3.5's projections: q, k and v in one (each whole), z, b and a apart; Qwen3-Next's: in_proj_qkvz
    # and in_proj_ba, their rows grouped by key head.
    split_projections: bool = False

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """The convolution's channels: q, k, then v."""
        return 2 * self.key_dim + self.value_dim

    def per_rank(self, tp_size: int) -> GatedDeltaNetConfig:
        """One tensor-parallel rank's share: num_k_heads / tp key heads with their value heads."""
        if self.num_k_heads % tp_size:
            raise ValueError(f"Gated DeltaNet's {self.num_k_heads} key heads cannot be split evenly over "
                             f"tensor_parallel_size={tp_size}")
        return dataclasses.replace(self, num_k_heads=self.num_k_heads // tp_size,
                                   num_v_heads=self.num_v_heads // tp_size)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.conv_dim, self.conv_kernel - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def state_bytes(self, dtype: torch.dtype) -> int:
        conv, recurrent = self.state_shapes()
        return conv[0] * conv[1] * dtype.itemsize + recurrent[0] * recurrent[1] * recurrent[2] * 4


@dataclass(frozen=True)
class ShortConvConfig:
    """LFM2's gated short convolution (its "conv" layers): in_proj to B, C and x of ``channels``
    (hidden_size) each, a causal depthwise convolution of ``conv_kernel`` taps (conv_L_cache). A
    request's state is the convolution's last conv_kernel - 1 inputs alone: its recurrent state has
    no values (shape (0,)), so the runner's state rows hold the conv part only."""

    layer_name: ClassVar[str] = "short-convolution"

    channels: int
    conv_kernel: int
    bias: bool = False

    def per_rank(self, tp_size: int) -> ShortConvConfig:
        """One tensor-parallel rank's share: channels / tp of B, C and x (the convolution is per channel)."""
        if self.channels % tp_size:
            raise ValueError(f"the short convolution's {self.channels} channels cannot be split evenly over "
                             f"tensor_parallel_size={tp_size}")
        return dataclasses.replace(self, channels=self.channels // tp_size)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.channels, self.conv_kernel - 1), (0,)

    def state_bytes(self, dtype: torch.dtype) -> int:
        return self.channels * (self.conv_kernel - 1) * dtype.itemsize
