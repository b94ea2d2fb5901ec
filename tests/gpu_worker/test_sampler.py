"""Sampler: greedy exactness, seeds, top-k/top-p/min-p, penalties, min_tokens, logprobs."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.sampler import Sampler, SamplingMetadata, apply_top_k_top_p

V = 32


def md(n: int, temperature: float = 1.0, **kw) -> SamplingMetadata:
    temps = torch.full((n,), temperature)
    return SamplingMetadata(temperature=temps, all_greedy=temperature == 0.0, all_random=temperature > 0.0, **kw)


def gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


@pytest.fixture
def logits() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(4, V) * 3


def test_greedy_is_argmax(logits):
    out = Sampler()(logits, md(4, temperature=0.0))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_mixed_greedy_and_random_rows(logits):
    m = md(4)
    m.temperature = torch.tensor([0.0, 1.0, 0.0, 1.0])
    m.all_random = False
    out = Sampler()(logits, m).sampled_token_ids
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_top_k_one_equals_greedy(logits):
    out = Sampler()(logits, md(4, temperature=1.5, top_k=torch.ones(4, dtype=torch.long)))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_tiny_top_p_and_full_min_p_equal_greedy(logits):
    assert torch.equal(Sampler()(logits, md(4, top_p=torch.full((4,), 1e-6))).sampled_token_ids, logits.argmax(-1))
    assert torch.equal(Sampler()(logits, md(4, min_p=torch.ones(4))).sampled_token_ids, logits.argmax(-1))


def test_top_k_top_p_keep_the_right_sets():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))
    kept = apply_top_k_top_p(logits, torch.tensor([2, 0]), None).isfinite()
    assert kept.tolist() == [[True, True, False, False], [True] * 4]
    kept = apply_top_k_top_p(logits, None, torch.tensor([0.75, 1.0])).isfinite()
    assert kept.tolist() == [[True, True, False, False], [True] * 4]


def test_seeded_rows_reproduce_and_ignore_batch_neighbours(logits):
    a = Sampler()(logits, md(4, generators={1: gen(7), 3: gen(8)})).sampled_token_ids
    b = Sampler()(logits, md(4, generators={1: gen(7), 3: gen(8)})).sampled_token_ids
    assert a[1] == b[1] and a[3] == b[3]
    # The same seeded request alone in a batch draws the same token.
    alone = Sampler()(logits[1:2], md(1, generators={0: gen(7)})).sampled_token_ids
    assert alone[0] == a[1]
    flat = torch.zeros(1, V)
    draws = {Sampler()(flat, md(1, generators={0: gen(s)})).sampled_token_ids.item() for s in range(20)}
    assert len(draws) > 5


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    logits = probs.log().expand(4000, 4).contiguous()
    torch.manual_seed(0)
    counts = torch.bincount(Sampler()(logits, md(4000)).sampled_token_ids, minlength=4).float() / 4000
    torch.testing.assert_close(counts, probs, atol=0.03, rtol=0)


def test_min_tokens_mask_blocks_eos():
    logits = torch.zeros(2, V)
    logits[:, 2] = 10.0  # EOS would win
    m = md(2, temperature=0.0, banned_tokens=(torch.tensor([0]), torch.tensor([2])))
    out = Sampler()(logits, m).sampled_token_ids
    assert out[0] != 2 and out[1] == 2


def test_penalties_match_their_definitions():
    torch.manual_seed(0)
    logits = torch.randn(1, 8) * 2
    prompt = torch.tensor([[1, 3, 8]])  # 8 = vocab size: padding
    output = torch.tensor([[3, 5, 5, 8]])
    m = md(1, temperature=0.0, output_token_ids=output, prompt_token_ids=prompt,
           repetition_penalties=torch.tensor([1.5]), frequency_penalties=torch.tensor([0.25]),
           presence_penalties=torch.tensor([0.5]))
    from gpu_worker.sampler import apply_penalties
    got = apply_penalties(logits.clone(), m)
    expected = logits.clone()
    for t in (1, 3, 5):  # repetition: prompt and output tokens
        x = expected[0, t]
        expected[0, t] = x / 1.5 if x > 0 else x * 1.5
    expected[0, 3] -= 0.25 * 1 + 0.5  # frequency and presence: output tokens only
    expected[0, 5] -= 0.25 * 2 + 0.5
    torch.testing.assert_close(got, expected)


def test_logprobs_are_log_softmax_of_raw_logits(logits):
    out = Sampler()(logits, md(4, temperature=0.7, max_num_logprobs=3))
    ref = logits.log_softmax(-1)
    torch.testing.assert_close(out.sampled_logprobs, ref.gather(1, out.sampled_token_ids[:, None])[:, 0])
    top_lp, top_ids = ref.topk(3)
    assert torch.equal(out.top_token_ids, top_ids)
    torch.testing.assert_close(out.top_logprobs, top_lp)


def test_tiny_temperatures_are_greedy_or_clamped_as_in_vllm():
    from engine_core.sampling_params import SamplingParams

    assert SamplingParams(temperature=0.0).greedy  # only 0 itself
    for tiny in (1e-40, 1e-6, 1e-3):  # raised to vLLM's floor, and still sampled
        params = SamplingParams(temperature=tiny)
        assert params.temperature == 0.01 and not params.greedy
    assert SamplingParams(temperature=0.7).temperature == 0.7
    for bad in (float("inf"), float("nan"), -0.1):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=bad)


def test_allowed_token_ids_limit_only_their_rows(logits):
    allowed = torch.zeros(1, V, dtype=torch.bool)
    allowed[0, [3, 7]] = True
    for temperature in (0.0, 1.0):
        m = md(4, temperature=temperature, allowed_token_ids=(torch.tensor([2]), allowed), max_num_logprobs=1)
        out = Sampler()(logits.clone(), m)
        assert out.sampled_token_ids[2].item() in (3, 7)
        if temperature == 0.0:
            others = [0, 1, 3]
            assert out.sampled_token_ids[others].tolist() == logits[others].argmax(dim=-1).tolist()
        # Logprobs stay those of the model's own distribution (vLLM's default), restricted or not.
        raw = logits.log_softmax(dim=-1)
        torch.testing.assert_close(out.sampled_logprobs, raw.gather(1, out.sampled_token_ids.unsqueeze(1)).squeeze(1))


def test_logit_bias_adds_to_the_logits_before_penalties_and_sampling():
    logits = torch.zeros(2, V)
    logits[:, 5] = 4.0
    # Row 0: +5 on token 9 beats token 5; row 1: -10 on token 5 leaves the rest tied (argmax: the first).
    m = md(2, temperature=0.0, logit_bias=(torch.tensor([0, 1]), torch.tensor([9, 5]), torch.tensor([5.0, -10.0])))
    assert Sampler()(logits, m).sampled_token_ids.tolist() == [9, 0]
    # A bias of -100 keeps a token out of random draws too.
    many = torch.zeros(2000, V)
    rows = torch.arange(2000).repeat_interleave(V - 1)
    cols = torch.arange(1, V).repeat(2000)
    m = md(2000, logit_bias=(rows, cols, torch.full((rows.numel(),), -100.0)))
    assert (Sampler()(many, m).sampled_token_ids == 0).all()


def test_the_grammar_bitmask_masks_as_xgrammar_does():
    import xgrammar as xgr

    from gpu_worker.sampler import unpack_bitmask

    torch.manual_seed(0)
    vocab = 77  # not a multiple of 32: the last word is partial
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32)
    logits = torch.randn(3, vocab)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask)
    ours = logits.masked_fill(~unpack_bitmask(bitmask, vocab), float("-inf"))
    assert torch.equal(ours, expected)
    # Through the sampler, only on the rows given.
    m = md(3, temperature=0.0, grammar_bitmask=(torch.tensor([1]), bitmask[1:2]))
    picks = Sampler()(logits.clone(), m).sampled_token_ids
    assert picks[1] == expected[1].argmax() and picks[0] == logits[0].argmax() and picks[2] == logits[2].argmax()


def test_ranks_count_the_tokens_at_least_as_likely_as_the_sampled_one_on_the_rows_asked():
    torch.manual_seed(1)
    logits = torch.randn(4, V)
    m = md(4, temperature=1.0, max_num_logprobs=0, logprob_rows=torch.tensor([1, 3]))
    out = Sampler()(logits.clone(), m)
    raw = logits.log_softmax(dim=-1)
    for row in (1, 3):
        sampled = out.sampled_token_ids[row]
        assert out.sampled_ranks[row] == int((raw[row] >= raw[row, sampled]).sum())
    assert out.sampled_ranks[0] == out.sampled_ranks[2] == 0  # (not asked: not computed)
    # Tied with another token, the greedy pick ranks 2, as vLLM counts (tokens >= it).
    tied = torch.zeros(1, V)
    tied[0, [3, 5]] = 2.0
    out = Sampler()(tied, md(1, temperature=0.0, max_num_logprobs=1))
    assert out.sampled_token_ids.tolist() == [3] and out.sampled_ranks.tolist() == [2]


def test_a_grammars_row_reports_logprobs_over_the_tokens_it_allows():
    """As vLLM's model runner masks the logits with the grammar before its sampler: the sampled
    token's logprob, rank and the best tokens are those of the allowed tokens alone."""
    from gpu_worker.sampler import unpack_bitmask

    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0] + [-5.0] * (V - 4)] * 2)
    bitmask = torch.tensor([[0b0110]], dtype=torch.int32)  # tokens 1 and 2
    assert unpack_bitmask(bitmask, V)[0].nonzero().flatten().tolist() == [1, 2]
    m = md(2, temperature=0.0, max_num_logprobs=2, grammar_bitmask=(torch.tensor([0]), bitmask))
    out = Sampler()(logits.clone(), m)
    assert out.sampled_token_ids.tolist() == [1, 0]
    allowed = logits[0, [1, 2]].log_softmax(dim=-1)
    torch.testing.assert_close(out.sampled_logprobs[0], allowed[0])
    assert out.top_token_ids[0].tolist() == [1, 2] and out.sampled_ranks[0] == 1
    torch.testing.assert_close(out.top_logprobs[0], allowed)
    torch.testing.assert_close(out.sampled_logprobs[1], logits[1].log_softmax(dim=-1)[0])  # (no grammar: raw)


def test_min_tokens_keeps_eos_out_under_ignore_eos_too():
    """As vLLM's min-tokens processor, whose stop ids always hold the EOS ids: ignore_eos lets an
    answer run past EOS, but its first min_tokens tokens are still not EOS."""
    from engine_core.sampling_params import SamplingParams
    from gpu_worker.request_state import RequestStates

    states = RequestStates((2,), torch.device("cpu"))
    for ignore_eos in (False, True):
        params = SamplingParams(max_tokens=10, min_tokens=5, ignore_eos=ignore_eos, stop_token_ids=[7])
        assert states._stop_ids(params, request_eos=9) == (2, 9, 7)
    assert states._stop_ids(SamplingParams(max_tokens=10, ignore_eos=True)) == ()
