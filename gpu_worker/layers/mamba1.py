"""Mamba (selective state space, "Mamba-1") mixer layers, over a flat batch of requests: the
recurrent layers of Mamba and Falcon-Mamba language models and of AI21's Jamba.

Each of the intermediate_size channels keeps a state h [state_size] per request: for each token,
h = exp(dt A) h + dt x B, y = h . C + D x, the output y * silu(z). dt (per channel, through the
dt_rank bottleneck and softplus), B and C (shared by the channels) depend on the token; A
[channels, state_size] and D are learnt. As with Mamba-2 (gpu_worker.layers.mamba), a request's
state and its convolution's last inputs live in its row of the layer's state tensors; decodes run
the recurrence as one batch, each prefill chunk the chunked scan below, in fp32.

A prefill chunk's tokens run as one vectorised scan in pieces: over a piece of tokens 0..n-1 from
state h0, with the cumulative log decay G_t = sum_{k<=t} dt_k A (per channel and state value, <= 0)
and R_t = G_t - G_0, h_t = exp(R_t) (exp(G_0) h0 + sum_{j<=t} exp(-R_j) dt_j x_j B_j): two cumulative
sums instead of a loop over tokens. A piece ends before exp(-R) could overflow (the steepest decay
of its tokens after the first reaches _MAX_LOG_DECAY) or its [tokens, channels, state_size] values
pass _PIECE_VALUES.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.layers.layernorm import RMSNorm
from gpu_worker.layers.linear import ColumnParallelLinear, RowParallelLinear, tp_rank_and_size
from gpu_worker.layers.mamba import (
    DepthwiseConv,
    MambaState,
    MambaStepMetadata,
    causal_conv,
    rank_rows,
    run_recurrence,
)
from gpu_worker.layers.weight_utils import copy_into, load_sharded
from gpu_worker.mamba_config import Mamba1Config

# A piece of the prefill scan ends before its steepest cumulative log decay passes this (exp(30) ~ 1e13,
# far inside fp32's range however the inputs are scaled), or its [tokens, channels, state] values pass that.
_MAX_LOG_DECAY = 30.0
_PIECE_VALUES = 16 * 1024 * 1024


def _scan_pieces(steepest: list[float], most_tokens: int) -> list[tuple[int, int]]:
    """[start, end) pieces of a sequence whose tokens decay at most ``steepest[t]`` (log, as a positive
    number) each: the sum over each piece's tokens after its first stays under _MAX_LOG_DECAY (a piece
    is one token where one alone passes it), and it holds at most ``most_tokens``."""
    pieces, start, total = [], 0, 0.0
    for t, step in enumerate(steepest):
        if t == start:
            continue
        if total + step > _MAX_LOG_DECAY or t - start >= most_tokens:
            pieces.append((start, t))
            start, total = t, 0.0
        else:
            total += step
    pieces.append((start, len(steepest)))
    return pieces


def selective_chunk_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's scan, all fp32. x, dt: [L, D] (dt after softplus); a: [D, N] (negative); b, c:
    [L, N]; state: [D, N] before the first token. Returns y [L, D] (without D's skip) and the state
    after the last token."""
    channels, size = a.shape
    # (Each token's steepest log decay, from [L, D] values: the [L, D, N] decays are made piece by piece.)
    steepest = (dt * (-a).amax(dim=1)).amax(dim=1).tolist()
    outs = []
    for start, end in _scan_pieces(steepest, max(1, _PIECE_VALUES // (channels * size))):
        # R: the decay after the piece's first token (summed from zero, not as a difference of large
        # sums, which would round it), in [-_MAX_LOG_DECAY, 0]: exp(R) and exp(-R) stay finite.
        steps = dt[start:end, :, None] * a  # [n, D, N], <= 0
        first = steps[0].clone()
        steps[0] = 0
        rel = torch.cumsum(steps, dim=0)
        u = (dt[start:end] * x[start:end])[:, :, None] * b[start:end, None, :]
        h = torch.exp(rel) * (torch.exp(first) * state + torch.cumsum(u * torch.exp(-rel), dim=0))  # [n, D, N]
        outs.append(torch.einsum("tdn,tn->td", h, c[start:end]))
        state = h[-1]
    return torch.cat(outs) if len(outs) > 1 else outs[0], state


def selective_step(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of R requests (fp32): x, dt [R, D], b, c [R, N], state [R, D, N], updated
    in place. Returns y [R, D] (without D's skip) and the state."""
    state.mul_(torch.exp(dt[:, :, None] * a)).addcmul_((dt * x)[:, :, None], b[:, None, :])
    return torch.einsum("rdn,rn->rd", state, c), state


class MambaMixer(nn.Module):
    """Mamba's mixer: in_proj to (x, z), a causal depthwise convolution over x with SiLU, x_proj to
    (dt's bottleneck, B, C), dt_proj with softplus, the selective scan, D's skip, times silu(z),
    out_proj. Checkpoint names as transformers' (``in_proj``, ``conv1d``, ``x_proj``, ``dt_proj``,
    ``A_log``, ``D``, ``out_proj``; Jamba's ``dt_layernorm``, ``b_layernorm``, ``c_layernorm``).

    Under tensor parallelism each rank holds intermediate_size / tp channels (their x and z rows of
    in_proj, convolution channels, x_proj's columns, dt_proj's rows, A, D, out_proj's columns);
    x_proj's all-reduce gives every rank the whole dt, B and C, as vLLM shards its MambaMixer."""

    # The projections LoRA adapters may train (gpu_worker.lora.manager.wrap_model).
    lora_targets = ("in_proj", "out_proj")

    def __init__(self, hidden_size: int, config: Mamba1Config, eps: float = 1e-6) -> None:
        super().__init__()
        rank, tp_size = tp_rank_and_size(None, None)
        full = config
        self.config = m = config.per_rank(tp_size)
        width = m.intermediate_size
        in_sections = [(rank * width, width), (full.intermediate_size + rank * width, width)]
        self.in_proj = ColumnParallelLinear(hidden_size, 2 * width, bias=m.proj_bias, tp_rank=0, tp_size=1)
        for param in (self.in_proj.weight, self.in_proj.bias):
            if param is not None:
                param.weight_loader = lambda p, loaded, shard=None: copy_into(p, rank_rows(loaded, in_sections))
        # (The checkpoint's rows, which a LoRA adapter's B must have: gpu_worker.lora.manager.)
        self.in_proj.weight.checkpoint_rows = 2 * full.intermediate_size
        self.conv1d = DepthwiseConv(width, m.conv_kernel, m.conv_bias, [(rank * width, width)])
        self.x_proj = RowParallelLinear(full.intermediate_size, m.dt_rank + 2 * m.state_size, bias=False)
        self.dt_proj = ColumnParallelLinear(m.dt_rank, full.intermediate_size, bias=True)
        self.A_log = nn.Parameter(torch.empty(width, m.state_size), requires_grad=False)
        self.D = nn.Parameter(torch.empty(width), requires_grad=False)
        for param in (self.A_log, self.D):  # (this rank's channels')
            param.weight_loader = lambda p, loaded, shard=None: load_sharded(p, loaded, 0, rank)
        self.out_proj = RowParallelLinear(full.intermediate_size, hidden_size, bias=m.proj_bias)
        # dt's bottleneck, B and C RMS-normed: with weights (Jamba's, whole on every rank), or without
        # (Falcon-Mamba's).
        self.norms = ([RMSNorm(size, m.norm_eps) for size in (m.dt_rank, m.state_size, m.state_size)]
                      if m.dt_bc_norm == "weighted" else None)
        if self.norms is not None:
            self.dt_layernorm, self.b_layernorm, self.c_layernorm = self.norms
        # Bound by the model runner (as PagedAttention's kv_cache).
        self.state: MambaState | None = None

    def _weightless_norm(self, values: torch.Tensor) -> torch.Tensor:
        normed = values.float() * torch.rsqrt(values.float().pow(2).mean(-1, keepdim=True) + self.config.norm_eps)
        return normed.to(values.dtype)

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, meta) -> torch.Tensor:
        """``hidden`` [T, hidden_size] -> [T, hidden_size]; ``meta.mamba`` says where each request's
        tokens lie and which state row it owns (``rope`` is not used)."""
        if self.state is None:
            raise RuntimeError("Mamba state is not bound: call initialize_cache() first")
        step: MambaStepMetadata = meta.mamba
        m = self.config
        x, z = self.in_proj.forward(hidden).chunk(2, dim=-1)
        x = F.silu(causal_conv(self.state, self.conv1d, x, step))  # [T, D] fp32
        dt, b, c = self.x_proj.forward(x.to(hidden.dtype)).split([m.dt_rank, m.state_size, m.state_size], dim=-1)
        if self.norms is not None:
            dt, b, c = (norm.forward(v.contiguous()) for norm, v in zip(self.norms, (dt, b, c), strict=True))
        elif m.dt_bc_norm == "weightless":
            dt, b, c = self._weightless_norm(dt), self._weightless_norm(b), self._weightless_norm(c)
        # (dt's bias added in fp32, before softplus, as the reference scan adds it)
        dt = F.softplus(F.linear(dt, self.dt_proj.weight).float() + self.dt_proj.bias.float())
        b, c = b.float(), c.float()
        a = -torch.exp(self.A_log.float())
        y = run_recurrence(
            self.state, step, torch.empty_like(x),
            lambda idx, states: selective_step(x.index_select(0, idx), dt.index_select(0, idx), a,
                                               b.index_select(0, idx), c.index_select(0, idx), states),
            lambda span, state: selective_chunk_scan(x[span], dt[span], a, b[span], c[span], state))
        y = (y + x * self.D.float()) * F.silu(z.float())
        return self.out_proj.forward(y.to(hidden.dtype))
