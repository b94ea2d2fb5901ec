"""Verifying drafts: greedy exactness, the target distribution under sampling, and seeds."""

from __future__ import annotations

import torch

from gpu_worker.rejection_sampler import rejection_sample
from gpu_worker.sampler import SamplingMetadata

V = 6


def md(temps: list[float], **kw) -> SamplingMetadata:
    t = torch.tensor(temps)
    return SamplingMetadata(temperature=t, all_greedy=bool((t == 0).all()), all_random=bool((t > 0).all()), **kw)


def one_hot_logits(argmaxes: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), V)
    for row, token in enumerate(argmaxes):
        logits[row, token] = 5.0
    return logits


def test_greedy_accepts_drafts_while_they_equal_the_argmax():
    # Request 1: drafts 1, 2, 3 against argmaxes 1, 2, 4 (then 5): 1 and 2 kept, then 4.
    # Request 2: no drafts: its argmax. Request 3: drafts 0, 0 all accepted, plus the bonus 3.
    logits = one_hot_logits([1, 2, 4, 5, 2, 0, 0, 3])
    out = rejection_sample(logits, md([0.0] * 8), [[1, 2, 3], [], [0, 0]])
    assert out == [[1, 2, 4], [2], [0, 0, 3]]
    # The first draft rejected: only the target's own token.
    assert rejection_sample(one_hot_logits([3, 1]), md([0.0, 0.0]), [[2]]) == [[3]]


def test_greedy_rows_beside_random_rows_keep_greedy_semantics():
    # The general path (one-hot targets for greedy rows) must agree with the all-greedy one.
    logits = one_hot_logits([1, 2, 4, 5, 3])
    for _ in range(20):
        out = rejection_sample(logits, md([0.0, 0.0, 0.0, 0.0, 1.0]), [[1, 2, 3], []])
        assert out[0] == [1, 2, 4] and len(out[1]) == 1


def test_sampled_tokens_follow_the_target_distribution():
    """Each output position is distributed as the target model's own sampling would be, whatever
    the draft: the first token (accepted draft or residual draw) follows p_0, and the draft is
    accepted with probability p_0(draft)."""
    torch.manual_seed(1234)
    p0 = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.15, 0.05])
    p1 = torch.tensor([0.3, 0.1, 0.1, 0.1, 0.2, 0.2])
    n = 20000
    logits = torch.stack([p0.log(), p1.log()] * n)  # one draft per request: two rows each
    out = rejection_sample(logits, md([1.0] * 2 * n), [[3]] * n)
    first = torch.tensor([o[0] for o in out])
    freq = torch.bincount(first, minlength=V).float() / n
    assert torch.allclose(freq, p0, atol=0.015), freq
    accepted = [o for o in out if len(o) == 2]
    assert abs(len(accepted) / n - float(p0[3])) < 0.015
    # After an accepted draft, the bonus token follows p_1.
    bonus = torch.bincount(torch.tensor([o[1] for o in accepted]), minlength=V).float() / len(accepted)
    assert torch.allclose(bonus, p1, atol=0.03), bonus


def test_temperature_top_k_and_masks_shape_the_target():
    # top_k=1 makes sampling greedy: a draft that is not the argmax is never accepted.
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.0, 0.0, 0.0]] * 2)
    m = md([1.0, 1.0], top_k=torch.tensor([1, 1]))
    assert all(rejection_sample(logits, m, [[1]]) == [[2]] for _ in range(20))
    # A banned token is never drawn, as a draft or otherwise.
    m = md([1.0, 1.0], banned_tokens=(torch.tensor([0, 1]), torch.tensor([2, 2])))
    for _ in range(50):
        (toks,) = rejection_sample(logits, m, [[2]])
        assert 2 not in toks


def _grammar(rows: list[int], allowed: list[set[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """A grammar bitmask (xgrammar's layout) for the given logits rows, one allowed set each."""
    words = torch.tensor([[sum(1 << t for t in tokens)] for tokens in allowed], dtype=torch.int32)
    return torch.tensor(rows), words


def test_each_row_of_a_structured_request_takes_its_own_grammar_mask():
    """A structured request's row j is masked with its grammar as of the position after draft j:
    the draft is accepted, and the recovered or bonus token drawn, among that row's tokens."""
    # Greedy. Row 0 allows 1 (the draft); row 1's argmax 3 is refused there, and of 2 and 5 the
    # grammar allows, 2 (the draft) is best; row 2 allows only 5: the bonus. A plain request beside.
    logits = torch.tensor([[0.0, 1.0, 0.0, 4.0, 0.0, 0.0],
                           [0.0, 0.0, 1.0, 5.0, 0.0, 0.5],
                           [0.0, 0.0, 0.0, 0.0, 5.0, 1.0],
                           [0.0, 0.0, 0.0, 5.0, 0.0, 0.0]])
    grammar = _grammar([0, 1, 2], [{1}, {2, 5}, {5}])
    assert rejection_sample(logits, md([0.0] * 4, grammar_bitmask=grammar), [[1, 2], []]) == [[1, 2, 5], [3]]
    # Random: row 0 allows 1 (the draft) and 2 evenly, row 1 only 4. An accepted draft is followed
    # by 4; a rejected one by 2, the only other token row 0's grammar allows.
    torch.manual_seed(0)
    logits = torch.zeros(2, V)
    m = md([1.0, 1.0], grammar_bitmask=_grammar([0, 1], [{1, 2}, {4}]))
    outs = [rejection_sample(logits, m, [[1]])[0] for _ in range(200)]
    assert {tuple(o) for o in outs} == {(1, 4), (2,)}


def test_seeded_requests_repeat_whatever_else_is_in_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, V)

    def run(extra_rows: int) -> list[int]:
        g = torch.Generator()
        g.manual_seed(7)
        rows = torch.cat([torch.randn(extra_rows, V), logits]) if extra_rows else logits
        drafts = [[]] * extra_rows + [[1, 2]]
        temps = [1.0] * (extra_rows + 3)
        generators = {extra_rows + i: g for i in range(3)}  # the request's settings on each of its rows
        return rejection_sample(rows, md(temps, generators=generators), drafts)[-1]

    assert run(0) == run(0) == run(2) == run(5)
