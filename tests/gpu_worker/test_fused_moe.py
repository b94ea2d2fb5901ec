"""The routed experts (FusedMoE, select_experts) against a dense float64 reference, whole and split
over tensor-parallel ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.layers.fused_moe import ALL_EXPERTS, DOWN, GATE, UP, FusedMoE, select_experts

HIDDEN, INTERMEDIATE, EXPERTS = 12, 8, 6


def _checkpoint(seed: int = 0) -> dict[int, dict[int, torch.Tensor]]:
    """Per expert, its gate [I, H], up [I, H] and down [H, I] projections (HF layout)."""
    gen = torch.Generator().manual_seed(seed)
    return {e: {GATE: torch.randn(INTERMEDIATE, HIDDEN, generator=gen),
                UP: torch.randn(INTERMEDIATE, HIDDEN, generator=gen),
                DOWN: torch.randn(HIDDEN, INTERMEDIATE, generator=gen)} for e in range(EXPERTS)}


def _load(ckpt, top_k: int, tp_rank: int = 0, tp_size: int = 1) -> FusedMoE:
    moe = FusedMoE(EXPERTS, top_k, HIDDEN, INTERMEDIATE, tp_rank=tp_rank, tp_size=tp_size)
    for expert, projections in ckpt.items():
        for projection, weight in projections.items():
            param = moe.w2_weight if projection == DOWN else moe.w13_weight
            moe.weight_loader(param, weight, (expert, projection))
    return moe


def _dense_reference(ckpt, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Every token through each expert it chose, one at a time, in float64."""
    x = x.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            w = {p: m.double() for p, m in ckpt[int(ids[t, k])].items()}
            h = F.silu(x[t] @ w[GATE].T) * (x[t] @ w[UP].T)
            out[t] += float(weights[t, k]) * (h @ w[DOWN].T)
    return out


def _routing(num_tokens: int, top_k: int, seed: int = 1, unused: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, EXPERTS, generator=gen)
    if unused is not None:
        logits[:, unused] = -1e4  # an expert no token chooses: skipped
    return select_experts(logits, top_k, renormalize=True)


@pytest.mark.parametrize("num_tokens,top_k", [(1, 2), (17, 2), (9, 1), (5, EXPERTS)])
@pytest.mark.parametrize("grouped_mm", [None, False], ids=["grouped_mm", "per_expert"])
def test_experts_match_the_dense_reference(num_tokens, top_k, grouped_mm):
    ckpt = _checkpoint()
    moe = _load(ckpt, top_k)
    moe.grouped_mm = grouped_mm
    assert moe.use_grouped_mm(torch.zeros(1, HIDDEN)) is (grouped_mm is None)
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(2))
    weights, ids = _routing(num_tokens, top_k, unused=3 if top_k < EXPERTS else None)
    if top_k < EXPERTS:
        assert not (ids == 3).any()
    out = moe.forward(x, weights, ids)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), _dense_reference(ckpt, x, weights, ids), atol=1e-4, rtol=1e-4)


def test_tensor_parallel_ranks_sum_to_the_whole():
    """Each rank holds its slice of every expert's intermediate dimension; the all-reduce of their
    partial outputs (summed here, ranks built in one process) is the unsplit output."""
    ckpt = _checkpoint()
    x = torch.randn(11, HIDDEN)
    weights, ids = _routing(11, 2)
    whole = _load(ckpt, 2).forward(x, weights, ids)
    ranks = [_load(ckpt, 2, rank, 2) for rank in range(2)]
    assert ranks[0].w13_weight.shape == (EXPERTS, INTERMEDIATE, HIDDEN)  # gate and up halves
    torch.testing.assert_close(ranks[1].w2_weight[4], ckpt[4][DOWN][:, INTERMEDIATE // 2:])
    torch.testing.assert_close(ranks[1].w13_weight[4][: INTERMEDIATE // 2], ckpt[4][GATE][INTERMEDIATE // 2:])
    partial = [rank.forward(x, weights, ids) for rank in ranks]
    torch.testing.assert_close(partial[0] + partial[1], whole, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        FusedMoE(EXPERTS, 2, HIDDEN, INTERMEDIATE, tp_rank=0, tp_size=3)


def test_select_experts_takes_the_softmax_top_k():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 4.0]])
    probs = torch.softmax(logits, dim=-1)
    weights, ids = select_experts(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2], [2, 3]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    renormalised, same_ids = select_experts(logits.bfloat16(), 2, renormalize=True)
    assert renormalised.dtype == torch.float32 and torch.equal(same_ids, ids)
    torch.testing.assert_close(renormalised.sum(-1), torch.ones(2))
    torch.testing.assert_close(renormalised, weights / weights.sum(-1, keepdim=True), atol=1e-2, rtol=1e-2)


def test_the_loader_refuses_what_it_cannot_place():
    moe = FusedMoE(EXPERTS, 2, HIDDEN, INTERMEDIATE)
    gate = torch.randn(INTERMEDIATE, HIDDEN)
    with pytest.raises(ValueError, match="shard_id"):
        moe.weight_loader(moe.w13_weight, gate, 0)
    with pytest.raises(ValueError, match="expert 6 is out of range"):
        moe.weight_loader(moe.w13_weight, gate, (EXPERTS, GATE))
    with pytest.raises(ValueError, match="shape mismatch loading up_proj"):
        moe.weight_loader(moe.w13_weight, torch.randn(INTERMEDIATE, HIDDEN + 1), (0, UP))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        FusedMoE(EXPERTS, EXPERTS + 1, HIDDEN, INTERMEDIATE)
    assert moe.w13_weight.expected_shards == {(e, p) for e in range(EXPERTS) for p in (GATE, UP)}


@pytest.mark.parametrize("grouped_mm", [None, False], ids=["grouped_mm", "per_expert"])
def test_expert_parallel_ranks_hold_whole_experts_and_sum_to_the_whole(grouped_mm):
    """--enable-expert-parallel: rank r of 2 holds experts 3r..3r+2 whole and computes only the
    pairs routed to them; the sum of the ranks' outputs is the unsplit output."""
    ckpt = _checkpoint()
    x = torch.randn(13, HIDDEN)
    weights, ids = _routing(13, 2)
    assert (ids < 3).any() and (ids >= 3).any()
    whole = _load(ckpt, 2).forward(x, weights, ids)
    partial = []
    for rank in range(2):
        moe = FusedMoE(EXPERTS, 2, HIDDEN, INTERMEDIATE, tp_rank=rank, tp_size=2, expert_parallel=True)
        moe.grouped_mm = grouped_mm
        assert (moe.num_local_experts, moe.first_expert) == (3, 3 * rank)
        assert moe.w13_weight.shape == (3, 2 * INTERMEDIATE, HIDDEN)
        for expert, projections in ckpt.items():
            for projection, weight in projections.items():
                moe.weight_loader(moe.w2_weight if projection == DOWN else moe.w13_weight, weight,
                                  (expert, projection))
        torch.testing.assert_close(moe.w2_weight[1], ckpt[3 * rank + 1][DOWN])
        partial.append(moe.forward(x, weights, ids))
    torch.testing.assert_close(partial[0] + partial[1], whole, atol=1e-5, rtol=1e-5)
    # A token routed only to the other rank's experts gets nothing from this one.
    only_rank1 = ((ids >= 3).all(dim=1)).nonzero().flatten()
    assert len(only_rank1) and torch.equal(partial[0][only_rank1], torch.zeros(len(only_rank1), HIDDEN))
    with pytest.raises(ValueError, match=r"num_experts \(expert parallel\) \(6\) must be divisible"):
        FusedMoE(EXPERTS, 2, HIDDEN, INTERMEDIATE, tp_rank=0, tp_size=4, expert_parallel=True)


def test_stacked_experts_load_per_rank_in_either_layout():
    """transformers 5's stacked tensors: a rank takes its slice of every expert's width, or its
    experts whole under expert parallelism."""
    ckpt = _checkpoint()
    gate_up = torch.stack([torch.cat([ckpt[e][GATE], ckpt[e][UP]]) for e in range(EXPERTS)])
    down = torch.stack([ckpt[e][DOWN] for e in range(EXPERTS)])
    for expert_parallel in (False, True):
        moe = FusedMoE(EXPERTS, 2, HIDDEN, INTERMEDIATE, tp_rank=1, tp_size=2, expert_parallel=expert_parallel)
        moe.weight_loader(moe.w13_weight, gate_up, (ALL_EXPERTS, GATE))
        moe.weight_loader(moe.w2_weight, down, (ALL_EXPERTS, DOWN))
        reference = FusedMoE(EXPERTS, 2, HIDDEN, INTERMEDIATE, tp_rank=1, tp_size=2, expert_parallel=expert_parallel)
        for expert, projections in ckpt.items():
            for projection, weight in projections.items():
                reference.weight_loader(reference.w2_weight if projection == DOWN else reference.w13_weight, weight,
                                        (expert, projection))
        assert torch.equal(moe.w13_weight, reference.w13_weight) and torch.equal(moe.w2_weight, reference.w2_weight)


def test_grouped_mm_is_used_only_where_it_runs_and_the_loop_covers_the_rest():
    """grouped_mm needs rows a multiple of 16 bytes wide and fp32/bf16/fp16 on the CPU: an odd
    width (6 fp32 values: 24 bytes) or float64 takes the per-expert loop, with the same result."""
    ckpt = {e: {p: w[:6] if p != DOWN else w[:, :6] for p, w in ws.items()} for e, ws in _checkpoint().items()}
    odd = FusedMoE(EXPERTS, 2, HIDDEN, 6)
    for expert, projections in ckpt.items():
        for projection, weight in projections.items():
            odd.weight_loader(odd.w2_weight if projection == DOWN else odd.w13_weight, weight, (expert, projection))
    x = torch.randn(7, HIDDEN)
    weights, ids = _routing(7, 2)
    assert not odd.use_grouped_mm(x)
    torch.testing.assert_close(odd.forward(x, weights, ids).double(), _dense_reference(ckpt, x, weights, ids),
                               atol=1e-4, rtol=1e-4)
    assert not odd.use_grouped_mm(x.double())
    aligned = _load(_checkpoint(), 2)  # 12 and 8 values wide: 48 and 32 bytes in fp32
    assert aligned.use_grouped_mm(x) and aligned.use_grouped_mm(torch.zeros(1, 16, dtype=torch.bfloat16))
    assert not aligned.use_grouped_mm(x.bfloat16())  # 12 bf16 values: 24 bytes
    assert not aligned.use_grouped_mm(x.double())


def _biased_reference(ckpt, biases, x, weights, ids, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's experts in float64: biases on both projections, the clamped SwiGLU."""
    x = x.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            w = {p: m.double() for p, m in ckpt[e].items()}
            gate = (x[t] @ w[GATE].T + biases[e][GATE].double()).clamp(max=limit)
            up = (x[t] @ w[UP].T + biases[e][UP].double()).clamp(-limit, limit)
            h = (up + 1) * gate * torch.sigmoid(gate * alpha)
            out[t] += float(weights[t, k]) * (h @ w[DOWN].T + biases[e][DOWN].double())
    return out


@pytest.mark.parametrize("grouped_mm", [None, False], ids=["grouped_mm", "per_expert"])
@pytest.mark.parametrize("split", ["whole", "width", "experts"])
def test_biased_experts_with_the_clamped_swiglu(grouped_mm, split):
    """GPT-OSS: a bias on every expert's gate/up and down projections, (up + 1) * g * sigmoid(alpha g)
    with g and up clamped (a clamp of 1.5 binds on these inputs); split over two ranks by width (the
    down bias on rank 0 only) or by experts, the ranks' sum is the dense reference."""
    ckpt = _checkpoint()
    gen = torch.Generator().manual_seed(5)
    biases = {e: {GATE: torch.randn(INTERMEDIATE, generator=gen), UP: torch.randn(INTERMEDIATE, generator=gen),
                  DOWN: torch.randn(HIDDEN, generator=gen)} for e in range(EXPERTS)}
    gate_up = torch.stack([torch.cat([ckpt[e][GATE], ckpt[e][UP]]) for e in range(EXPERTS)])
    gate_up_bias = torch.stack([torch.cat([biases[e][GATE], biases[e][UP]]) for e in range(EXPERTS)])
    down = torch.stack([ckpt[e][DOWN] for e in range(EXPERTS)])
    down_bias = torch.stack([biases[e][DOWN] for e in range(EXPERTS)])
    x = torch.randn(15, HIDDEN, generator=gen)
    weights, ids = _routing(15, 2)
    ranks = [(0, 1)] if split == "whole" else [(0, 2), (1, 2)]
    out = torch.zeros(15, HIDDEN)
    for rank, size in ranks:
        moe = FusedMoE(EXPERTS, 2, HIDDEN, INTERMEDIATE, tp_rank=rank, tp_size=size, expert_parallel=split == "experts",
                       bias=True, activation="swigluoai", swiglu_alpha=1.702, swiglu_limit=1.5)
        moe.grouped_mm = grouped_mm
        moe.weight_loader(moe.w13_weight, gate_up, (ALL_EXPERTS, GATE))
        moe.weight_loader(moe.w2_weight, down, (ALL_EXPERTS, DOWN))
        moe.bias_loader(moe.w13_bias, gate_up_bias, (ALL_EXPERTS, GATE))
        moe.bias_loader(moe.w2_bias, down_bias, (ALL_EXPERTS, DOWN))
        if split == "width":
            assert bool(moe.w2_bias.any()) is (rank == 0)
        out += moe.forward(x, weights, ids)
    expected = _biased_reference(ckpt, biases, x, weights, ids, 1.702, 1.5)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(expected, _biased_reference(ckpt, biases, x, weights, ids, 1.702, 100.0), atol=1e-2)
    with pytest.raises(ValueError, match="activation"):
        FusedMoE(EXPERTS, 2, HIDDEN, INTERMEDIATE, activation="gelu")


@pytest.mark.parametrize("grouped_mm", [None, False], ids=["grouped_mm", "per_expert"])
@pytest.mark.parametrize("split", ["whole", "width", "experts"])
@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
def test_ungated_relu2_experts(grouped_mm, split, layout):
    """Nemotron 3 Nano's experts: down(relu(up x)^2), no gate; loaded per expert or stacked (up rows
    alone), whole or split over two ranks, the ranks' sum is the dense reference; a gate is refused."""
    ckpt = _checkpoint()
    x = torch.randn(13, HIDDEN, generator=torch.Generator().manual_seed(6))
    weights, ids = _routing(13, 2)
    ranks = [(0, 1)] if split == "whole" else [(0, 2), (1, 2)]
    out = torch.zeros(13, HIDDEN)
    for rank, size in ranks:
        moe = FusedMoE(EXPERTS, 2, HIDDEN, INTERMEDIATE, tp_rank=rank, tp_size=size, expert_parallel=split == "experts",
                       activation="relu2")
        moe.grouped_mm = grouped_mm
        if layout == "stacked":
            moe.weight_loader(moe.w13_weight, torch.stack([ckpt[e][UP] for e in range(EXPERTS)]), (ALL_EXPERTS, UP))
            moe.weight_loader(moe.w2_weight, torch.stack([ckpt[e][DOWN] for e in range(EXPERTS)]), (ALL_EXPERTS, DOWN))
        else:
            for e in range(EXPERTS):
                moe.weight_loader(moe.w13_weight, ckpt[e][UP], (e, UP))
                moe.weight_loader(moe.w2_weight, ckpt[e][DOWN], (e, DOWN))
        out += moe.forward(x, weights, ids)
    expected = torch.zeros(13, HIDDEN, dtype=torch.float64)
    for t in range(13):
        for k in range(2):
            w = {p: m.double() for p, m in ckpt[int(ids[t, k])].items()}
            expected[t] += float(weights[t, k]) * (torch.relu(x[t].double() @ w[UP].T) ** 2 @ w[DOWN].T)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="no gate_proj"):
        moe.weight_loader(moe.w13_weight, ckpt[0][GATE], (0, GATE))
