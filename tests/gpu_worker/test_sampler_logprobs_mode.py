"""--logprobs-mode in the Sampler (and the rejection sampler): each mode's values checked against a
hand computation with torch, for an all-random batch (penalty, bias, temperature, top-k, top-p),
a mixed greedy/random batch and an all-greedy batch, as vLLM v1's sampler reports them."""

from __future__ import annotations

import pytest
import torch

from engine_core.config import LOGPROBS_MODES
from gpu_worker.rejection_sampler import rejection_sample, rejection_sample_with_logits
from gpu_worker.sampler import Sampler, SamplingMetadata

V = 40
NEG_INF = float("-inf")


@pytest.fixture
def logits() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(4, V) * 2


def metadata(temps: list[float], top_k: list[int] | None = None, top_p: list[float] | None = None,
             k: int = 3, **kw) -> SamplingMetadata:
    t = torch.tensor(temps)
    return SamplingMetadata(
        temperature=t, all_greedy=all(x == 0 for x in temps), all_random=all(x > 0 for x in temps),
        top_k=None if top_k is None else torch.tensor(top_k), top_p=None if top_p is None else torch.tensor(top_p),
        max_num_logprobs=k, **kw)


def filtered(row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """One row through top-k then top-p, by hand: a token survives top-k when fewer than k tokens
    beat it, and top-p when the tokens more likely than it hold less than p of the mass."""
    row = row.clone()
    if top_k > 0:
        beaten_by = (row.unsqueeze(0) > row.unsqueeze(1)).sum(dim=1)
        row[beaten_by >= top_k] = NEG_INF
    if top_p < 1.0:
        probs = row.softmax(-1)
        more_likely_mass = torch.stack([probs[probs > probs[i]].sum() for i in range(row.shape[0])])
        row[more_likely_mass >= top_p] = NEG_INF
    return row


def penalised(logits: torch.Tensor) -> torch.Tensor:
    """The constraints the tests set: logit_bias +3 on token 7 of row 0, frequency penalty 0.5 on
    row 1 (its output: token 2 twice, token 9 once), token 11 banned on row 2."""
    c = logits.clone()
    c[0, 7] += 3.0
    c[1, 2] -= 0.5 * 2
    c[1, 9] -= 0.5
    c[2, 11] = NEG_INF
    return c


def constraints(n: int = 4) -> dict:
    out = torch.full((n, 3), V)  # (padded with the vocabulary size)
    out[1] = torch.tensor([2, 2, 9])
    return dict(logit_bias=(torch.tensor([0]), torch.tensor([7]), torch.tensor([3.0])),
                frequency_penalties=torch.tensor([0.0, 0.5, 0.0, 0.0][:n]), output_token_ids=out,
                banned_tokens=(torch.tensor([2]), torch.tensor([11])))


def check(out, values: torch.Tensor, k: int) -> None:
    """The sampler's logprobs are ``values``' at its tokens, with their ranks and the k best."""
    tokens = out.sampled_token_ids
    torch.testing.assert_close(out.sampled_logprobs, values.gather(1, tokens[:, None])[:, 0])
    top, top_ids = values.topk(k)
    torch.testing.assert_close(out.top_logprobs, top)
    assert torch.equal(out.top_token_ids, top_ids)
    expected_ranks = (values >= values.gather(1, tokens[:, None])).sum(dim=1)
    assert torch.equal(out.sampled_ranks, expected_ranks)


def test_each_mode_against_a_hand_computation_penalty_temperature_top_k_top_p(logits):
    temps, top_k, top_p = [0.7, 1.3, 0.5, 1.0], [5, 0, 8, 4], [0.9, 0.6, 1.0, 0.95]
    constrained = penalised(logits)
    processed = torch.stack([filtered(constrained[i] / temps[i], top_k[i], top_p[i]) for i in range(4)])
    expected = {"raw_logprobs": logits.log_softmax(-1), "raw_logits": logits,
                "processed_logprobs": processed.log_softmax(-1), "processed_logits": processed}
    for mode in LOGPROBS_MODES:
        for seed in range(5):
            torch.manual_seed(seed)
            out = Sampler(mode)(logits.clone(), metadata(temps, top_k, top_p, **constraints()))
            check(out, expected[mode], 3)
            # Every token drawn survives the filters (its processed logprob is finite).
            assert torch.isfinite(processed.gather(1, out.sampled_token_ids[:, None])).all()
    # The processed logprobs are really another distribution: the filtered tokens at -inf, the
    # kept ones more likely than in the raw one.
    assert torch.isinf(processed).any() and not torch.isinf(logits).any()
    torch.manual_seed(0)
    raw = Sampler()(logits.clone(), metadata(temps, top_k, top_p, **constraints()))
    torch.manual_seed(0)
    done = Sampler("processed_logprobs")(logits.clone(), metadata(temps, top_k, top_p, **constraints()))
    assert torch.equal(raw.sampled_token_ids, done.sampled_token_ids)  # (the mode changes no draw)
    assert (done.sampled_logprobs > raw.sampled_logprobs).all()


def test_a_mixed_batch_greedy_rows_at_temperature_one_and_unfiltered(logits):
    """vLLM: in a batch that is not all greedy, the processed logits of a greedy row are its
    constrained logits divided by 1 (a greedy request's top-k, top-p and min-p are off); its token
    is their argmax."""
    temps, top_k, top_p = [0.0, 0.8, 0.0, 1.5], [0, 6, 0, 3], [1.0, 0.9, 1.0, 1.0]
    constrained = penalised(logits)
    processed = torch.stack([filtered(constrained[i] / (temps[i] or 1.0), top_k[i], top_p[i]) for i in range(4)])
    for mode in ("processed_logprobs", "processed_logits"):
        out = Sampler(mode)(logits.clone(), metadata(temps, top_k, top_p, k=4, **constraints()))
        check(out, processed if mode == "processed_logits" else processed.log_softmax(-1), 4)
        assert out.sampled_token_ids[[0, 2]].tolist() == constrained[[0, 2]].argmax(-1).tolist()
    # (Greedy rows: nothing filtered, only row 2's banned token at -inf; random rows filtered.)
    assert torch.isinf(processed[[0, 2]]).nonzero().tolist() == [[1, 11]]
    assert torch.isinf(processed[1]).any() and torch.isinf(processed[3]).any()


def test_an_all_greedy_batch_reports_the_constrained_logits_without_temperature(logits):
    constrained = penalised(logits)
    md = metadata([0.0] * 4, k=2, **constraints())
    for mode, expected in (("processed_logprobs", constrained.log_softmax(-1)), ("processed_logits", constrained),
                           ("raw_logprobs", logits.log_softmax(-1)), ("raw_logits", logits)):
        out = Sampler(mode)(logits.clone(), md)
        assert torch.equal(out.sampled_token_ids, constrained.argmax(-1))
        check(out, expected, 2)
    # (The constraints change the greedy picks' logprobs: processed differs from raw.)
    assert not torch.allclose(Sampler("processed_logprobs")(logits.clone(), md).sampled_logprobs,
                              Sampler()(logits.clone(), md).sampled_logprobs)


def test_min_p_comes_after_temperature_and_before_top_k(logits):
    temps = [0.5, 2.0, 1.0, 0.9]
    min_p = torch.tensor([0.1, 0.3, 0.0, 0.05])
    scaled = logits / torch.tensor(temps)[:, None]
    probs = scaled.softmax(-1)
    after_min_p = scaled.masked_fill(probs < probs.amax(-1, keepdim=True) * min_p[:, None], NEG_INF)
    processed = torch.stack([filtered(after_min_p[i], 6, 1.0) for i in range(4)])
    out = Sampler("processed_logits")(logits.clone(), metadata(temps, [6] * 4, min_p=min_p))
    check(out, processed, 3)


def test_no_logprobs_asked_returns_none_and_a_bad_mode_is_refused(logits):
    md = metadata([0.7] * 4, [5] * 4)
    md.max_num_logprobs = None
    assert Sampler("processed_logprobs")(logits, md).sampled_logprobs is None
    with pytest.raises(ValueError, match="logprobs_mode must be one of raw_logprobs, raw_logits"):
        Sampler("processed")


def test_the_rejection_sampler_returns_the_processed_logits_its_distribution_came_from(logits):
    """Rows: request A (temperature 0.8, top-k 4) with 2 drafts, request B (greedy) with 0: the
    processed rows are A's tempered and filtered logits, B's divided by 1; the tokens are those
    rejection_sample draws with the same random state."""
    temps, top_k = [0.8, 0.8, 0.8, 0.0], [4, 4, 4, 0]
    md = metadata(temps, top_k)
    drafts = [[int(logits[0].argmax()), int(logits[1].argmax())], []]
    torch.manual_seed(1)
    tokens = rejection_sample(logits.clone(), md, drafts)
    torch.manual_seed(1)
    same, processed = rejection_sample_with_logits(logits.clone(), md, drafts)
    assert same == tokens
    expected = torch.stack([filtered(logits[i] / (temps[i] or 1.0), top_k[i], 1.0) for i in range(4)])
    torch.testing.assert_close(processed, expected)
    greedy = metadata([0.0] * 4)
    assert torch.equal(rejection_sample_with_logits(logits.clone(), greedy, [[1, 2, 3]])[1], logits)
