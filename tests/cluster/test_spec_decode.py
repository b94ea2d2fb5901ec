"""Speculative decoding (n-gram drafts) end to end on a real engine with the tiny model: greedy
answers equal to plain decoding and to transformers, with drafts really accepted."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from cluster import LLM, SamplingParams
from tests.cluster.test_llm import PROMPTS, hf_greedy

# prompt_lookup_min 1: a random model's greedy output repeats itself, so drafts are found often.
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def run(model_dir, prompts, params, **flags):
    llm = LLM(model=str(model_dir), **flags)
    try:
        return llm.generate(prompts, params, use_tqdm=False), llm.get_stats()[0]
    finally:
        llm.shutdown()


def test_greedy_with_drafts_equals_transformers_under_chunked_prefill_and_preemption(tiny_model_dir):
    max_tokens = 24
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs, stats = run(tiny_model_dir, PROMPTS, params, num_gpu_blocks=12, max_num_batched_tokens=16,
                         max_num_seqs=8, max_model_len=128, speculative_config=NGRAM)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(tiny_model_dir, PROMPTS, max_tokens)
    assert stats.num_preemptions > 0, "the KV pool was meant to force preemption"
    assert stats.spec_decode_num_drafts > 0
    assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    # Fewer passes than tokens: drafts were accepted.
    assert stats.num_free_blocks == stats.num_blocks


def test_logprobs_and_the_other_sampling_features_are_unchanged_by_drafts(tiny_model_dir):
    """Greedy requests with logprobs, penalties, a grammar, min_tokens, stop ids and
    allowed_token_ids, in one batch: the same answers with and without drafting. (Requests with
    penalties, bad words, grammars, or short of min_tokens are not drafted for; the rest are.)"""
    prompts = PROMPTS[:6]
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, structured_output={"regex": "[a-z ]{5,15}"}),
        SamplingParams(max_tokens=20, temperature=0.0, min_tokens=10, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[40, 41, 42, 43], logprobs=0),
        SamplingParams(max_tokens=20, temperature=0.0, allowed_token_ids=list(range(30, 60)), ignore_eos=True),
    ]
    plain, _ = run(tiny_model_dir, prompts, params, num_gpu_blocks=64)
    drafted, stats = run(tiny_model_dir, prompts, params, num_gpu_blocks=64, speculative_config=NGRAM)
    assert stats.spec_decode_num_accepted_tokens > 0
    for a, b in zip(plain, drafted, strict=True):
        x, y = a.outputs[0], b.outputs[0]
        assert (y.token_ids, y.finish_reason, y.text) == (x.token_ids, x.finish_reason, x.text)
        if x.logprobs is not None:
            assert len(y.logprobs) == len(x.logprobs)
            for px, py in zip(x.logprobs, y.logprobs, strict=True):
                assert px.keys() == py.keys()
                for token in px:
                    assert py[token].logprob == pytest.approx(px[token].logprob, abs=1e-4)
                    assert py[token].rank == px[token].rank


def test_seeded_requests_are_not_drafted_for_and_random_ones_are(tiny_model_dir):
    """A seeded answer must not depend on the load, and how many draws a drafted request takes
    depends on how many drafts fit each pass: seeded random requests decode one token per pass, so
    drafting on or off gives the same answers. Unseeded random requests are drafted for."""
    seeded = [SamplingParams(max_tokens=16, temperature=0.7, seed=s, ignore_eos=True) for s in range(4)]
    plain, _ = run(tiny_model_dir, PROMPTS[:4], seeded, num_gpu_blocks=64)
    drafted, stats = run(tiny_model_dir, PROMPTS[:4], seeded, num_gpu_blocks=64, speculative_config=NGRAM)
    assert stats.spec_decode_num_drafts == 0
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    unseeded = SamplingParams(max_tokens=16, temperature=0.7, ignore_eos=True)
    answers, stats = run(tiny_model_dir, PROMPTS, unseeded, num_gpu_blocks=64, speculative_config=NGRAM)
    assert stats.spec_decode_num_drafts > 0
    assert all(len(o.outputs[0].token_ids) == 16 and o.outputs[0].finish_reason == "length" for o in answers)


def test_stop_strings_end_samples_where_plain_decoding_ends_them(tiny_model_dir):
    """Each prompt stops on two characters from the last third of its free answer, so the stop
    string completes after drafts have been accepted, often inside a pass's several tokens."""
    free = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    answers, _ = run(tiny_model_dir, PROMPTS, free, num_gpu_blocks=64)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    stops = []
    for answer in answers:
        ids = answer.outputs[0].token_ids
        # The text of a token from the last third of the answer (a plain ASCII one: a random model's
        # answers also hold pieces of multi-byte characters).
        pieces = [tokenizer.decode([t]).strip() for t in ids[2 * len(ids) // 3:]]
        stops.append(next((p for p in pieces if p.isascii() and p.isalnum()), "never"))
    params = [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, stop=[s], logprobs=1) for s in stops]
    plain, _ = run(tiny_model_dir, PROMPTS, params, num_gpu_blocks=64)
    drafted, stats = run(tiny_model_dir, PROMPTS, params, num_gpu_blocks=64, speculative_config=NGRAM)
    assert stats.spec_decode_num_accepted_tokens > 0
    assert sum(a.outputs[0].finish_reason == "stop" for a in plain) >= 5
    for a, b in zip(plain, drafted, strict=True):
        x, y = a.outputs[0], b.outputs[0]
        assert (y.text, y.token_ids, y.finish_reason, y.stop_reason) == (x.text, x.token_ids, x.finish_reason,
                                                                          x.stop_reason)
        assert len(y.logprobs) == len(y.token_ids)


def test_a_sample_ends_at_a_stop_string_that_completes_inside_a_multi_token_output():
    from cluster.llm import _Pending
    from engine_core.outputs import EngineCoreOutput, LogprobsEntry
    from router.detokenizer import IncrementalDetokenizer
    from tests.router.tokenizer_factory import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    ids = tokenizer.encode("Hello world, the quick brown fox")
    pending = _Pending("hi", [1], want_logprobs=True, detok=IncrementalDetokenizer(tokenizer, [1], stop=[","]))
    comma = len(tokenizer.encode("Hello world,"))
    lp = LogprobsEntry([-0.5] * (comma + 3), [[]] * (comma + 3))
    # One pass accepted drafts past the comma: the sample ends at it.
    assert pending.apply(EngineCoreOutput("r", ids[:comma + 3], None, None, lp), 0.0)
    assert pending.token_ids == ids[:comma] and pending.stop_reason == ","
    assert pending.logprob_entries[0][0] == ids[:comma]
