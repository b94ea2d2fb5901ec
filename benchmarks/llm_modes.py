"""What the offline comparison benchmarks share: each way of serving ("mode") keeps its own
in-process engine for the whole run, and timed rounds alternate between the modes, each round
starting one mode later, so a noisy spell on a shared machine (or a mode's place in the round)
hits all of them alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from cluster import LLM, SamplingParams


class LLMMode:
    """One mode: its engine, the output tokens/s of each timed run, the answers of the last one."""

    def __init__(self, name: str, llm: LLM, **generate_kwargs: Any) -> None:
        self.name, self.llm, self.generate_kwargs = name, llm, generate_kwargs
        self.rates: list[float] = []
        self.answers: list[list[int]] = []

    def run(self, prompts: list[list[int]], params: SamplingParams) -> None:
        t0 = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False, **self.generate_kwargs)
        elapsed = time.perf_counter() - t0
        self.rates.append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
        self.answers = [o.outputs[0].token_ids for o in outputs]

    @property
    def rate(self) -> float:
        return statistics.median(self.rates)


def run_alternating(modes: Sequence[LLMMode], warmup_prompts: list[list[int]], prompts: list[list[int]],
                    params: SamplingParams, rounds: int) -> None:
    """A short untimed warm-up of every mode, then ``rounds`` rotated rounds; the engines are shut
    down at the end, whatever happens."""
    try:
        for mode in modes:
            mode.run(warmup_prompts, SamplingParams(max_tokens=2, temperature=0.0))
            mode.rates.clear()
        for r in range(rounds):
            for mode in [*modes[r % len(modes):], *modes[:r % len(modes)]]:
                mode.run(prompts, params)
    finally:
        for mode in modes:
            mode.llm.shutdown()
