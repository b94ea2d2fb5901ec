"""Mamba-2 mixer layers (IBM Granite 4.0-H's recurrent layers), over a flat batch of requests.

A Mamba-2 layer keeps no KV cache: each request carries a fixed-size state from token to token, the
last ``d_conv - 1`` inputs of its causal convolution and the SSM state ([heads, head_dim, d_state]),
held in a row of the layer's state tensors (``MambaState``) that the model runner binds and indexes
by the request's row of the block table. A request's first chunk starts from zero (the runner zeroes
the rows of requests starting at token 0); later chunks and decodes carry on from the row.

Per pass the mixer takes the decodes (one token each) as one batch through the recurrent update, and
each longer chunk (a prefill) through the chunked scan of state space duality (SSD): within a chunk
of ``chunk_size`` tokens the output is a masked quadratic form, across chunks the state carries. The
arithmetic is in fp32, as the reference kernels accumulate; the SSM state is stored in fp32 too.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker import distributed
from gpu_worker.layers.linear import ColumnParallelLinear, RowParallelLinear, tp_rank_and_size
from gpu_worker.layers.weight_utils import WeightLike, copy_into, load_sharded, materialize
from gpu_worker.mamba_config import Mamba2Config


@dataclass
class TokenStep:
    """One token of each of several requests that a pass takes token by token (rows verifying drafts),
    as a decode batch: their token indices and state rows ([n] int64), then the rows whose states
    after this token are kept and the kept-state slots (MambaState.kept) they go to (None: none)."""

    tokens: torch.Tensor
    rows: torch.Tensor
    kept_rows: torch.Tensor | None = None
    kept_slots: torch.Tensor | None = None


@dataclass
class MambaStepMetadata:
    """Where each request of a pass lies in the flat batch and which state row it owns."""

    # The one-token requests: their token indices in the batch and their state rows ([n] int64).
    decode_tokens: torch.Tensor | None
    decode_rows: torch.Tensor | None
    # Every longer chunk: (first token, end token, state row), in order; a chunk whose state is kept
    # part-way (the prefix cache's, at a block boundary inside it) as consecutive pieces of one row.
    prefills: list[tuple[int, int, int]]
    # (first, end) where the decodes' rows are consecutive and ascending (a steady batch's usual
    # case): their states are then a slice of each layer's, updated where they lie.
    decode_row_span: tuple[int, int] | None = None
    # Index into ``prefills`` -> the kept-state slots (MambaState.kept) its row's state after that
    # piece is copied into (a prefix-cache slot, a verified draft's slot, or both).
    kept_after: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # The requests verifying drafts (speculative decoding), token by token: step j takes the j-th token
    # of each that has one, as a decode batch, so their states after each draft are there to keep.
    token_steps: list[TokenStep] = field(default_factory=list)


@dataclass
class MambaState:
    """A layer's states for every request row: conv [rows, conv_dim, d_conv - 1] (the model's dtype
    unless --mamba-cache-dtype says), ssm [rows, heads, head_dim, d_state] (fp32 unless
    --mamba-ssm-cache-dtype says; the mixers compute in fp32 whatever it is stored in)."""

    conv: torch.Tensor
    ssm: torch.Tensor
    # The layer's kept states (slots of the same shapes): the prefix cache's, then with speculative
    # decoding each live row's states before its drafts; a pass copies states part-way through a
    # chunk (MambaStepMetadata.kept_after) or after a token (token_steps) into them. None: none kept.
    kept: MambaState | None = None

    @classmethod
    def allocate(cls, config: Mamba2Config, rows: int, dtype: torch.dtype, device: torch.device,
                 ssm_dtype: torch.dtype = torch.float32) -> MambaState:
        conv, ssm = config.state_shapes()
        return cls(torch.zeros((rows, *conv), dtype=dtype, device=device),
                   torch.zeros((rows, *ssm), dtype=ssm_dtype, device=device))

    def zero_rows(self, rows: torch.Tensor) -> None:
        self.conv.index_fill_(0, rows, 0)
        self.ssm.index_fill_(0, rows, 0)

    def gather_ssm(self, rows: torch.Tensor, span: tuple[int, int] | None = None) -> torch.Tensor:
        """The SSM states of ``rows``, in fp32: a copy, or where they are the consecutive rows ``span``
        of fp32 states, those rows themselves (a step updating them in place is then done with them:
        scatter_ssm has nothing to copy)."""
        if span is not None and self.ssm.dtype == torch.float32:
            return self.ssm.narrow(0, span[0], span[1] - span[0])
        return self.ssm.index_select(0, rows).float()

    def scatter_ssm(self, rows: torch.Tensor, states: torch.Tensor) -> None:
        """``states`` (of ``rows``) stored, unless they are the state rows themselves (gather_ssm's slice)."""
        if states.untyped_storage().data_ptr() == self.ssm.untyped_storage().data_ptr():
            return
        self.ssm.index_copy_(0, rows, states.to(self.ssm.dtype))


# A pass's decodes as one batch: (their token indices, their states [n, ...] in fp32) -> (outputs, the
# states updated); a prefill chunk: (its tokens' slice, its row's state in fp32) -> (outputs, state after).
DecodeStep = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
PrefillScan = Callable[[slice, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def run_recurrence(state: MambaState, step: MambaStepMetadata, out: torch.Tensor, decode: DecodeStep,
                   prefill: PrefillScan) -> torch.Tensor:
    """A recurrent mixer's pass (Mamba-2's, Mamba-1's, the delta rule's, lightning attention's): the
    one-token requests through ``decode`` as one batch, their states read and stored back by row
    (updated where they lie when their rows are consecutive); the requests verifying drafts through
    ``decode`` a token at a time (step.token_steps: their states after a step copied into the kept
    slots it names); then each longer chunk through ``prefill`` from its row's state (copied into a
    kept slot after a piece step.kept_after names); each request's outputs written into ``out`` at
    its tokens."""
    if step.decode_tokens is not None:
        rows, tokens = step.decode_rows, step.decode_tokens
        outputs, states = decode(tokens, state.gather_ssm(rows, step.decode_row_span))
        state.scatter_ssm(rows, states)
        out.index_copy_(0, tokens, outputs)
    for token_step in step.token_steps:
        outputs, states = decode(token_step.tokens, state.gather_ssm(token_step.rows))
        state.scatter_ssm(token_step.rows, states)
        out.index_copy_(0, token_step.tokens, outputs)
        del outputs, states  # (freed before the kept copy's own temporary: the peak a decode pass has)
        if token_step.kept_rows is not None:
            state.kept.ssm.index_copy_(0, token_step.kept_slots, state.ssm.index_select(0, token_step.kept_rows))
    carried: tuple[int, torch.Tensor] | None = None  # (a piece's row, its fp32 state after it)
    for i, (start, end, row) in enumerate(step.prefills):
        # (A chunk's next piece goes on from the state the last left, unrounded to the storage dtype.)
        initial = carried[1] if carried is not None and carried[0] == row else state.ssm[row].float()
        out[start:end], final = prefill(slice(start, end), initial)
        state.ssm[row] = final
        carried = (row, final)
        for slot in step.kept_after.get(i, ()):
            state.kept.ssm[slot] = state.ssm[row]
    return out


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                   state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's scan, chunk by chunk, all fp32. x: [L, H, P]; dt: [L, H] (discretisation steps,
    already softplus'd); a: [H] (negative); b, c: [L, H, N] (each head's group's); state: [H, P, N]
    before the first token. Returns y [L, H, P] (without the D skip) and the state after the last
    token: h_t = exp(dt_t a) h_{t-1} + dt_t x_t b_t^T, y_t = h_t c_t."""
    outs = []
    for start in range(0, x.shape[0], chunk_size):
        xs, dts = x[start:start + chunk_size], dt[start:start + chunk_size]
        bs, cs = b[start:start + chunk_size], c[start:start + chunk_size]
        n = xs.shape[0]
        decay = torch.cumsum(dts * a, dim=0)  # [n, H]: log of the decay from the chunk's start to t
        # Within the chunk: y_i = sum_{j <= i} exp(decay_i - decay_j) (c_i . b_j) dt_j x_j.
        gaps = decay.t()[:, :, None] - decay.t()[:, None, :]  # [H, i, j]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        weights = torch.exp(gaps.masked_fill(~causal, float("-inf")))
        scores = torch.einsum("ihn,jhn->hij", cs, bs) * weights
        y = torch.einsum("hij,jhp->ihp", scores, xs * dts[..., None])
        # From the state the chunk started with: y_i += exp(decay_i) h_0 c_i.
        y = y + torch.einsum("ihn,hpn->ihp", cs, state) * torch.exp(decay)[..., None]
        outs.append(y)
        # The state after the chunk: decayed, plus each token's contribution decayed to the end.
        to_end = torch.exp(decay[-1][None, :] - decay)  # [n, H]
        state = (state * torch.exp(decay[-1])[:, None, None]
                 + torch.einsum("jh,jhp,jhn->hpn", to_end * dts, xs, bs))
    return torch.cat(outs) if len(outs) > 1 else outs[0], state


def ssd_step(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of R requests (fp32): x [R, H, P], dt [R, H], b, c [R, H, N], state
    [R, H, P, N], updated in place (no temporary of its size: a decode batch's states are the
    largest tensors of the pass). Returns y [R, H, P] (without D) and the state."""
    state.mul_(torch.exp(dt * a)[..., None, None]).addcmul_((dt[..., None] * x)[..., None], b[:, :, None, :])
    return torch.einsum("rhpn,rhn->rhp", state, c), state


class GatedRMSNorm(nn.Module):
    """RMSNorm of y * silu(gate) over each group's channels (Mamba-2's norm before out_proj), or of y
    and then times silu(gate) (``norm_before_gate``: Falcon-H1's option). Under tensor parallelism a
    rank holds its heads' channels: whole groups where the groups are split, else a slice of the one
    group, whose sum of squares is then all-reduced."""

    def __init__(self, width: int, group_size: int, eps: float, tp_rank: int = 0, across_ranks: bool = False,
                 norm_before_gate: bool = False) -> None:
        super().__init__()
        self.group_size, self.eps = group_size, eps
        self.across_ranks = across_ranks
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.ones(width), requires_grad=False)
        self.weight.weight_loader = lambda param, loaded, shard=None: load_sharded(param, loaded, 0, tp_rank)

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        h = y.float() if self.norm_before_gate else y.float() * F.silu(gate.float())
        if self.across_ranks:  # (one group over every rank's channels)
            squares = distributed.all_reduce(h.pow(2).sum(-1, keepdim=True))
            normed = h * torch.rsqrt(squares / self.group_size + self.eps)
        else:
            groups = h.view(*h.shape[:-1], -1, self.group_size)
            normed = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)).view(h.shape)
        if self.norm_before_gate:
            return (self.weight.float() * normed * F.silu(gate.float())).to(dtype)
        return self.weight * normed.to(dtype)


def rank_rows(loaded: WeightLike, sections: list[tuple[int, int]]) -> torch.Tensor:
    """The rows ``sections`` ((start, count) in the checkpoint's rows) of ``loaded``, concatenated."""
    tensor = materialize(loaded)
    return torch.cat([tensor.narrow(0, start, count) for start, count in sections])


class DepthwiseConv(nn.Module):
    """The causal depthwise convolution's weights (the checkpoint's ``conv1d``: a Conv1d whose weight
    [channels, 1, kernel] is kept as [channels, kernel]) and bias, this rank's channels of them."""

    def __init__(self, channels: int, kernel: int, bias: bool, sections: list[tuple[int, int]]) -> None:
        super().__init__()
        self.sections = sections
        self.weight = nn.Parameter(torch.empty(channels, kernel), requires_grad=False)
        self.weight.weight_loader = self._weight_loader
        self.bias = nn.Parameter(torch.empty(channels), requires_grad=False) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self._weight_loader

    def _weight_loader(self, param: nn.Parameter, loaded: WeightLike, shard_id: int | str | None = None) -> None:
        copy_into(param, rank_rows(loaded, self.sections).reshape(param.shape))


class MambaMixer2(nn.Module):
    """Mamba-2's mixer: in_proj to (gate z, xBC, dt), a causal depthwise convolution over xBC with
    SiLU, the selective scan over x with B and C (groups of heads share them), D's skip, the gated
    norm, out_proj. Checkpoint names as transformers' (``in_proj``, ``conv1d``, ``A_log``, ``D``,
    ``dt_bias``, ``norm``, ``out_proj``).

    Under tensor parallelism each rank holds num_heads / tp heads (their z, x and dt rows of in_proj,
    x's convolution channels, A, D, dt's bias, the norm's channels and out_proj's columns) and the
    groups of B and C that its heads read (split when they divide, else the one group on every
    rank); out_proj's all-reduce sums the heads' outputs, as vLLM shards its MambaMixer2."""

    # The projections LoRA adapters may train (gpu_worker.lora.manager.wrap_model).
    lora_targets = ("in_proj", "out_proj")

    def __init__(self, hidden_size: int, config: Mamba2Config, eps: float) -> None:
        super().__init__()
        rank, tp_size = tp_rank_and_size(None, None)
        full = config
        # This rank's geometry: its state tensors are this shape.
        self.config = m = config.per_rank(tp_size)
        width, bc = m.intermediate_size, m.num_groups * m.state_size
        bc_start = rank * bc if full.groups_split(tp_size) else 0
        x_rows = (full.intermediate_size + rank * width, width)
        b_rows = (2 * full.intermediate_size + bc_start, bc)
        c_rows = (2 * full.intermediate_size + full.num_groups * full.state_size + bc_start, bc)
        in_sections = [(rank * width, width), x_rows, b_rows, c_rows,
                       (full.intermediate_size + full.conv_dim + rank * m.num_heads, m.num_heads)]
        conv_sections = [(start - full.intermediate_size, count) for start, count in (x_rows, b_rows, c_rows)]
        self.in_proj = ColumnParallelLinear(hidden_size, width + m.conv_dim + m.num_heads, bias=m.proj_bias,
                                            tp_rank=0, tp_size=1)
        for param in (self.in_proj.weight, self.in_proj.bias):
            if param is not None:
                param.weight_loader = lambda p, loaded, shard=None: copy_into(p, rank_rows(loaded, in_sections))
        # (The checkpoint's rows, which a LoRA adapter's B must have: gpu_worker.lora.manager.)
        self.in_proj.weight.checkpoint_rows = full.intermediate_size + full.conv_dim + full.num_heads
        self.conv1d = DepthwiseConv(m.conv_dim, m.conv_kernel, m.conv_bias, conv_sections)
        self.A_log = nn.Parameter(torch.empty(m.num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(m.num_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(m.num_heads), requires_grad=False)
        for param in (self.A_log, self.D, self.dt_bias):  # (this rank's heads')
            param.weight_loader = lambda p, loaded, shard=None: load_sharded(p, loaded, 0, rank)
        self.norm = (GatedRMSNorm(width, full.intermediate_size // full.num_groups, eps, rank,
                                  across_ranks=tp_size > 1 and not full.groups_split(tp_size),
                                  norm_before_gate=m.norm_before_gate) if m.gated_norm else None)
        self.out_proj = RowParallelLinear(full.intermediate_size, hidden_size,
                                          bias=m.proj_bias if m.out_proj_bias is None else m.out_proj_bias)
        # Bound by the model runner (as PagedAttention's kv_cache).
        self.state: MambaState | None = None

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, meta) -> torch.Tensor:
        """``hidden`` [T, hidden_size] -> [T, hidden_size]; ``meta.mamba`` says where each request's
        tokens lie and which state row it owns (``rope`` is not used: the recurrence is the order)."""
        if self.state is None:
            raise RuntimeError("Mamba state is not bound: call initialize_cache() first")
        step: MambaStepMetadata = meta.mamba
        m = self.config
        width = m.intermediate_size
        gate, xbc, dt = self.in_proj.forward(hidden).split([width, m.conv_dim, m.num_heads], dim=-1)
        x, dt, b, c = self._split(causal_conv(self.state, self.conv1d, xbc, step), dt)
        a = -torch.exp(self.A_log.float())
        y = run_recurrence(
            self.state, step, torch.empty_like(x),
            lambda idx, states: ssd_step(x.index_select(0, idx), dt.index_select(0, idx), a, b.index_select(0, idx),
                                         c.index_select(0, idx), states),
            lambda span, state: ssd_chunk_scan(x[span], dt[span], a, b[span], c[span], state, m.chunk_size))
        y = (y + x * self.D.float()[:, None]).flatten(1).to(hidden.dtype)
        if self.norm is None:  # (Falcon-H1 without mamba_rms_norm: the gate alone)
            return self.out_proj.forward((y.float() * F.silu(gate.float())).to(hidden.dtype))
        return self.out_proj.forward(self.norm.forward(y, gate))

    def _split(self, conv: torch.Tensor, dt: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's output (fp32, bias added) after SiLU as x [T, H, P], b and c [T, H, N]
        (each head its group's), and dt [T, H] after its bias, softplus and clamp."""
        m = self.config
        x, b, c = F.silu(conv).split([m.intermediate_size, m.num_groups * m.state_size, m.num_groups * m.state_size],
                                     dim=-1)
        per_group = m.num_heads // m.num_groups
        b = b.reshape(-1, m.num_groups, m.state_size).repeat_interleave(per_group, dim=1)
        c = c.reshape(-1, m.num_groups, m.state_size).repeat_interleave(per_group, dim=1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*m.time_step_limit)
        return x.reshape(-1, m.num_heads, m.head_dim), dt, b, c


def causal_conv(state: MambaState, conv1d: DepthwiseConv, x: torch.Tensor, step: MambaStepMetadata) -> torch.Tensor:
    """The causal depthwise convolution of every request's new inputs ``x`` [T, channels] over its
    last ``kernel - 1`` inputs (its row of ``state.conv``, updated in place to end with these, in
    its own dtype; copied into a kept slot after a piece step.kept_after names, or after a token of
    step.token_steps): [T, channels] in fp32, the bias added (no activation)."""
    conv_state = state.conv
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    kernel = conv1d.weight.shape[1]
    weight = conv1d.weight.float()

    def one_token_each(tokens: torch.Tensor, rows: torch.Tensor) -> None:
        window = torch.cat((conv_state.index_select(0, rows).to(x.dtype), x.index_select(0, tokens)[:, :, None]),
                           dim=2)
        conv_state.index_copy_(0, rows, window[:, :, 1:].to(conv_state.dtype))
        out.index_copy_(0, tokens, (window.float() * weight).sum(-1))

    if step.decode_tokens is not None:
        one_token_each(step.decode_tokens, step.decode_rows)
    for token_step in step.token_steps:
        one_token_each(token_step.tokens, token_step.rows)
        if token_step.kept_rows is not None:
            state.kept.conv.index_copy_(0, token_step.kept_slots, conv_state.index_select(0, token_step.kept_rows))
    carried: tuple[int, torch.Tensor] | None = None  # (a piece's row, its last inputs in x's dtype)
    for i, (start, end, row) in enumerate(step.prefills):
        before = carried[1] if carried is not None and carried[0] == row else conv_state[row].to(x.dtype)
        window = torch.cat((before, x[start:end].t()), dim=1)
        conv_state[row] = window[:, -(kernel - 1):]
        carried = (row, window[:, -(kernel - 1):])
        for slot in step.kept_after.get(i, ()):
            state.kept.conv[slot] = conv_state[row]
        out[start:end] = F.conv1d(window[None].float(), weight[:, None, :], groups=weight.shape[0])[0].t()
    if conv1d.bias is not None:
        out += conv1d.bias.float()
    return out


def mamba_step_metadata(rows: np.ndarray, query_start_loc: np.ndarray, device: torch.device,
                        kept_within: dict[int, list[tuple[int, int]]] | None = None,
                        token_by_token: Collection[int] = ()) -> MambaStepMetadata:
    """A pass's requests (``rows``: each one's state row; ``query_start_loc``: [num_reqs + 1]) as the
    mixers take them: the one-token requests batched, the longer ones ``token_by_token`` names
    (request indexes: those verifying drafts) a token at a time beside each other, every other longer
    chunk on its own. ``kept_within``: request index -> [(tokens into its chunk, kept-state slot)],
    ascending (one position may name several slots), each inside the chunk: its state there is kept
    (a chunk is then scanned in pieces that end there)."""
    lens = np.diff(query_start_loc)
    single = np.flatnonzero(lens == 1)
    tokens = decode_rows = span = None
    if len(single):
        tokens = torch.from_numpy(np.ascontiguousarray(query_start_loc[single], dtype=np.int64)).to(device)
        decode_rows = torch.from_numpy(np.ascontiguousarray(rows[single], dtype=np.int64)).to(device)
        first = int(rows[single[0]])
        if np.array_equal(rows[single], np.arange(first, first + len(single))):
            span = (first, first + len(single))
    kept_within = kept_within or {}
    stepped: list[int] = []
    prefills: list[tuple[int, int, int]] = []
    kept_after: dict[int, tuple[int, ...]] = {}
    for i in np.flatnonzero(lens > 1).tolist():
        if i in token_by_token:
            stepped.append(i)
            continue
        chunk_start, end, row = int(query_start_loc[i]), int(query_start_loc[i + 1]), int(rows[i])
        start = chunk_start
        for offset, slots in _kept_offsets(i, int(lens[i]), kept_within.get(i, ())):
            kept_after[len(prefills)] = slots
            prefills.append((start, chunk_start + offset, row))
            start = chunk_start + offset
        prefills.append((start, end, row))
    return MambaStepMetadata(tokens, decode_rows, prefills, span, kept_after,
                             _token_steps(stepped, rows, query_start_loc, kept_within, device))


def _kept_offsets(request: int, length: int, kept: list[tuple[int, int]]) -> list[tuple[int, tuple[int, ...]]]:
    """A chunk's kept states ([(tokens into the chunk, slot)], ascending) as [(offset, its slots)]:
    a position named again adds a slot. ValueError unless each lies inside the chunk, ascending."""
    grouped: list[tuple[int, tuple[int, ...]]] = []
    for offset, slot in kept:
        if grouped and grouped[-1][0] == offset:
            grouped[-1] = (offset, grouped[-1][1] + (slot,))
            continue
        if not (grouped[-1][0] if grouped else 0) < offset < length:
            raise ValueError(f"a state kept {offset} tokens into a chunk of {length} (request {request}): "
                             "the kept positions must lie inside the chunk, ascending")
        grouped.append((offset, (slot,)))
    return grouped


def _token_steps(requests: list[int], rows: np.ndarray, query_start_loc: np.ndarray,
                 kept_within: dict[int, list[tuple[int, int]]], device: torch.device) -> list[TokenStep]:
    """The requests ``requests`` (indexes) taken token by token: step j holds the j-th token of each
    that has one, and the states kept after it (kept_within's offset j + 1)."""
    if not requests:
        return []
    lens = np.diff(query_start_loc)
    kept: list[list[tuple[int, int]]] = [[] for _ in range(int(lens[requests].max()))]  # per step: (row, slot)
    for i in requests:
        for offset, slots in _kept_offsets(i, int(lens[i]), kept_within.get(i, ())):
            kept[offset - 1] += [(int(rows[i]), slot) for slot in slots]

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    steps = []
    for j, after in enumerate(kept):
        present = [i for i in requests if lens[i] > j]
        steps.append(TokenStep(tensor([int(query_start_loc[i]) + j for i in present]),
                               tensor([int(rows[i]) for i in present]),
                               tensor([row for row, _ in after]) if after else None,
                               tensor([slot for _, slot in after]) if after else None))
    return steps
