"""Kimi Delta Attention (KDA): Kimi-Linear's linear-attention layers, over a flat batch of requests.

It is the gated delta rule (gpu_worker.layers.gated_delta_net) with the decay per key channel rather
than per head: each head keeps a state S [head_dim, head_dim] per request; for each token, with q and
k L2-normalised (q also scaled by head_dim ** -0.5), a log decay g [head_dim] <= 0 and a write
strength beta, row d of S is decayed by exp(g[d]); the value S recalls for k is replaced, in the
proportion beta, by v (u = beta (v - k S), S += k u^T); the output is q S. Decodes go through that
recurrence as one batch, each prefill chunk through the chunked form below, all in fp32; a
request's state lives in its row of the state tensors beside its convolution's last inputs, as the
other recurrent mixers' do.

Within a chunk of C tokens, with cumulative log decays G_j [head_dim] and D_ij = exp(G_i - G_j)
channel by channel (j <= i), the writes solve the unit lower-triangular system (I + A) U =
beta (V - (K exp(G)) S0), A_jm = beta_j sum_d k_j[d] k_m[d] D_jm[d] for m < j; the outputs are
(q_i exp(G_i)) S0 + sum_{j <= i} (sum_d q_i[d] k_j[d] D_ij[d]) u_j, and the state after it
exp(G_C) S0 (row by row) + sum_j (k_j exp(G_C - G_j)) u_j^T. The pairwise factors D are exact (no
exp of a positive number), [heads, C, C, head_dim] per chunk: the reason KDA's chunk is shorter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.layers.gated_delta_net import run_delta_rule
from gpu_worker.layers.layernorm import RMSNorm
from gpu_worker.layers.linear import ColumnParallelLinear, RowParallelLinear, tp_rank_and_size
from gpu_worker.layers.mamba import DepthwiseConv, MambaState, MambaStepMetadata, causal_conv, rank_rows
from gpu_worker.layers.weight_utils import copy_into, load_sharded, materialize
from gpu_worker.mamba_config import KimiDeltaAttentionConfig

# FLA's L2 norm of q and k: x / sqrt(sum x^2 + eps).
_L2_EPS = 1e-6


def kda_chunk_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q, k, g [L, H, D], v [L, H, Dv], beta [L, H], state [H, D, Dv] (fp32). Returns the
    outputs [L, H, Dv] and the state after the last token."""
    outs = []
    for start in range(0, q.shape[0], chunk_size):
        end = start + chunk_size
        qc, kc, vc = q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
        bc, n = beta[start:end].t(), qc.shape[1]  # bc: [H, n]
        decay = torch.cumsum(g[start:end], dim=0).transpose(0, 1)  # [H, n, D]: G_j
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        gaps = (decay[:, :, None] - decay[:, None]).masked_fill_(~lower[None, :, :, None], float("-inf"))
        pairs = gaps.exp_()  # [H, i, j, D]: exp(G_i - G_j), zero above the diagonal
        strict = lower.logical_and(~torch.eye(n, dtype=torch.bool, device=q.device))
        system = torch.einsum("hjmd,hmd->hjm", pairs * kc[:, :, None], kc) * strict * bc[:, :, None]
        recalled = torch.einsum("hjd,hdv->hjv", kc * decay.exp(), state)
        rhs = bc[:, :, None] * (vc - recalled)
        writes = torch.linalg.solve_triangular(system + torch.eye(n, device=q.device), rhs, upper=False,
                                               unitriangular=True)  # [H, n, Dv]
        scores = torch.einsum("hijd,hjd->hij", pairs.mul_(qc[:, :, None]), kc)
        out = torch.einsum("hid,hdv->hiv", qc * decay.exp(), state) + torch.bmm(scores, writes)
        outs.append(out.transpose(0, 1))
        to_end = torch.exp(decay[:, -1:] - decay)  # [H, n, D]
        state = state * decay[:, -1].exp()[:, :, None] + torch.einsum("hjd,hjv->hdv", kc * to_end, writes)
    return torch.cat(outs) if len(outs) > 1 else outs[0], state


def _l2_normed(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + _L2_EPS)


class KimiDeltaAttention(nn.Module):
    """Kimi-Linear's linear-attention mixer: ``q_proj``, ``k_proj``, ``v_proj`` (held as one
    in_proj_qkv), the causal convolution over q, k and v with SiLU (``conv1d``: the checkpoint's
    q_conv1d, k_conv1d, v_conv1d joined), the decay per key channel (``f_a_proj`` then ``f_b_proj``
    plus ``dt_bias``, through softplus, times -exp(``A_log``) per head), the write strength
    sigmoid(``b_proj``), the delta rule, an RMSNorm per head in fp32 (``o_norm``) times
    sigmoid(``g_b_proj(g_a_proj(x))``), ``o_proj``.

    Ling 3's (``full_rank_gates``, ``gate_lower_bound``): the decay from ``f_proj`` (whole), through
    lower_bound * sigmoid(exp(A_log) * x) where a lower bound is given, and the gate from ``g_proj``.

    Under tensor parallelism each rank holds num_heads / tp heads: its rows of the q, k, v, f_b (or f),
    b and g_b (or g) projections and its convolution channels, its heads' A and dt bias, o_proj's
    columns (all-reduced); the low-rank f_a and g_a projections and the norm whole on every rank."""

    def __init__(self, hidden_size: int, config: KimiDeltaAttentionConfig, eps: float) -> None:
        super().__init__()
        rank, tp_size = tp_rank_and_size(None, None)
        full = config
        self.config = m = config.per_rank(tp_size)
        self.eps = eps
        qkv_sections = [(part * full.key_dim + rank * m.key_dim, m.key_dim) for part in range(3)]
        self.in_proj_qkv = ColumnParallelLinear(hidden_size, m.conv_dim, tp_rank=0, tp_size=1)
        self.in_proj_qkv.weight.weight_loader = (
            lambda p, loaded, shard=None: copy_into(p, rank_rows(loaded, qkv_sections)))
        self.conv1d = DepthwiseConv(m.conv_dim, m.conv_kernel, False, qkv_sections)
        if m.full_rank_gates:  # (Ling 3's)
            self.f_proj = ColumnParallelLinear(hidden_size, full.key_dim)
            self.g_proj = ColumnParallelLinear(hidden_size, full.key_dim)
        else:
            self.f_a_proj = ColumnParallelLinear(hidden_size, full.head_dim, tp_rank=0, tp_size=1)
            self.f_b_proj = ColumnParallelLinear(full.head_dim, full.key_dim)
            self.g_a_proj = ColumnParallelLinear(hidden_size, full.head_dim, tp_rank=0, tp_size=1)
            self.g_b_proj = ColumnParallelLinear(full.head_dim, full.key_dim)
        self.b_proj = ColumnParallelLinear(hidden_size, full.num_heads)
        # (In fp32 whatever the model's dtype, as transformers keeps dt_bias: the decay compounds.)
        self.A_log = nn.Parameter(torch.empty(m.num_heads, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(m.key_dim, dtype=torch.float32), requires_grad=False)
        # (A_log as released: [1, 1, heads, 1].)
        self.A_log.weight_loader = (lambda p, loaded, shard=None:
                                    load_sharded(p, materialize(loaded).reshape(-1), 0, rank))
        self.dt_bias.weight_loader = lambda p, loaded, shard=None: load_sharded(p, loaded, 0, rank)
        self.o_norm = RMSNorm(m.head_dim, eps)  # (its weight only: applied in fp32 below)
        self.o_proj = RowParallelLinear(full.key_dim, hidden_size)
        self.state: MambaState | None = None

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, meta) -> torch.Tensor:
        if self.state is None:
            raise RuntimeError("Kimi Delta Attention state is not bound: call initialize_cache() first")
        step: MambaStepMetadata = meta.mamba
        m = self.config
        tokens, heads = hidden.shape[0], m.num_heads
        conv = F.silu(causal_conv(self.state, self.conv1d, self.in_proj_qkv.forward(hidden), step))
        q, k, v = conv.float().view(tokens, 3, heads, m.head_dim).unbind(1)
        q, k = _l2_normed(q) * m.head_dim ** -0.5, _l2_normed(k)
        full_rank = m.full_rank_gates
        f = self.f_proj.forward(hidden) if full_rank else self.f_b_proj.forward(self.f_a_proj.forward(hidden))
        f = (f.float() + self.dt_bias.float()).view(tokens, heads, m.head_dim)
        rate = torch.exp(self.A_log.float())[:, None]
        g = (-rate * F.softplus(f) if m.gate_lower_bound is None
             else m.gate_lower_bound * torch.sigmoid(rate * f))
        beta = torch.sigmoid(self.b_proj.forward(hidden).float())
        out = run_delta_rule(self.state, step, q, k, v, g, beta, kda_chunk_scan, m.chunk_size)
        gate = self.g_proj.forward(hidden) if full_rank else self.g_b_proj.forward(self.g_a_proj.forward(hidden))
        gate = gate.float().view(tokens, heads, m.head_dim)
        normed = F.rms_norm(out, (m.head_dim,), self.o_norm.weight.float(), self.eps) * torch.sigmoid(gate)
        return self.o_proj.forward(normed.to(hidden.dtype).reshape(tokens, m.key_dim))

