"""Beam search on engines that generate one token per request (vLLM's, which runs it in its front end).

Each round, every live beam is sent to an engine as a request for one token with the best
``candidates`` alternatives' logprobs (the prefix cache holds the beams' shared context, so only
their last tokens are computed). Each beam grows by each candidate; a candidate that is a stop
token ends its beam, the others compete and the ``width`` best by cumulative logprob go on. After
the last round the ``width`` best of the ended and the live beams, by vLLM's score (cumulative
logprob over the sequence's length, prompt included and a final stop token not, to the power
``length_penalty``), are the answer. Used by the router (``use_beam_search``) and by the offline
``LLM.beam_search``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# One generated token: its id, its logprob, and the alternatives the engine ranked for its position
# (id, logprob), best first.
BeamStep = tuple[int, float, list[tuple[int, float]]]


@dataclass
class Beam:
    tokens: list[int]  # the prompt's, then the generated ones
    cum_logprob: float = 0.0
    steps: list[BeamStep] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" once a stop token ended it; "length" when the rounds ran out
    stop_reason: int | None = None  # the stop token that ended it


def candidates_per_beam(width: int, max_logprobs: int) -> int:
    """The alternatives each round asks of the engines per beam (vLLM's 2 x width); ValueError when
    the engines' ``max_logprobs`` (-1: the vocabulary, resolved by the caller) allows fewer."""
    if 2 * width > max_logprobs:
        raise ValueError(f"beam width {width} asks the engines for {2 * width} alternatives per token, more than "
                         f"max_logprobs ({max_logprobs})")
    return 2 * width


def beam_score(beam: Beam, length_penalty: float) -> float:
    """vLLM's beam score: the cumulative logprob over the sequence's length (prompt included, the
    stop token that ended it not) to the power ``length_penalty``."""
    length = len(beam.tokens) - (1 if beam.finish_reason == "stop" else 0)
    return beam.cum_logprob / (length ** length_penalty)


class BeamSearch:
    """The state of one prompt's search: ``live`` beams wait for the next round's candidates."""

    def __init__(self, prompt: list[int], width: int, stop_token_ids: set[int], length_penalty: float = 1.0,
                 num_candidates: int | None = None) -> None:
        """``num_candidates``: the alternatives of each beam that compete (vLLM's 2 x width): a
        round's steps may list more (the logprobs a client asked to see), which do not count."""
        if width < 1:
            raise ValueError("beam width must be at least 1")
        self.width = width
        self.num_candidates = 2 * width if num_candidates is None else num_candidates
        self.stop_token_ids = stop_token_ids
        self.length_penalty = length_penalty
        self.num_prompt_tokens = len(prompt)
        self.live = [Beam(list(prompt))]
        self.ended: list[Beam] = []  # the best ``width`` beams a stop token ended (the others cannot win)

    def advance(self, steps: list[BeamStep]) -> None:
        """One round: ``steps[i]`` is what the engine gave live beam i (its sampled token, that
        token's logprob, and the best alternatives)."""
        if len(steps) != len(self.live):
            raise ValueError(f"{len(steps)} steps for {len(self.live)} live beams")
        grown: list[tuple[float, int, int, float, list[tuple[int, float]]]] = []
        for parent, (sampled, sampled_logprob, top) in enumerate(steps):
            beam = self.live[parent]
            seen: set[int] = set()
            for token, logprob in ((sampled, sampled_logprob), *top[:self.num_candidates]):
                if token in seen:
                    continue
                seen.add(token)
                if token in self.stop_token_ids:
                    self._end(Beam(beam.tokens + [token], beam.cum_logprob + logprob,
                                   beam.steps + [(token, logprob, top)], "stop", token))
                else:
                    grown.append((beam.cum_logprob + logprob, parent, token, logprob, top))
        # Live beams all have one length: the best cumulative logprobs are the best scores. Only
        # the survivors are built (a beam's lists are copied once per round, not per candidate).
        grown.sort(key=lambda g: g[0], reverse=True)
        self.live = [Beam(self.live[parent].tokens + [token], cum, self.live[parent].steps + [(token, logprob, top)])
                     for cum, parent, token, logprob, top in grown[:self.width]]

    def _end(self, beam: Beam) -> None:
        self.ended.append(beam)
        if len(self.ended) > self.width:  # an ended beam's score never changes: the worst can go
            self.ended.sort(key=lambda b: beam_score(b, self.length_penalty), reverse=True)
            del self.ended[self.width:]

    @property
    def finished(self) -> bool:
        return not self.live

    def best(self) -> list[Beam]:
        """The answer: the ``width`` best of the ended and the live beams, best first (the live
        ones marked as ended by length)."""
        for beam in self.live:
            beam.finish_reason = "length"
        return sorted(self.ended + self.live, key=lambda b: beam_score(b, self.length_penalty),
                      reverse=True)[:self.width]

    def generated(self, beam: Beam) -> list[int]:
        return beam.tokens[self.num_prompt_tokens:]
