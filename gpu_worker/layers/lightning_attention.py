"""Lightning attention: MiniMax-Text-01's and MiniMax-M1's linear-attention layers, over a flat batch of
requests.

Each head keeps a state S [head_dim, head_dim] per request; for each token, with q, k and v through
SiLU (no normalisation, no query scale), S is decayed by exp(-s) for the head's fixed rate s and gains
k^T v; the output is q S. The rates fall geometrically over the heads (s_h = 2^(-8 (h + 1) / heads))
and with depth (times 1 - layer / (layers - 1), nearly zero in the last layer). Decodes go through
that recurrence as one batch, each prefill chunk through the chunked form, all in fp32; a request's
state lives in its row of the state tensors, as the other recurrent mixers' do (it has no
convolution: its conv part is empty).

Within a chunk of C tokens the outputs are exp(-s (i + 1)) q_i S0 + sum_{j <= i} exp(-s (i - j))
(q_i . k_j) v_j, and the state after it exp(-s C) S0 + sum_j exp(-s (C - 1 - j)) k_j^T v_j.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker import distributed
from gpu_worker.layers.layernorm import RMSNorm
from gpu_worker.layers.linear import ColumnParallelLinear, RowParallelLinear, tp_rank_and_size
from gpu_worker.layers.mamba import MambaState, MambaStepMetadata, run_recurrence
from gpu_worker.layers.weight_utils import load_sharded
from gpu_worker.mamba_config import LightningAttentionConfig

# transformers' MiniMaxRMSNorm over the heads' outputs: LlamaRMSNorm's default epsilon.
_NORM_EPS = 1e-6


def lightning_slopes(num_heads: int, layer: int, num_layers: int) -> torch.Tensor:
    """Each head's decay rate in ``layer`` (of num_layers), as MiniMax computes them: [num_heads]."""
    base = 1 / (2 ** (8 / num_heads))
    depth = 1 - layer / (num_layers - 1 + 1e-5) + 1e-5
    return base ** (torch.arange(num_heads, dtype=torch.float32) + 1) * depth


def lightning_chunk_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor,
                         state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q, k, v [L, H, D], slopes [H], state [H, D, D] (fp32). Returns the outputs [L, H, D]
    and the state after the last token."""
    outs = []
    for start in range(0, q.shape[0], chunk_size):
        qc, kc, vc = (x[start:start + chunk_size].transpose(0, 1) for x in (q, k, v))  # [H, n, D]
        n = qc.shape[1]
        steps = torch.arange(n, dtype=torch.float32, device=q.device)
        gaps = steps[:, None] - steps[None, :]  # i - j
        pairs = torch.exp(-slopes[:, None, None] * gaps.clamp(min=0)) * (gaps >= 0)  # [H, i, j]
        inter = torch.bmm(qc * torch.exp(-slopes[:, None, None] * (steps[None, :, None] + 1)), state)
        outs.append((inter + torch.bmm(torch.bmm(qc, kc.transpose(1, 2)) * pairs, vc)).transpose(0, 1))
        to_end = torch.exp(-slopes[:, None, None] * (n - 1 - steps[None, :, None]))  # [H, n, 1]
        state = state * torch.exp(-slopes * n)[:, None, None] + torch.bmm((kc * to_end).transpose(1, 2), vc)
    return torch.cat(outs) if len(outs) > 1 else outs[0], state


def lightning_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of R requests (fp32): q, k, v [R, H, D], state [R, H, D, D], updated in place.
    Returns the outputs [R, H, D] and the state."""
    state.mul_(torch.exp(-slopes)[:, None, None]).add_(k[..., :, None] * v[..., None, :])
    return torch.einsum("rhd,rhde->rhe", q, state), state


class LightningAttention(nn.Module):
    """MiniMax's lightning-attention mixer: ``qkv_proj`` (per head: its q, k and v rows; held as
    in_proj_qkv, as Gated DeltaNet's, which the attention's q/k/v fusing leaves alone), SiLU, the
    decayed linear attention, an RMSNorm over every head's outputs together (``norm``), times
    sigmoid(``output_gate``), ``out_proj``. Its heads' decay rates depend on the layer: set by
    ``set_layer`` once the decoder layer knows its place.

    Under tensor parallelism each rank holds num_heads / tp heads (their qkv_proj and output_gate
    rows, rates and norm weights, out_proj's columns, all-reduced); the norm's sum of squares is
    all-reduced across the ranks' heads."""

    def __init__(self, hidden_size: int, config: LightningAttentionConfig, eps: float) -> None:
        super().__init__()
        self.rank, self.tp_size = tp_rank_and_size(None, None)
        full = config
        self.config = m = config.per_rank(self.tp_size)
        self.width = full.width
        self.in_proj_qkv = ColumnParallelLinear(hidden_size, 3 * full.width)
        self.output_gate = ColumnParallelLinear(hidden_size, full.width)
        self.out_proj = RowParallelLinear(full.width, hidden_size)
        self.norm = RMSNorm(m.width, _NORM_EPS)  # (its weight, this rank's heads'; applied below)
        self.norm.weight.weight_loader = lambda p, loaded, shard=None: load_sharded(p, loaded, 0, self.rank)
        self.slopes: torch.Tensor
        self.register_buffer("slopes", torch.zeros(m.num_heads, dtype=torch.float32), persistent=False)
        self.state: MambaState | None = None

    def set_layer(self, layer: int, num_layers: int) -> None:
        """This rank's heads' decay rates in ``layer`` of ``num_layers``."""
        rates = lightning_slopes(self.config.num_heads * self.tp_size, layer, num_layers)
        self.slopes.copy_(rates.narrow(0, self.rank * self.config.num_heads, self.config.num_heads))

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, meta) -> torch.Tensor:
        if self.state is None:
            raise RuntimeError("lightning attention state is not bound: call initialize_cache() first")
        step: MambaStepMetadata = meta.mamba
        m = self.config
        tokens = hidden.shape[0]
        qkv = F.silu(self.in_proj_qkv.forward(hidden).float()).view(tokens, m.num_heads, 3 * m.head_dim)
        q, k, v = qkv.split(m.head_dim, dim=-1)
        slopes = self.slopes.float()
        out = run_recurrence(
            self.state, step, torch.empty_like(v),
            lambda idx, states: lightning_step(q.index_select(0, idx), k.index_select(0, idx),
                                               v.index_select(0, idx), slopes, states),
            lambda span, state: lightning_chunk_scan(q[span], k[span], v[span], slopes, state, m.chunk_size))
        out = out.reshape(tokens, m.width)
        squares = out.pow(2).sum(-1, keepdim=True)
        if self.tp_size > 1:  # (one norm over every rank's heads)
            squares = distributed.all_reduce(squares)
        normed = self.norm.weight * (out * torch.rsqrt(squares / self.width + _NORM_EPS)).to(hidden.dtype)
        return self.out_proj.forward(normed * torch.sigmoid(self.output_gate.forward(hidden)))
