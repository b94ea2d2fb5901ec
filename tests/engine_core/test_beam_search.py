"""The beam search algorithm (engine_core.beam_search) on hand-made next-token tables."""

from __future__ import annotations

import itertools
import math

import pytest

from engine_core.beam_search import Beam, BeamSearch, beam_score

EOS = 9


def table(context: tuple[int, ...]) -> dict[int, float]:
    """A tiny language model: the next token's logprobs after ``context`` (prompt excluded). Greedy
    takes 1 (-0.4) and then finds only poor tokens; 2 (-0.6) leads to a sure 5."""
    if not context:
        return {1: math.log(0.6), 2: math.log(0.35), EOS: math.log(0.05)}
    if context[-1] == 1:
        return {3: math.log(0.32), 4: math.log(0.28), EOS: math.log(0.4)}
    if context[-1] == 2:
        return {5: math.log(0.98), EOS: math.log(0.02)}
    return {6: math.log(0.7), EOS: math.log(0.3)}


def run(search: BeamSearch, prompt: list[int], rounds: int, k: int = 4) -> list[Beam]:
    """Drive a search as an engine would: each live beam's sampled token is its best, with the next k."""
    for _ in range(rounds):
        if search.finished:
            break
        steps = []
        for beam in search.live:
            ranked = sorted(table(tuple(beam.tokens[len(prompt):])).items(), key=lambda x: -x[1])
            steps.append((ranked[0][0], ranked[0][1], ranked[1:k + 1]))
        search.advance(steps)
    return search.best()


def exhaustive(prompt: list[int], length: int, length_penalty: float) -> list[tuple[float, tuple[int, ...]]]:
    """Every continuation of up to ``length`` tokens (ended by EOS or by length), by vLLM's score."""
    scored = []
    for n in range(1, length + 1):
        for seq in itertools.product(*[[1, 2, 3, 4, 5, 6, EOS]] * n):
            if EOS in seq[:-1] or (n < length and seq[-1] != EOS):
                continue
            cum, ok = 0.0, True
            for i, token in enumerate(seq):
                lp = table(seq[:i]).get(token)
                if lp is None:
                    ok = False
                    break
                cum += lp
            if ok:
                beam = Beam(prompt + list(seq), cum, finish_reason="stop" if seq[-1] == EOS else "length")
                scored.append((beam_score(beam, length_penalty), seq))
    return sorted(scored, reverse=True)


def test_a_wide_enough_beam_finds_what_greedy_misses():
    prompt = [7, 7]
    greedy = run(BeamSearch(prompt, 1, {EOS}), prompt, 2)
    assert greedy[0].tokens[2:] == [1, 3]  # greedy follows 1, where only poor tokens come next
    best = run(BeamSearch(prompt, 2, {EOS}), prompt, 2)
    # 2 then 5 beats it, and greedy's answer is the runner-up: 1 then EOS scores less (-1.43 over
    # 3 tokens: the EOS's length does not count) than 1 then 3 (-1.65 over 4).
    assert [b.tokens[2:] for b in best] == [[2, 5], [1, 3]]
    assert best[0].cum_logprob == pytest.approx(math.log(0.35) + math.log(0.98))
    assert beam_score(best[0], 1.0) == pytest.approx((math.log(0.35) + math.log(0.98)) / 4)
    ended = Beam([7, 7, 1, EOS], math.log(0.6) + math.log(0.4), finish_reason="stop")
    assert beam_score(ended, 1.0) == pytest.approx((math.log(0.6) + math.log(0.4)) / 3)
    assert beam_score(best[0], 1.0) > beam_score(best[1], 1.0) > beam_score(ended, 1.0)
    # Scored without normalising length, the EOS ending wins over 1 then 3.
    unnormalised = run(BeamSearch(prompt, 2, {EOS}, length_penalty=0.0), prompt, 2)
    assert [b.tokens[2:] for b in unnormalised] == [[2, 5], [1, EOS]]
    assert [b.finish_reason for b in unnormalised] == ["length", "stop"] and unnormalised[1].stop_reason == EOS


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_a_search_as_wide_as_the_tree_finds_the_exhaustive_best(length_penalty):
    """With room for every branch, the answer is the true top by vLLM's score (cumulative logprob
    over the sequence's length with the prompt, the EOS not counted, to the power length_penalty)."""
    prompt = [7, 7, 7]
    best = run(BeamSearch(prompt, 8, {EOS}, length_penalty), prompt, 3, k=8)
    truth = exhaustive(prompt, 3, length_penalty)
    assert [tuple(b.tokens[3:]) for b in best[:3]] == [seq for _, seq in truth[:3]]
    assert [beam_score(b, length_penalty) for b in best[:3]] == pytest.approx([s for s, _ in truth[:3]])


def test_ended_beams_keep_only_the_width_best_and_without_stop_ids_nothing_ends():
    prompt = [7]
    search = BeamSearch(prompt, 1, {EOS})
    run(search, prompt, 3)
    assert len(search.ended) == 1  # of the EOS endings seen, only the best can still win
    ignoring = run(BeamSearch(prompt, 2, set()), prompt, 3)
    assert all(b.finish_reason == "length" and len(b.tokens) == 4 for b in ignoring)


def test_each_beam_keeps_its_steps_and_the_sampled_token_counts_once():
    search = BeamSearch([1], 2, set())
    # The sampled token repeated among the alternatives is one candidate, not two.
    search.advance([(4, -0.1, [(4, -0.1), (5, -0.2), (6, -3.0)])])
    assert [b.tokens for b in search.live] == [[1, 4], [1, 5]]
    assert search.live[1].steps == [(5, -0.2, [(4, -0.1), (5, -0.2), (6, -3.0)])]
    with pytest.raises(ValueError, match="live beams"):
        search.advance([(4, -0.1, [])])
    with pytest.raises(ValueError, match="at least 1"):
        BeamSearch([1], 0, set())


def test_only_the_first_candidates_of_each_step_compete():
    """A step may list more alternatives than compete (the logprobs a client asked to see): an
    end of sequence among the extra ones ends no beam."""
    search = BeamSearch([7] * 50, 1, {EOS})
    assert search.num_candidates == 2  # vLLM's 2 x width
    search.advance([(1, -0.5, [(1, -0.5), (2, -1.0), (3, -2.0), (4, -3.0), (EOS, -3.5)])])
    assert search.ended == [] and [b.tokens[50:] for b in search.live] == [[1]]
    wider = BeamSearch([7] * 50, 1, {EOS}, num_candidates=5)
    wider.advance([(1, -0.5, [(1, -0.5), (2, -1.0), (3, -2.0), (4, -3.0), (EOS, -3.5)])])
    assert [b.tokens[50:] for b in wider.ended] == [[EOS]]
