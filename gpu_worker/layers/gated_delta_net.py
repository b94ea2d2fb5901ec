"""Gated DeltaNet mixer layers (Qwen3-Next's linear attention), over a flat batch of requests.

Each value head keeps a matrix state S [head_k_dim, head_v_dim] per request. For each token, with q
and k L2-normalised (q also scaled by head_k_dim ** -0.5), a decay g <= 0 and a write strength beta:
S is decayed by exp(g); the value it already recalls for k is replaced, in the proportion beta, by v
(the delta rule: u = beta (v - k S), S += k u^T); the output is q S. Like the Mamba-2 layers
(gpu_worker.layers.mamba), a request's state lives in its row of the state tensors, beside its
convolution's last inputs, and starts from zero at token 0; decodes go through the recurrence as one
batch, each prefill chunk through the chunked form below, all in fp32.

Within a chunk of C tokens (cumulative log decay G_j) the writes u_j solve a unit lower-triangular
system, (I + A) U = beta (V - exp(G) K S0), with A_jm = beta_j exp(G_j - G_m) (k_j . k_m) for m < j;
the outputs are exp(G_i) q_i S0 + sum_{j <= i} exp(G_i - G_j) (q_i . k_j) u_j, and the state after it
exp(G_C) S0 + sum_j exp(G_C - G_j) k_j u_j^T.
"""

from __future__ import annotations

from collections.abc import Callable

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
from gpu_worker.mamba_config import GatedDeltaNetConfig

# A sequence's chunked delta rule: (q, k, v, g, beta, state, chunk_size) -> (outputs, state after).
ChunkScan = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int],
                     tuple[torch.Tensor, torch.Tensor]]


def delta_rule_chunk_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q, k [L, H, Dk], v [L, H, Dv], g, beta [L, H], state [H, Dk, Dv] (fp32). Returns
    the outputs [L, H, Dv] and the state after the last token."""
    outs = []
    for start in range(0, q.shape[0], chunk_size):
        qc, kc, vc = q[start:start + chunk_size], k[start:start + chunk_size], v[start:start + chunk_size]
        bc, n = beta[start:start + chunk_size].t(), qc.shape[0]  # bc: [H, n]
        decay = torch.cumsum(g[start:start + chunk_size], dim=0).t()  # [H, n]: G_j
        gaps = decay[:, :, None] - decay[:, None, :]  # [H, i, j]: G_i - G_j
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        weights = torch.exp(gaps.masked_fill(~lower, float("-inf")))  # exp(G_i - G_j), j <= i
        strict = weights.masked_fill(torch.eye(n, dtype=torch.bool, device=q.device), 0.0)  # (m < j only)
        system = torch.einsum("jhd,mhd->hjm", kc, kc) * strict * bc[:, :, None]
        system = system + torch.eye(n, device=q.device)
        recalled = torch.einsum("jhd,hdv->hjv", kc, state) * torch.exp(decay)[:, :, None]
        rhs = bc[:, :, None] * (vc.transpose(0, 1) - recalled)
        writes = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # [H, n, Dv]
        scores = torch.einsum("ihd,jhd->hij", qc, kc) * weights
        out = (torch.einsum("ihd,hdv->hiv", qc, state) * torch.exp(decay)[:, :, None]
               + torch.einsum("hij,hjv->hiv", scores, writes))
        outs.append(out.transpose(0, 1))
        to_end = torch.exp(decay[:, -1:] - decay)  # [H, n]
        state = (state * torch.exp(decay[:, -1])[:, None, None]
                 + torch.einsum("jhd,hjv->hdv", kc * to_end.t()[:, :, None], writes))
    return torch.cat(outs) if len(outs) > 1 else outs[0], state


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of R requests (fp32): q, k [R, H, Dk], v [R, H, Dv], beta [R, H], the log
    decay g [R, H] (one per head) or [R, H, Dk] (one per key channel: Kimi Delta Attention's), state
    [R, H, Dk, Dv], updated in place (no temporary of its size). Returns the outputs [R, H, Dv] and
    the state."""
    decay = torch.exp(g)
    state.mul_(decay[..., None] if decay.dim() == k.dim() else decay[..., None, None])
    recalled = torch.einsum("rhd,rhdv->rhv", k, state)
    state.addcmul_(k[..., :, None], ((v - recalled) * beta[..., None])[..., None, :])
    return torch.einsum("rhd,rhdv->rhv", q, state), state


def run_delta_rule(state: MambaState, step: MambaStepMetadata, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   g: torch.Tensor, beta: torch.Tensor, chunk_scan: ChunkScan, chunk_size: int) -> torch.Tensor:
    """A pass's delta rule (q, k, v [T, H, D], g and beta per token, fp32; ``chunk_scan`` Gated
    DeltaNet's or Kimi Delta Attention's): run_recurrence with the token recurrence for the decodes.
    Returns the outputs [T, H, Dv]."""
    def decode(idx: torch.Tensor, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return delta_rule_step(*(t.index_select(0, idx) for t in (q, k, v, g, beta)), states)

    return run_recurrence(state, step, torch.empty_like(v), decode,
                          lambda span, s: chunk_scan(q[span], k[span], v[span], g[span], beta[span], s, chunk_size))


def _l2_normed(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's linear attention: ``in_proj_qkvz`` (per key head: its q and k, its value heads' v
    and z) and ``in_proj_ba`` (per key head: its value heads' beta and decay logits) (Qwen3.5's:
    ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, each whole), the causal
    convolution over q, k, v with SiLU, the gated delta rule, an RMSNorm per value head times
    silu(z), ``out_proj``. Checkpoint names as transformers' (``conv1d``, ``A_log``, ``dt_bias``,
    ``norm``).

    Under tensor parallelism each rank holds num_k_heads / tp key heads and their value heads: the
    projections' rows come grouped by key head, so a rank's are one contiguous slice; its q, k and v
    convolution channels, its heads' A and dt bias, out_proj's columns (all-reduced), the norm whole."""

    def __init__(self, hidden_size: int, config: GatedDeltaNetConfig, eps: float) -> None:
        super().__init__()
        rank, tp_size = tp_rank_and_size(None, None)
        full = config
        self.config = m = config.per_rank(tp_size)
        # This rank's q, k and v channels (of the convolution, and of Qwen3.5's in_proj_qkv rows).
        qkv_sections = [(rank * m.key_dim, m.key_dim), (full.key_dim + rank * m.key_dim, m.key_dim),
                        (2 * full.key_dim + rank * m.value_dim, m.value_dim)]
        if m.split_projections:
            self.in_proj_qkv = ColumnParallelLinear(hidden_size, m.conv_dim, tp_rank=0, tp_size=1)
            self.in_proj_qkv.weight.weight_loader = (
                lambda p, loaded, shard=None: copy_into(p, rank_rows(loaded, qkv_sections)))
            self.in_proj_z = ColumnParallelLinear(hidden_size, full.value_dim)
            self.in_proj_b = ColumnParallelLinear(hidden_size, full.num_v_heads)
            self.in_proj_a = ColumnParallelLinear(hidden_size, full.num_v_heads)
        else:
            self.in_proj_qkvz = ColumnParallelLinear(hidden_size, 2 * full.key_dim + 2 * full.value_dim)
            self.in_proj_ba = ColumnParallelLinear(hidden_size, 2 * full.num_v_heads)
        self.conv1d = DepthwiseConv(m.conv_dim, m.conv_kernel, False, qkv_sections)
        self.A_log = nn.Parameter(torch.empty(m.num_v_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(m.num_v_heads), requires_grad=False)
        for param in (self.A_log, self.dt_bias):  # (this rank's value heads')
            param.weight_loader = lambda p, loaded, shard=None: load_sharded(p, loaded, 0, rank)
        self.norm = RMSNorm(m.head_v_dim, eps)  # (over each value head, before the gate)
        self.out_proj = RowParallelLinear(full.value_dim, hidden_size)
        self.state: MambaState | None = None

    def _inputs(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q, k, v) as the convolution's channels [T, conv_dim], z [T, Hv, Dv], b and a [T, Hv]:
        the projections' per-key-head groups put in order."""
        m = self.config
        tokens, per_key = hidden.shape[0], m.num_v_heads // m.num_k_heads
        if m.split_projections:
            return (self.in_proj_qkv.forward(hidden), self.in_proj_z.forward(hidden).view(tokens, m.num_v_heads, -1),
                    self.in_proj_b.forward(hidden), self.in_proj_a.forward(hidden))
        qkvz = self.in_proj_qkvz.forward(hidden).view(tokens, m.num_k_heads, -1)
        q, k, v, z = qkvz.split([m.head_k_dim, m.head_k_dim, per_key * m.head_v_dim, per_key * m.head_v_dim], dim=-1)
        b, a = self.in_proj_ba.forward(hidden).view(tokens, m.num_k_heads, 2 * per_key).split(per_key, dim=-1)
        qkv = torch.cat((q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)), dim=-1)
        return (qkv, z.reshape(tokens, m.num_v_heads, m.head_v_dim), b.reshape(tokens, m.num_v_heads),
                a.reshape(tokens, m.num_v_heads))

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, meta) -> torch.Tensor:
        if self.state is None:
            raise RuntimeError("Gated DeltaNet state is not bound: call initialize_cache() first")
        step: MambaStepMetadata = meta.mamba
        m = self.config
        tokens, per_key = hidden.shape[0], m.num_v_heads // m.num_k_heads
        qkv, z, b, a = self._inputs(hidden)
        conv = F.silu(causal_conv(self.state, self.conv1d, qkv, step))
        q, k, v = conv.split([m.key_dim, m.key_dim, m.value_dim], dim=-1)
        q = _l2_normed(q.reshape(tokens, m.num_k_heads, m.head_k_dim)).repeat_interleave(per_key, dim=1)
        q = q * m.head_k_dim ** -0.5
        k = _l2_normed(k.reshape(tokens, m.num_k_heads, m.head_k_dim)).repeat_interleave(per_key, dim=1)
        v = v.reshape(tokens, m.num_v_heads, m.head_v_dim)
        beta = torch.sigmoid(b.float())
        if m.beta_scale != 1.0:
            beta = beta * m.beta_scale
        g = -torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias.float())
        out = run_delta_rule(self.state, step, q, k, v, g, beta, delta_rule_chunk_scan, m.chunk_size)
        # RMSNorm over each value head (its weight applied in the model's dtype), then times silu(z).
        normed = self.norm.forward(out.to(hidden.dtype).reshape(-1, m.head_v_dim)).view(out.shape)
        gated = normed.float() * F.silu(z.float())
        return self.out_proj.forward(gated.to(hidden.dtype).reshape(tokens, m.value_dim))
