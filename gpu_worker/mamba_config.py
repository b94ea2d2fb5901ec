"""The recurrent mixers' geometry, as a model config states it (read by gpu_worker.config): Mamba-2's,
Gated DeltaNet's, Kimi Delta Attention's, lightning attention's and LFM2's short convolution's, each
with the per-request state shapes the model runner allocates and the name its layers go by in
messages (``layer_name``)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from engine_core.config import MAMBA_CACHE_DTYPE_NAMES


def resolve_mamba_state_dtypes(mamba_cache_dtype: str, mamba_ssm_cache_dtype: str,
                               model_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """The recurrent layers' (conv state, recurrent state) storage dtypes from vLLM's two flags:
    mamba_cache_dtype sets both, mamba_ssm_cache_dtype the recurrent (SSM, delta-rule) state alone.
    Their "auto": the conv state in the model's dtype and the recurrent state in fp32, which the
    scans accumulate in (vLLM's auto is the model's dtype for both, and model cards such as
    Nemotron-H's ask for float32 here); bfloat16 halves the states' memory at some precision."""
    for flag, name in (("mamba_cache_dtype", mamba_cache_dtype), ("mamba_ssm_cache_dtype", mamba_ssm_cache_dtype)):
        if name not in MAMBA_CACHE_DTYPE_NAMES:
            raise ValueError(f"{flag} must be one of {', '.join(MAMBA_CACHE_DTYPE_NAMES)}, got {name!r}")
    conv = model_dtype if mamba_cache_dtype == "auto" else getattr(torch, mamba_cache_dtype)
    ssm_name = mamba_cache_dtype if mamba_ssm_cache_dtype == "auto" else mamba_ssm_cache_dtype
    return conv, torch.float32 if ssm_name == "auto" else getattr(torch, ssm_name)


class _RecurrentState:
    """What every recurrent mixer's geometry shares: one request's state in one layer, in bytes, from
    its (conv, recurrent) ``state_shapes``."""

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        raise NotImplementedError

    def state_bytes(self, dtype: torch.dtype, ssm_dtype: torch.dtype = torch.float32) -> int:
        """The conv state in ``dtype``, the recurrent (SSM, delta-rule) state in ``ssm_dtype``."""
        conv, recurrent = self.state_shapes()
        return math.prod(conv) * dtype.itemsize + math.prod(recurrent) * ssm_dtype.itemsize


@dataclass(frozen=True)
class Mamba2Config(_RecurrentState):
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
    # The gated RMSNorm before out_proj (Falcon-H1 may leave it out, mamba_rms_norm: then y * silu(z)),
    # over y * silu(z), or over y and then times silu(z) (Falcon-H1's mamba_norm_before_gate).
    gated_norm: bool = True
    norm_before_gate: bool = False
    # out_proj's bias where it is not in_proj's (Falcon-H1's projectors_bias; None: proj_bias).
    out_proj_bias: bool | None = None

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



@dataclass(frozen=True)
class GatedDeltaNetConfig(_RecurrentState):
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
    # OLMo Hybrid's allow_neg_eigval: the write strength beta is twice the sigmoid (in [0, 2]).
    beta_scale: float = 1.0

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



@dataclass(frozen=True)
class KimiDeltaAttentionConfig(_RecurrentState):
    """A Kimi Delta Attention mixer's geometry (Kimi-Linear's linear-attention layers: its
    linear_attn_config's num_heads, head_dim, short_conv_kernel_size). Queries, keys and values have
    num_heads heads of head_dim each (no grouping); a request's state is [num_heads, head_dim,
    head_dim] beside the convolution's last inputs of q, k and v."""

    layer_name: ClassVar[str] = "Kimi Delta Attention"

    num_heads: int
    head_dim: int
    conv_kernel: int
    # The prefill scan's chunk: its per-channel decays make each chunk's pairwise factors [heads,
    # chunk, chunk, head_dim], so a smaller chunk than Gated DeltaNet's bounds that temporary.
    chunk_size: int = 32
    # Ling 3's: the decay's and the output gate's projections whole (f_proj, g_proj) rather than
    # low-rank (f_a_proj / f_b_proj, g_a_proj / g_b_proj).
    full_rank_gates: bool = False
    # Ling 3's "safe" decay: lower_bound * sigmoid(exp(A_log) * x) rather than -exp(A_log) * softplus(x).
    gate_lower_bound: float | None = None

    @property
    def key_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """The convolution's channels: q, k, then v."""
        return 3 * self.key_dim

    def per_rank(self, tp_size: int) -> KimiDeltaAttentionConfig:
        """One tensor-parallel rank's share: num_heads / tp heads."""
        if self.num_heads % tp_size:
            raise ValueError(f"Kimi Delta Attention's {self.num_heads} heads cannot be split evenly over "
                             f"tensor_parallel_size={tp_size}")
        return dataclasses.replace(self, num_heads=self.num_heads // tp_size)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.conv_dim, self.conv_kernel - 1), (self.num_heads, self.head_dim, self.head_dim)


@dataclass(frozen=True)
class LightningAttentionConfig(_RecurrentState):
    """A lightning-attention mixer's geometry (MiniMax-Text-01's and MiniMax-M1's linear-attention
    layers: the attention's num_attention_heads heads of head_dim). A request's state is [num_heads,
    head_dim, head_dim]; it has no convolution (its conv part is empty)."""

    layer_name: ClassVar[str] = "lightning attention"

    num_heads: int
    head_dim: int
    # The prefill scan's chunk (its decay factors are [heads, chunk, chunk]).
    chunk_size: int = 64

    @property
    def width(self) -> int:
        return self.num_heads * self.head_dim

    def per_rank(self, tp_size: int) -> LightningAttentionConfig:
        """One tensor-parallel rank's share: num_heads / tp heads."""
        if self.num_heads % tp_size:
            raise ValueError(f"lightning attention's {self.num_heads} heads cannot be split evenly over "
                             f"tensor_parallel_size={tp_size}")
        return dataclasses.replace(self, num_heads=self.num_heads // tp_size)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (0,), (self.num_heads, self.head_dim, self.head_dim)


@dataclass(frozen=True)
class ShortConvConfig(_RecurrentState):
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



@dataclass(frozen=True)
class Mamba1Config(_RecurrentState):
    """A Mamba (selective SSM, "Mamba-1") mixer's geometry: intermediate_size channels, each with its
    own state of state_size values and its own decay per state value (A [channels, state_size]);
    dt through a dt_rank bottleneck (x_proj then dt_proj); B and C shared by every channel. dt, B and
    C may be RMS-normed first: Falcon-Mamba's without weights ("weightless"), Jamba's with them
    ("weighted")."""

    layer_name: ClassVar[str] = "Mamba"

    intermediate_size: int
    state_size: int
    conv_kernel: int
    dt_rank: int
    conv_bias: bool = True
    proj_bias: bool = False
    dt_bc_norm: str | None = None
    norm_eps: float = 1e-6

    def per_rank(self, tp_size: int) -> Mamba1Config:
        """One tensor-parallel rank's share: intermediate_size / tp channels (x_proj's all-reduce gives
        every rank the whole dt, B and C)."""
        if self.intermediate_size % tp_size:
            raise ValueError(f"Mamba's {self.intermediate_size} channels cannot be split evenly over "
                             f"tensor_parallel_size={tp_size}")
        return dataclasses.replace(self, intermediate_size=self.intermediate_size // tp_size)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.intermediate_size, self.conv_kernel - 1), (self.intermediate_size, self.state_size)

