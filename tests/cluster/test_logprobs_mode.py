"""--logprobs-mode end to end (the offline LLM on the tiny model, transformers as the reference):
processed logprobs are those of the distribution a token is drawn from (temperature, top-k), raw
ones the model's; prompt logprobs stay raw; drafts (speculative decoding) report the same."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster import LLM, SamplingParams
from tests.cluster.test_llm import PROMPTS

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
RANDOM = dict(max_tokens=6, temperature=0.8, top_k=5, seed=3, ignore_eos=True, logprobs=3, prompt_logprobs=1)
# A greedy request's top_k is off (vLLM's SamplingParams): its processed logprobs are unfiltered.
GREEDY = dict(max_tokens=6, temperature=0.0, top_k=2, ignore_eos=True, logprobs=3)


def hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def processed(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """By hand: divided by the temperature, all but the top_k best at -inf."""
    scaled = logits / temperature
    kth = scaled.topk(top_k, dim=-1).values[..., -1:]
    return scaled.masked_fill(scaled < kth, float("-inf"))


def generate(model_dir, mode: str, random=RANDOM, greedy=GREEDY, **flags):
    llm = LLM(model=str(model_dir), num_gpu_blocks=64, max_model_len=128, logprobs_mode=mode, **flags)
    try:
        outs = llm.generate(PROMPTS[1:3], [SamplingParams(**random), SamplingParams(**greedy)], use_tqdm=False)
        return outs, llm.get_stats()[0]
    finally:
        llm.shutdown()


def check_rows(rows: list[dict], tokens: list[int], expected: torch.Tensor, k: int) -> None:
    """Each row: the token first with its value and rank, then the k best, all from ``expected``."""
    assert len(rows) == len(tokens)
    for row, token, values in zip(rows, tokens, expected, strict=True):
        assert next(iter(row)) == token and len(row) in (k, k + 1)
        for tid, lp in row.items():
            assert lp.logprob == pytest.approx(values[tid].item(), abs=1e-3)
            assert lp.rank == int((values > values[tid]).sum()) + 1
        assert {t for t in row if t != token or len(row) == k} == set(values.topk(k).indices.tolist())


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits", "raw_logprobs", "raw_logits"])
def test_each_mode_reports_the_distribution_it_names(tiny_model_dir, mode):
    (random_out, greedy_out), _ = generate(tiny_model_dir, mode)
    for out, params in ((random_out, RANDOM), (greedy_out, GREEDY)):
        sample = out.outputs[0]
        n = len(out.prompt_token_ids)
        logits = hf_logits(tiny_model_dir, out.prompt_token_ids + sample.token_ids)[n - 1:-1]
        if mode.startswith("raw") or params["temperature"] == 0:  # (greedy: no temperature, no top_k)
            values = logits
        else:
            values = processed(logits, params["temperature"], params["top_k"])
        if mode.endswith("logprobs"):
            values = values.log_softmax(-1)
        check_rows(sample.logprobs, sample.token_ids, values, 3)
        if params["temperature"] == 0:
            assert sample.token_ids == logits.argmax(-1).tolist()
    # Prompt logprobs are raw whatever the mode (vLLM's).
    n = len(random_out.prompt_token_ids)
    prompt_raw = hf_logits(tiny_model_dir, random_out.prompt_token_ids).log_softmax(-1)[:-1]
    check_rows(random_out.prompt_logprobs[1:], random_out.prompt_token_ids[1:], prompt_raw, 1)
    assert len(random_out.prompt_logprobs) == n


def test_processed_logprobs_differ_from_raw_for_the_same_draws(tiny_model_dir):
    (raw, _), _ = generate(tiny_model_dir, "raw_logprobs")
    (done, _), _ = generate(tiny_model_dir, "processed_logprobs")
    raw_sample, done_sample = raw.outputs[0], done.outputs[0]
    assert raw_sample.token_ids == done_sample.token_ids  # (a seeded request: the mode changes no draw)
    for r, d, token in zip(raw_sample.logprobs, done_sample.logprobs, raw_sample.token_ids, strict=True):
        assert d[token].logprob > r[token].logprob + 1e-3  # (temperature < 1 and top_k sharpen it)
        # Beyond the top 5 a processed logprob is -inf (the router shows it as -9999.0).
    with_six = LLM(model=str(tiny_model_dir), num_gpu_blocks=64, logprobs_mode="processed_logprobs")
    try:
        [wide] = with_six.generate(PROMPTS[1], SamplingParams(**{**RANDOM, "logprobs": 6}), use_tqdm=False)
    finally:
        with_six.shutdown()
    assert all(sorted(lp.logprob for lp in row.values())[0] == float("-inf") for row in wide.outputs[0].logprobs)


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logits"])
def test_verified_drafts_report_the_same_values(tiny_model_dir, mode):
    """With n-gram drafts (several tokens a pass), every token's values are still the mode's, at
    the row it was drawn from: the random request's tempered, top-k-filtered distribution. (Seeded
    requests are not drafted for: this random one has no seed.)"""
    random = {**RANDOM, "seed": None, "max_tokens": 24}
    greedy = {**GREEDY, "max_tokens": 24}
    (random_out, greedy_out), stats = generate(tiny_model_dir, mode, random, greedy, speculative_config=NGRAM)
    assert stats.spec_decode_num_accepted_tokens > 0
    for out, params in ((random_out, random), (greedy_out, greedy)):
        sample = out.outputs[0]
        n = len(out.prompt_token_ids)
        logits = hf_logits(tiny_model_dir, out.prompt_token_ids + sample.token_ids)[n - 1:-1]
        if mode == "raw_logits":
            values = logits
        elif params["temperature"] == 0:
            values = logits.log_softmax(-1)
        else:
            values = processed(logits, params["temperature"], params["top_k"]).log_softmax(-1)
        check_rows(sample.logprobs, sample.token_ids, values, 3)


def test_an_unknown_mode_is_refused_before_anything_loads(tiny_model_dir):
    with pytest.raises(ValueError, match="logprobs_mode"):
        LLM(model=str(tiny_model_dir), num_gpu_blocks=64, logprobs_mode="processed")
