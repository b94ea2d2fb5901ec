"""Speculative decoding on the engine side: the n-gram drafter and the scheduler's bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest

from engine_core.config import SpeculativeConfig
from engine_core.outputs import ModelRunnerOutput
from engine_core.request import RequestStatus
from engine_core.spec_decode import NgramProposer, drafts_allowed, ngram_draft
from tests.engine_core.utils import EOS_TOKEN_ID, create_requests, create_scheduler, step


def draft(tokens: list[int], min_n: int = 1, max_n: int = 3, k: int = 3) -> list[int]:
    return ngram_draft(np.asarray(tokens, dtype=np.int64), min_n, max_n, k)


def test_ngram_draft_follows_the_earliest_occurrence_of_the_longest_suffix():
    # Suffix [1, 2] occurred twice before; the earliest occurrence is followed by 3, 4, 1 (vLLM's choice).
    assert draft([1, 2, 3, 4, 1, 2, 7, 8, 1, 2]) == [3, 4, 1]
    # The longest suffix wins: [6, 1, 2] matches only the later occurrence (followed by 9), although
    # [1, 2] occurs earlier (followed by 5).
    assert draft([1, 2, 5, 6, 1, 2, 9, 6, 1, 2]) == [9, 6, 1]
    # Periodic text: the earliest occurrence leaves room for a whole draft.
    assert draft([7, 4, 4, 4, 4, 4, 4]) == [4, 4, 4]
    assert draft([1, 2] * 6, min_n=2, max_n=2, k=5) == [1, 2, 1, 2, 1]
    # k caps the draft; a match near the end gives fewer tokens.
    assert draft([1, 2, 3, 1, 2], k=1) == [3]
    assert draft([4, 4]) == [4]
    # No earlier occurrence of any suffix of length >= min_n: no draft.
    assert draft([1, 2, 3, 4]) == []
    assert draft([1, 2, 3, 1, 2, 4], min_n=2) == []
    assert draft([7]) == []


def test_a_draft_given_without_a_method_implies_one_as_vllm_infers_it(tmp_path):
    import json

    def head(name: str, config: dict) -> str:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        return str(tmp_path / name)

    def implied(model: str, **given) -> tuple[str, int]:
        spec = SpeculativeConfig.from_dict({"model": model, **given})
        return spec.method, spec.num_speculative_tokens

    speculators = head("llama.speculator", {"speculators_model_type": "eagle3", "speculators_config": {
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}]}})
    assert implied(speculators) == ("eagle3", 3)
    assert implied(speculators, num_speculative_tokens=5) == ("eagle3", 5)
    authors = head("heads-v2", {"architectures": ["LlamaForCausalLMEagle3"]})
    assert implied(authors, num_speculative_tokens=2) == ("eagle3", 2)
    assert implied(head("EAGLE3-LLaMA3.1-Instruct-8B", {}), num_speculative_tokens=2) == ("eagle3", 2)
    assert implied(head("EAGLE-LLaMA3-Instruct-8B", {"architectures": ["LlamaForCausalLM"]}),
                   num_speculative_tokens=2) == ("eagle", 2)
    assert implied(head("small", {"architectures": ["LlamaForCausalLM"]}), num_speculative_tokens=2) == (
        "draft_model", 2)
    assert implied("/no/such/draft", num_speculative_tokens=2) == ("draft_model", 2)
    # (Not an EAGLE head for a name that merely holds the word, nor a GGUF, nor a malformed config.)
    assert implied(head("NeuralBeagle14-7B", {"architectures": ["MistralForCausalLM"]}),
                   num_speculative_tokens=2) == ("draft_model", 2)
    assert implied(str(tmp_path / "x-eagle3.gguf"), num_speculative_tokens=2) == ("draft_model", 2)
    assert implied(head("odd-eagle3", ["x"]), num_speculative_tokens=2) == ("draft_model", 2)
    malformed = head("malformed", {"speculators_model_type": "eagle3",
                                   "speculators_config": {"proposal_methods": ["x"]}})
    assert implied(malformed, num_speculative_tokens=2) == ("eagle3", 2)
    with pytest.raises(ValueError, match="num_speculative_tokens must be given"):
        SpeculativeConfig.from_dict({"model": authors})


def test_speculative_config_defaults_and_refusals():
    default = SpeculativeConfig(num_speculative_tokens=3)
    assert (default.prompt_lookup_min, default.prompt_lookup_max) == (5, 5)
    assert SpeculativeConfig(method="[ngram]", num_speculative_tokens=1).method == "ngram"
    with pytest.raises(ValueError, match="num_speculative_tokens must be given"):
        SpeculativeConfig.from_dict({"method": "ngram"})
    cfg = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=4)
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (4, 4)
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="medusa", num_speculative_tokens=3)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="speculative_config"):
        SpeculativeConfig.from_dict({"method": "ngram", "draft_model": "x"})
    # The MTP layer: vLLM's older per-family names are the same method; it names no model.
    for name in ("mtp", "deepseek_mtp", "glm4_moe_mtp"):
        mtp = SpeculativeConfig.from_dict({"method": name, "num_speculative_tokens": 1})
        assert mtp.method == "mtp" and mtp.proposes_in_workers and not mtp.uses_draft_model
    assert not default.proposes_in_workers
    with pytest.raises(ValueError, match=r"speculative_config\.model must be unset with method mtp"):
        SpeculativeConfig.from_dict({"method": "mtp", "model": "d", "num_speculative_tokens": 1})
    # (Sharded over the target's workers, as a draft model: its tensor parallelism is theirs.)
    assert SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 1,
                                        "draft_tensor_parallel_size": 2}).draft_tensor_parallel_size == 2
    with pytest.raises(ValueError, match="draft_tensor_parallel_size must be None or >= 1"):
        SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 1, "draft_tensor_parallel_size": 0})
    with pytest.raises(ValueError, match=r"speculative_config\.prompt_lookup_min must be unset with method mtp"):
        SpeculativeConfig.from_dict({"method": "mtp", "prompt_lookup_min": 2, "num_speculative_tokens": 1})


def _decoding(scheduler, prompt_len: int = 8, **kwargs):
    """A request whose prompt is one repeated 4-token pattern, prefilled and with one token out."""
    (request,) = create_requests(1, num_tokens=prompt_len, max_tokens=kwargs.pop("max_tokens", 32), **kwargs)
    request.prompt_token_ids[:] = request.all_token_ids[:] = [(i % 4) + 10 for i in range(prompt_len)]
    scheduler.add_request(request)
    step(scheduler, tokens={request.request_id: 10})  # the prefill samples 10: the pattern goes on
    return request


def test_proposer_drafts_only_for_decoding_requests_it_can_verify():
    scheduler = create_scheduler(num_spec_tokens=3)
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2,
                                               prompt_lookup_max=3), max_model_len=scheduler.max_model_len)
    plain = _decoding(scheduler)
    assert proposer.propose([plain]) == {plain.request_id: [11, 12, 13]}
    # An unmet min_tokens: no drafts. Penalties, bad words and grammars are drafted for: the workers
    # apply them to each draft row as of its position (a grammar's drafts are cut by the engine at
    # the first token it refuses, tests/engine_core/test_structured_output_spec_decode.py).
    assert drafts_allowed(create_requests(1, presence_penalty=0.5)[0].sampling_params)
    assert drafts_allowed(create_requests(1, repetition_penalty=1.2)[0].sampling_params)
    assert drafts_allowed(create_requests(1, bad_words_token_ids=[[5]])[0].sampling_params)
    assert drafts_allowed(create_requests(1, structured_output={"regex": "a+"})[0].sampling_params)
    # A seeded random request's draws must not depend on how many drafts fit each pass.
    assert not drafts_allowed(create_requests(1, seed=3, temperature=0.7)[0].sampling_params)
    assert drafts_allowed(create_requests(1, seed=3, temperature=0.0)[0].sampling_params)
    assert drafts_allowed(create_requests(1, temperature=0.7)[0].sampling_params)
    short = _decoding(create_scheduler(), min_tokens=4)
    assert proposer.propose([short]) == {}
    # The draft never runs past max_tokens (it leaves room for the token the pass samples itself).
    near_end = _decoding(create_scheduler(), max_tokens=3)
    assert proposer.propose([near_end]) == {near_end.request_id: [11]}
    # Nor past max_model_len.
    tight = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2),
                          max_model_len=plain.num_tokens + 2)
    assert tight.propose([plain]) == {plain.request_id: [11, 12]}
    # A request mid-prefill gets none.
    (prefilling,) = create_requests(1, num_tokens=40)
    scheduler = create_scheduler(max_num_batched_tokens=16)
    scheduler.add_request(prefilling)
    step(scheduler)
    assert prefilling.status == RequestStatus.RUNNING and prefilling.num_computed_tokens == 16
    assert proposer.propose([prefilling]) == {}


def test_a_prompt_given_as_embeddings_drafts_from_its_outputs_only():
    import torch

    from engine_core.prompt_embeds import PromptEmbeds

    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                                               prompt_lookup_max=2), max_model_len=256)
    scheduler = create_scheduler(num_spec_tokens=3)
    (request,) = create_requests(1, num_tokens=12, max_tokens=32)
    request.prompt_token_ids[:] = request.all_token_ids[:] = [0] * 12  # (placeholders)
    request.prompt_embeds = PromptEmbeds.from_tensor(torch.randn(12, 4))
    scheduler.add_request(request)
    step(scheduler, tokens={request.request_id: 0})  # (its first token is the placeholders' id)
    # The placeholders would have matched its last token and drafted 0, 0, 0.
    assert proposer.propose([request]) == {}
    step(scheduler, tokens={request.request_id: 7})
    step(scheduler, tokens={request.request_id: 0})
    assert proposer.propose([request]) == {request.request_id: [7, 0]}  # (what followed 0 in its outputs)


def _verify(scheduler, so, tokens_by_req: dict[str, list[int]]):
    req_ids = list(so.num_scheduled_tokens)
    out = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                            sampled_token_ids=[tokens_by_req.get(r, []) for r in req_ids])
    return scheduler.update_from_output(so, out)


def test_scheduler_schedules_drafts_and_takes_back_the_rejected_ones():
    scheduler = create_scheduler(num_spec_tokens=3, block_size=4)
    request = _decoding(scheduler)
    assert request.num_computed_tokens == 8 and request.num_tokens == 9
    scheduler.update_draft_token_ids({request.request_id: [11, 12, 13, 99]})  # capped to num_spec_tokens
    assert request.spec_token_ids == [11, 12, 13]
    so = scheduler.schedule()
    # The last token plus three drafts, slots for all of them, and the drafts for the workers.
    assert so.num_scheduled_tokens[request.request_id] == 4
    assert so.scheduled_spec_decode_tokens == {request.request_id: [11, 12, 13]}
    assert so.scheduled_cached_reqs.new_token_ids == [[10]]
    assert request.spec_token_ids == [] and request.num_computed_tokens == 12
    blocks = scheduler.kv_cache_manager.get_block_ids(request.request_id)
    assert len(blocks) == 3  # 12 slots in blocks of 4
    # Drafts never enter the prefix cache: only the two full blocks of known tokens are cached.
    assert scheduler.kv_cache_manager.num_cached_block[request.request_id] == 2

    # The target model accepted 11 and 12, rejected 13, and sampled 50 in its place.
    outputs = _verify(scheduler, so, {request.request_id: [11, 12, 50]})
    assert outputs[0].outputs[0].new_token_ids == [11, 12, 50]
    assert request.output_token_ids == [10, 11, 12, 50]
    # Positions up to the last accepted draft are computed; 50 is the next pass's input.
    assert request.num_computed_tokens == 11 and request.num_tokens == 12
    stats = outputs[0].scheduler_stats.spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 2)
    assert stats.num_accepted_tokens_per_pos == [1, 1, 0]
    assert scheduler.make_stats().spec_decoding_stats.num_drafts == 0  # counters are deltas

    # No drafts: an ordinary one-token decode.
    so = scheduler.schedule()
    assert so.num_scheduled_tokens[request.request_id] == 1 and so.scheduled_spec_decode_tokens == {}


def test_drafts_are_trimmed_by_the_token_budget_and_max_model_len():
    scheduler = create_scheduler(num_spec_tokens=3, max_num_batched_tokens=8, max_model_len=64)
    request = _decoding(scheduler)
    scheduler.max_num_scheduled_tokens = 3  # (the per-pass budget, lowered once the prompt is in)
    scheduler.update_draft_token_ids({request.request_id: [11, 12, 13]})
    so = scheduler.schedule()
    assert so.num_scheduled_tokens[request.request_id] == 3
    assert so.scheduled_spec_decode_tokens[request.request_id] == [11, 12]

    scheduler = create_scheduler(num_spec_tokens=3, max_model_len=11)
    request = _decoding(scheduler)  # 9 tokens: positions 9 and 10 are the last inside max_model_len
    scheduler.update_draft_token_ids({request.request_id: [11, 12, 13]})
    so = scheduler.schedule()
    assert so.scheduled_spec_decode_tokens[request.request_id] == [11, 12]
    # Both accepted, and the bonus token: the request reaches max_model_len and stops there.
    outputs = _verify(scheduler, so, {request.request_id: [11, 12, 13]})
    out = outputs[0].outputs[0]
    assert out.new_token_ids == [11, 12] and str(out.finish_reason) == "length"
    assert request.num_tokens == 11


def test_a_stop_among_accepted_tokens_trims_the_rest():
    scheduler = create_scheduler(num_spec_tokens=3)
    request = _decoding(scheduler)
    scheduler.update_draft_token_ids({request.request_id: [11, EOS_TOKEN_ID, 13]})
    so = scheduler.schedule()
    outputs = _verify(scheduler, so, {request.request_id: [11, EOS_TOKEN_ID, 13, 14]})
    out = outputs[0].outputs[0]
    assert out.new_token_ids == [11, EOS_TOKEN_ID] and str(out.finish_reason) == "stop"
    assert request.request_id not in scheduler.requests
    # Freed with its blocks; the workers hear of it next pass.
    assert request.request_id in scheduler.finished_req_ids


def test_preemption_drops_the_drafts():
    scheduler = create_scheduler(num_spec_tokens=3, block_size=4, num_blocks=5)
    first = _decoding(scheduler)
    (second,) = create_requests(1, num_tokens=8)
    scheduler.add_request(second)
    step(scheduler)  # second prefills: the pool (5 blocks of 4) is nearly full
    scheduler.update_draft_token_ids({first.request_id: [11, 12, 13], second.request_id: [1, 2, 3]})
    so = scheduler.schedule()
    preempted = [scheduler.requests[r] for r in so.preempted_req_ids]
    assert preempted, "the drafts' slots must not fit for both requests"
    for request in preempted:
        assert request.status == RequestStatus.PREEMPTED and request.spec_token_ids == []
        assert request.request_id not in so.scheduled_spec_decode_tokens
    assert sum(so.num_scheduled_tokens.values()) == so.total_num_scheduled_tokens


def test_the_drafter_keeps_each_requests_tokens_in_step_with_the_request():
    """The proposer extends its copy of each request's tokens pass by pass; what it drafts from
    must always be the request's tokens as they are now."""
    scheduler = create_scheduler(num_spec_tokens=3)
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                                               prompt_lookup_max=2), max_model_len=scheduler.max_model_len)
    request = _decoding(scheduler, prompt_len=4, max_tokens=200)  # 10 11 12 13 | 10
    rng = np.random.default_rng(0)
    for _ in range(60):
        drafts = proposer.propose([request])
        expected = draft(request.all_token_ids, 1, 2, 3)
        assert drafts.get(request.request_id, []) == expected
        step(scheduler, tokens={request.request_id: int(rng.integers(10, 16))})


def test_a_stop_inside_the_draft_leaves_a_streaming_session_consistent():
    """A session stopped by an accepted draft (with more accepted after it) continues from a
    computed count inside its tokens: the next chunk is scheduled in full, not from beyond it."""
    scheduler = create_scheduler(num_spec_tokens=3)
    (session,) = create_requests(1, num_tokens=8, max_tokens=32, resumable=True)
    scheduler.add_request(session)
    step(scheduler, tokens={session.request_id: 10})
    scheduler.update_draft_token_ids({session.request_id: [EOS_TOKEN_ID, 21, 22]})
    so = scheduler.schedule()
    _verify(scheduler, so, {session.request_id: [EOS_TOKEN_ID, 21, 22, 23]})
    assert session.status == RequestStatus.WAITING_FOR_STREAMING_REQ
    assert session.output_token_ids == [10, EOS_TOKEN_ID]
    assert session.num_computed_tokens == session.num_tokens - 1
    (chunk,) = create_requests(1, num_tokens=1, max_tokens=4, resumable=True)
    chunk.request_id = session.request_id
    scheduler.add_request(chunk)
    so = scheduler.schedule()
    # The stop token and the new chunk's token: both still to be computed.
    assert so.num_scheduled_tokens[session.request_id] == 2


def test_drafts_give_way_before_anyone_is_preempted_for_their_slots():
    # Blocks of 4, a pool of 5. A: 6 prompt tokens (2 blocks), B: 8 (2 blocks); one block is free.
    scheduler = create_scheduler(num_spec_tokens=3, block_size=4, num_blocks=5)
    a, b = create_requests(2, num_tokens=8)
    a.prompt_token_ids[:] = a.all_token_ids[:] = a.prompt_token_ids[:6]
    a.num_prompt_tokens = 6
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 1
    # A (first in running) would need the free block for all three drafts; B needs it for its own
    # next token. B gets it; A keeps the one draft its own blocks hold.
    scheduler.update_draft_token_ids({a.request_id: [11, 12, 13]})
    so = scheduler.schedule()
    assert not so.preempted_req_ids
    assert so.num_scheduled_tokens == {a.request_id: 2, b.request_id: 1}
    assert so.scheduled_spec_decode_tokens == {a.request_id: [11]}
    # Drafts come after every running request's own tokens, so a small budget serves B first.
    scheduler = create_scheduler(num_spec_tokens=3, max_num_batched_tokens=16)
    a, b = create_requests(2, num_tokens=8)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)
    scheduler.max_num_scheduled_tokens = 3  # (the per-pass budget, lowered once the prompts are in)
    scheduler.update_draft_token_ids({a.request_id: [1, 2, 3], b.request_id: [4, 5, 6]})
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {a.request_id: 2, b.request_id: 1}
    assert so.scheduled_spec_decode_tokens == {a.request_id: [1]}
