"""Mixture-of-experts feed-forward: top-k routing and the experts' SwiGLU MLPs.

Every expert's weights live stacked in two parameters, as vLLM's FusedMoE holds them:
``w13_weight`` [experts, 2 * intermediate, hidden] (gate rows, then up rows) and ``w2_weight``
[experts, hidden, intermediate]. Tensor parallelism splits every expert the way a dense MLP is
split: each rank holds its slice of each expert's intermediate dimension (gate/up rows, down
columns), so its output is a partial sum that the block all-reduces once, together with a shared
expert's partial sum where the model has one.

The forward pass sorts the batch's (token, expert) pairs by expert, so each expert's rows are
contiguous, and multiplies every group by its expert's weights in one grouped GEMM per projection
(``torch.nn.functional.grouped_mm``), the group boundaries found on the device (``searchsorted``
over the sorted ids: no host read here; torch's fused CUDA kernel runs on sm90+, on sm80/89 it
reads the offsets and loops itself). The results, scaled by each token's routing weight, are
scattered back with ``index_add_``. Where grouped_mm cannot run (no such function in this torch,
CUDA below sm80 or not bf16, float64, or rows not a multiple of 16 bytes wide) one pair of matmuls
runs per expert that any token chose, which reads the per-expert counts on the host.

GPT-OSS's experts add a bias to both projections and gate with a clamped SwiGLU (``swigluoai``:
the gate clamped above, the up projection both ways, gate * sigmoid(alpha * gate) * (up + 1)), as
vLLM's ``swigluoai`` activation computes it. Under width-split tensor parallelism the down
projection's bias is held on rank 0 only (zeros elsewhere), so the all-reduce counts it once.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.layers.activation import clamped_silu_and_mul
from gpu_worker.layers.linear import divide_for_tp, tp_rank_and_size
from gpu_worker.layers.weight_utils import WeightLike, copy_into

if TYPE_CHECKING:
    from gpu_worker.lora.experts import ExpertsDelta, ExpertsLoRA

# Shard ids of one expert's projections within the stacked parameters: (expert, projection).
GATE, UP, DOWN = 0, 1, 2
# (ALL_EXPERTS, GATE): every expert's gate and up rows in one [experts, 2 * intermediate, hidden]
# tensor; (ALL_EXPERTS, DOWN): every expert's down projection, [experts, hidden, intermediate]
# (transformers 5's in-memory layout, which save_pretrained(save_original_format=False) writes).
ALL_EXPERTS = -1


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, top_k] in fp32, expert ids [tokens, top_k]): the softmax over all experts'
    logits, its top k, renormalised to sum to one where the model does so (Mixtral, most Qwen3-MoE)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


def select_experts_grouped(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                           correction_bias: torch.Tensor | None, num_groups: int = 1, topk_groups: int = 1,
                           scaling_factor: float = 1.0, scoring: str = "sigmoid") -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routing (vLLM's grouped top-k). DeepSeek-V3's and GLM-4.5's: each expert's score
    is the sigmoid of its logit; the choice reads the scores plus a per-expert correction bias (the
    load-balancing bias learnt without an auxiliary loss), first keeping the ``topk_groups`` best of
    ``num_groups`` equal groups of experts (a group ranked by the sum of its two best biased scores;
    by its best without a bias), then the top k within them; the weights are the chosen experts'
    unbiased scores, renormalised where the model does so, times ``scaling_factor``. DeepSeek-V2's
    (``scoring`` "softmax"): the scores are the softmax over all experts, without a bias. Kolibri's
    ("sigmoid_logits"): the choice reads the logits (not their sigmoids) plus the bias, the weights are
    the sigmoids. Returns (weights [tokens, top_k] fp32, expert ids [tokens, top_k])."""
    if scoring not in ("softmax", "sigmoid", "sigmoid_logits"):
        raise ValueError(f"unknown expert scoring {scoring!r}")
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    choice = logits if scoring == "sigmoid_logits" else scores
    choice = choice if correction_bias is None else choice + correction_bias
    if num_groups > 1 and topk_groups < num_groups:
        grouped = choice.view(choice.shape[0], num_groups, -1)
        group_scores = (grouped.topk(2, dim=-1)[0].sum(dim=-1) if correction_bias is not None
                        else grouped.amax(dim=-1))
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, torch.topk(group_scores, topk_groups, dim=-1, sorted=False)[1], True)
        choice = grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view_as(choice)
    ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
    if scaling_factor != 1.0:
        weights *= scaling_factor
    return weights, ids


def select_experts_sparsemixer(router_logits: torch.Tensor, jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi-3.5-MoE's sparsemixer at inference, as transformers computes it: the top expert, weighted by
    the softmax over the experts whose logit is within 2 x ``jitter_eps`` of its (relative to the
    larger of the two magnitudes); then the best of the others, weighted alike among the others.
    Returns (weights [tokens, 2] fp32, expert ids [tokens, 2])."""
    weights, ids = [], []
    scores = router_logits
    for _ in range(2):
        best, best_id = scores.max(dim=-1, keepdim=True)
        factor = router_logits.abs().clamp(min=best)
        outside = (best - router_logits) / factor > 2 * jitter_eps
        weights.append(torch.softmax(scores.masked_fill(outside, float("-inf")), dim=-1).gather(-1, best_id))
        ids.append(best_id)
        scores = scores.scatter(-1, best_id, float("-inf"))
    return torch.cat(weights, dim=-1).float(), torch.cat(ids, dim=-1)


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's gated activation: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), where g is
    the gate clamped to at most ``limit``."""
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1).mul_(gate * torch.sigmoid(gate * alpha))


def _new_expert_weight(num_experts: int, out_features: int, in_features: int) -> nn.Parameter:
    """[experts, out, in]; on the CPU each expert's matrix is stored [in, out] (a transposed view),
    the layout MKL multiplies fastest, as ``linear.new_weight`` does for dense projections."""
    if torch.get_default_device().type == "cpu":
        weight = torch.empty(num_experts, in_features, out_features).transpose(1, 2)
    else:
        weight = torch.empty(num_experts, out_features, in_features)
    return nn.Parameter(weight, requires_grad=False)


@cache
def _grouped_mm_runs(device: torch.device, dtype: torch.dtype, hidden_size: int, width: int) -> bool:
    if not hasattr(F, "grouped_mm"):  # (public from torch 2.10)
        return False
    if device.type == "cuda":
        if dtype != torch.bfloat16 or torch.cuda.get_device_capability(device) < (8, 0):
            return False
    elif dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    size = torch.empty((), dtype=dtype, device="meta").element_size()
    return (hidden_size * size) % 16 == 0 and (width * size) % 16 == 0


class FusedMoE(nn.Module):
    """The routed experts of one layer. ``forward`` returns this rank's partial sum (not reduced).

    With ``expert_parallel`` (vLLM's --enable-expert-parallel) the ranks split the experts instead
    of their width: rank r holds experts [r * E / tp, (r + 1) * E / tp) whole, computes only the
    (token, expert) pairs routed to those, and the same all-reduce adds up every rank's share.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 tp_rank: int | None = None, tp_size: int | None = None, expert_parallel: bool = False,
                 bias: bool = False, activation: str = "silu", swiglu_alpha: float = 1.702,
                 swiglu_limit: float = 7.0, weights_on_inputs: bool = False) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={num_experts}], got {top_k}")
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_rank, tp_size)
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.top_k = top_k
        self.expert_parallel = expert_parallel and self.tp_size > 1
        if self.expert_parallel:
            self.num_local_experts = divide_for_tp(num_experts, self.tp_size, "num_experts (expert parallel)")
            self.intermediate_size_per_partition = intermediate_size
        else:
            self.num_local_experts = num_experts
            self.intermediate_size_per_partition = divide_for_tp(intermediate_size, self.tp_size,
                                                                 "moe_intermediate_size")
        # The global id of this rank's first expert (0 unless the experts are split).
        self.first_expert = self.tp_rank * self.num_local_experts if self.expert_parallel else 0
        size = self.intermediate_size_per_partition
        # Gated experts (act(gate) * up) hold gate and up rows in w13; Nemotron-H's ("relu2": relu(up)^2)
        # only up's.
        self.gated = activation != "relu2"
        # Rows of each expert's stacked gate/up projection on this rank (w13_weight's dimension 1).
        self.gate_up_rows = (2 if self.gated else 1) * size
        if bias and not self.gated:
            raise ValueError("ungated (relu2) experts are served without biases")
        self.w13_weight = _new_expert_weight(self.num_local_experts, (2 if self.gated else 1) * size, hidden_size)
        self.w2_weight = _new_expert_weight(self.num_local_experts, hidden_size, size)
        for param, projections in ((self.w13_weight, (GATE, UP) if self.gated else (UP,)), (self.w2_weight, (DOWN,))):
            param.weight_loader = self.weight_loader
            # What the checkpoint must provide (every expert, on every rank) for the parameter to count
            # as loaded.
            param.expected_shards = {(e, p) for e in range(num_experts) for p in projections}
        if activation not in ("silu", "silu_clamped", "swigluoai", "relu2", "gelu_pytorch_tanh"):
            raise ValueError(f"experts' activation must be 'silu', 'silu_clamped', 'swigluoai', 'relu2' or "
                             f"'gelu_pytorch_tanh', got {activation!r}")
        self.activation, self.swiglu_alpha, self.swiglu_limit = activation, swiglu_alpha, swiglu_limit
        # Llama 4's: each routing weight scales the token's input to its expert, not the expert's output.
        self.weights_on_inputs = weights_on_inputs
        if bias:
            # [local experts, 2 * width] (gate, then up) and [local experts, hidden]; loaded whole per
            # layer (ALL_EXPERTS), as GPT-OSS stores them.
            self.w13_bias = nn.Parameter(torch.zeros(self.num_local_experts, 2 * size), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.zeros(self.num_local_experts, hidden_size), requires_grad=False)
            for param, projection in ((self.w13_bias, GATE), (self.w2_bias, DOWN)):
                param.weight_loader = self.bias_loader
                param.expected_shards = {(ALL_EXPERTS, projection)}
        else:
            self.w13_bias = self.w2_bias = None

    def weight_loader(self, param: nn.Parameter, loaded: WeightLike, shard_id: int | str | None = None) -> None:
        if not isinstance(shard_id, tuple) or len(shard_id) != 2:
            raise ValueError(f"FusedMoE loads one expert's projection at a time, shard_id (expert, proj), "
                             f"got {shard_id!r}")
        expert, projection = shard_id
        size = self.intermediate_size_per_partition
        # Under expert parallelism a rank holds whole experts: its slice of their width is all of it.
        start = 0 if self.expert_parallel else self.tp_rank * size
        full = size if self.expert_parallel else size * self.tp_size
        if expert == ALL_EXPERTS:
            self._check_width(loaded, 0, self.num_experts, "experts")
            # This rank's experts, then its slice of their width (dim 1 of gate_up, 2 of down).
            mine = loaded.narrow(0, self.first_expert, self.num_local_experts) if self.expert_parallel else loaded
            if projection == DOWN:
                self._check_width(mine, 2, full, "down_proj")
                copy_into(param.data, mine.narrow(2, start, size), "down_proj")
            elif not self.gated:  # (every expert's up rows)
                self._check_width(mine, 1, full, "up_proj")
                copy_into(param.data, mine.narrow(1, start, size), "up_proj")
            else:
                self._check_width(mine, 1, 2 * full, "gate_up_proj")
                copy_into(param.data.narrow(1, 0, size), mine.narrow(1, start, size), "gate_up_proj")
                copy_into(param.data.narrow(1, size, size), mine.narrow(1, full + start, size), "gate_up_proj")
            return
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint expert {expert} is out of range: the model has {self.num_experts}")
        if not self.gated and projection == GATE:
            raise ValueError("ungated (relu2) experts have no gate_proj")
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return  # another rank's expert
        if projection == DOWN:
            self._check_width(loaded, 1, full, "down_proj")
            copy_into(param.data[local], loaded.narrow(1, start, size), "down_proj")
        else:
            name = "gate_proj" if projection == GATE else "up_proj"
            self._check_width(loaded, 0, full, name)
            offset = projection * size if self.gated else 0
            copy_into(param.data[local].narrow(0, offset, size), loaded.narrow(0, start, size), name)

    def bias_loader(self, param: nn.Parameter, loaded: WeightLike, shard_id: int | str | None = None) -> None:
        """Every expert's bias of one projection, shard_id (ALL_EXPERTS, GATE or DOWN): gate_up's
        [experts, 2 * width] (gate, then up), down's [experts, hidden]."""
        if shard_id not in ((ALL_EXPERTS, GATE), (ALL_EXPERTS, DOWN)):
            raise ValueError(f"FusedMoE loads every expert's bias at once, shard_id (ALL_EXPERTS, GATE or DOWN), "
                             f"got {shard_id!r}")
        self._check_width(loaded, 0, self.num_experts, "experts")
        mine = loaded.narrow(0, self.first_expert, self.num_local_experts) if self.expert_parallel else loaded
        if shard_id[1] == DOWN:
            if self.expert_parallel or self.tp_rank == 0:  # (width split: rank 0 adds it, once)
                copy_into(param.data, mine.narrow(1, 0, param.shape[1]), "down_proj_bias")
            return
        size = self.intermediate_size_per_partition
        start = 0 if self.expert_parallel else self.tp_rank * size
        full = size if self.expert_parallel else size * self.tp_size
        self._check_width(mine, 1, 2 * full, "gate_up_proj_bias")
        copy_into(param.data.narrow(1, 0, size), mine.narrow(1, start, size), "gate_up_proj_bias")
        copy_into(param.data.narrow(1, size, size), mine.narrow(1, full + start, size), "gate_up_proj_bias")

    @staticmethod
    def _check_width(loaded: WeightLike, dim: int, expected: int, name: str) -> None:
        """A rank reads only its slice: check the whole width first, so a mismatched config is not
        silently truncated."""
        if loaded.shape[dim] != expected:
            raise ValueError(f"shape mismatch loading {name}: the checkpoint's dimension {dim} is "
                             f"{loaded.shape[dim]}, the config says {expected} ({tuple(loaded.shape)})")

    def use_grouped_mm(self, hidden: torch.Tensor) -> bool:
        """Whether grouped_mm runs on this input: fp32/bf16/fp16 on the CPU, bf16 on CUDA sm80+, with
        every operand's rows a multiple of 16 bytes wide (the kernel's stride rule)."""
        if self.grouped_mm is not None:
            return self.grouped_mm
        return _grouped_mm_runs(hidden.device, hidden.dtype, hidden.shape[-1], self.intermediate_size_per_partition)

    # None: grouped_mm wherever it has a kernel; tests set False to run the per-expert loop.
    grouped_mm: bool | None = None
    # The LoRA adapters' deltas on the experts' projections (gpu_worker.lora.manager.wrap_experts sets it).
    lora: ExpertsLoRA | None = None

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        flat_ids = topk_ids.reshape(-1)
        num_local = self.num_local_experts
        if self.expert_parallel:
            # Local ids; another rank's experts go to one extra group past the last, never computed.
            flat_ids = flat_ids - self.first_expert
            flat_ids = flat_ids.masked_fill((flat_ids < 0) | (flat_ids >= num_local), num_local)
        # Each (token, choice) pair, grouped by expert; a stable sort keeps tokens in order within one.
        sorted_ids, order = torch.sort(flat_ids, stable=True)
        tokens = order // self.top_k
        weights = topk_weights.reshape(-1)[order].to(hidden.dtype).unsqueeze(1)
        rows = hidden.index_select(0, tokens)
        if self.weights_on_inputs:
            rows = rows * weights
        grouped = self.use_grouped_mm(hidden)
        # Where each expert's rows end: the number of sorted ids up to it (computed on the device).
        ends = torch.arange(1, num_local + 1, device=sorted_ids.device, dtype=sorted_ids.dtype) if grouped else None
        # (Each adapter of the pass that trains these experts, with the rows that run under it.)
        deltas = (self.lora.deltas(tokens, hidden.shape[0], rows.dtype, sorted_ids, ends)
                  if self.lora is not None else [])
        if grouped:
            expert_out = self._grouped(rows, torch.searchsorted(sorted_ids, ends, out_int32=True),
                                       sorted_ids.clamp(max=num_local - 1), deltas)
        else:
            counts = torch.bincount(flat_ids, minlength=num_local + 1)[:num_local]
            expert_out = self._per_expert(rows, counts.tolist(), deltas)
        if self.expert_parallel:
            # The rows routed elsewhere were not computed (whatever they hold): they add nothing here.
            expert_out = torch.where((sorted_ids < num_local).unsqueeze(1), expert_out, 0)
        out = torch.zeros_like(hidden)
        return out.index_add_(0, tokens, expert_out if self.weights_on_inputs else expert_out.mul_(weights))

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not self.gated:  # (relu2: the up rows alone)
            return torch.relu(gate_up).square_()
        gate, up = gate_up.chunk(2, dim=-1)
        if self.activation == "swigluoai":
            return swiglu_oai(gate, up, self.swiglu_alpha, self.swiglu_limit)
        if self.activation == "gelu_pytorch_tanh":  # (Gemma 4's experts)
            return F.gelu(gate, approximate="tanh").mul_(up)
        if self.activation == "silu_clamped":  # (Ling 3's: clipped after the activation, at swiglu_limit)
            return clamped_silu_and_mul(gate, up, self.swiglu_limit)
        return F.silu(gate).mul_(up)

    def _grouped(self, rows: torch.Tensor, offsets: torch.Tensor, row_experts: torch.Tensor,
                 deltas: list[ExpertsDelta]) -> torch.Tensor:
        """``row_experts``: each row's local expert (any for the rows another rank computes)."""
        # [experts, in, out] views: on the CPU, the storage itself.
        gate_up = F.grouped_mm(rows, self.w13_weight.transpose(1, 2), offs=offsets)
        if self.w13_bias is not None:
            gate_up += self.w13_bias.index_select(0, row_experts)
        for delta in deltas:
            delta.add_grouped(gate_up, rows, delta.gate_up, offsets)
        activated = self._act(gate_up)
        out = F.grouped_mm(activated, self.w2_weight.transpose(1, 2), offs=offsets)
        if self.w2_bias is not None:
            out += self.w2_bias.index_select(0, row_experts)
        for delta in deltas:
            delta.add_grouped(out, activated, delta.down, offsets)
        return out

    def _per_expert(self, rows: torch.Tensor, counts: list[int], deltas: list[ExpertsDelta]) -> torch.Tensor:
        out = torch.empty_like(rows)
        end = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            start, end = end, end + count
            part = slice(start, end)
            if self.w13_bias is None:
                gate_up = F.linear(rows[part], self.w13_weight[expert])
            else:
                gate_up = F.linear(rows[part], self.w13_weight[expert], self.w13_bias[expert])
            for delta in deltas:
                delta.add_one_expert(gate_up, rows[part], delta.gate_up, expert, part)
            activated = self._act(gate_up)
            if self.w2_bias is None:
                torch.mm(activated, self.w2_weight[expert].t(), out=out[part])
            else:
                out[part] = F.linear(activated, self.w2_weight[expert], self.w2_bias[expert])
            for delta in deltas:
                delta.add_one_expert(out[part], activated, delta.down, expert, part)
        return out
