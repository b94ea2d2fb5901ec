"""Embedding requests (SamplingParams.embed) through the real scheduler and model runner: the last
prompt token's final hidden state, as transformers computes it, through chunked prefill, prefix
hits, beside generating requests and under speculative decoding; each ends with its prefill."""

from __future__ import annotations

import random

import pytest
import torch

from engine_core.request import FinishReason, Request, RequestStatus
from engine_core.sampling_params import SamplingParams
from tests.gpu_worker.utils import (
    greedy_request,
    hf_greedy,
    load_hf,
    make_runner,
    make_scheduler,
    run_to_completion,
    save_tiny_model,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("embed"), "qwen3", head_dim=32)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return load_hf(model_dir)


def _hf_embedding(hf_model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model.model(torch.tensor([prompt])).last_hidden_state[0, -1]


def _hf_pooled(hf_model, prompt: list[int], pooling: str) -> torch.Tensor:
    """transformers' final hidden states of the prompt, pooled: the last token's, the mean, the first's."""
    decoder = getattr(hf_model, "model", hf_model)
    with torch.no_grad():
        states = decoder(torch.tensor([prompt])).last_hidden_state[0]
    return {"LAST": states[-1], "MEAN": states.mean(0), "CLS": states[0]}[pooling]


class _FixedDrafts:
    """Drafts the same tokens for every decoding request (the pass verifies and mostly rejects
    them; the greedy answers stay the model's), so embeddings finish in passes that carry drafts."""

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, requests) -> dict[str, list[int]]:
        return {r.request_id: [3, 4][:self.k] for r in requests
                if r.status == RequestStatus.RUNNING and r.num_computed_tokens == r.num_tokens - 1
                and r.max_tokens - r.num_output_tokens > self.k}


def _embed_request(req_id: str, prompt: list[int], **params) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=1, temperature=0.0, embed=True, **params),
                   eos_token_id=None)


@pytest.mark.parametrize("num_spec_tokens", [0, 2])
def test_embeddings_match_transformers_beside_generating_requests(model_dir, hf_model, num_spec_tokens):
    runner = make_runner(model_dir, num_blocks=96, block_size=4)
    sched = make_scheduler(num_blocks=96, block_size=4, max_num_batched_tokens=13, long_prefill_token_threshold=6,
                           num_spec_tokens=num_spec_tokens)
    rng = random.Random(11)
    shared = [rng.randrange(256) for _ in range(12)]
    embed_prompts = {"e0": [rng.randrange(256) for _ in range(23)], "e1": shared + [5, 6, 7],
                     "e2": shared + [5, 6, 7], "e3": [rng.randrange(256) for _ in range(3)]}
    gen_prompts = {"g0": [rng.randrange(256) for _ in range(9)], "g1": [1, 2, 3, 1, 2, 3, 1, 2]}
    for rid, p in gen_prompts.items():
        sched.add_request(greedy_request(rid, p, 6))
    for rid, p in embed_prompts.items():
        sched.add_request(_embed_request(rid, p, embed_normalize=False))
    outputs, hits = {}, {}
    step_drafts = {"now": False, "embedded_beside_drafts": 0}

    def on_step(step, so):
        hits.update({n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs})
        drafted.extend(so.scheduled_spec_decode_tokens)
        step_drafts["now"] = bool(so.scheduled_spec_decode_tokens)

    def on_output(o):
        if o.pooling_output is not None:
            assert o.request_id not in outputs and o.finish_reason == FinishReason.STOP and not o.new_token_ids
            outputs[o.request_id] = torch.tensor(o.pooling_output)
            step_drafts["embedded_beside_drafts"] += step_drafts["now"]

    drafter = _FixedDrafts(num_spec_tokens) if num_spec_tokens else None
    drafted = []
    got = run_to_completion(sched, runner.execute_model, on_step=on_step, on_output=on_output, drafter=drafter)
    assert set(outputs) == set(embed_prompts)
    for rid, p in embed_prompts.items():
        torch.testing.assert_close(outputs[rid], _hf_embedding(hf_model, p), atol=1e-4, rtol=1e-4)
        assert got[rid] == []  # no token sampled
    assert hits["e2"] >= 12  # the second copy of the shared prompt found its blocks cached
    for rid, p in gen_prompts.items():
        assert got[rid] == hf_greedy(hf_model, p, 6), rid
    assert bool(drafted) == bool(num_spec_tokens)
    # With drafting, some embeddings came out of passes that also verified other requests' drafts.
    assert bool(step_drafts["embedded_beside_drafts"]) == bool(num_spec_tokens)
    assert not sched.running and not sched.requests


def test_dimensions_and_normalisation(model_dir, hf_model):
    runner = make_runner(model_dir, num_blocks=32, block_size=4)
    sched = make_scheduler(num_blocks=32, block_size=4)
    prompt = [7, 3, 9, 200, 41]
    sched.add_request(_embed_request("unit", prompt))
    sched.add_request(_embed_request("cut", prompt, embed_dimensions=16))
    sched.add_request(_embed_request("cut-raw", prompt, embed_dimensions=16, embed_normalize=False))
    outputs = {}
    run_to_completion(sched, runner.execute_model, on_output=lambda o: outputs.update({o.request_id: o.pooling_output}))
    full = _hf_embedding(hf_model, prompt)
    torch.testing.assert_close(torch.tensor(outputs["unit"]), full / full.norm(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.tensor(outputs["cut-raw"]), full[:16], atol=1e-4, rtol=1e-4)
    # Matryoshka: cut first, then normalised.
    torch.testing.assert_close(torch.tensor(outputs["cut"]), full[:16] / full[:16].norm(), atol=1e-5, rtol=1e-5)


def test_embed_refuses_generation_settings():
    with pytest.raises(ValueError, match="embed must be used with max_tokens 1"):
        SamplingParams(max_tokens=4, embed=True)
    with pytest.raises(ValueError, match="embed must be used with max_tokens 1"):
        SamplingParams(max_tokens=1, embed=True, logprobs=2)
    with pytest.raises(ValueError, match="embed_dimensions"):
        SamplingParams(max_tokens=1, embed=True, embed_dimensions=0)


@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
def test_a_preempted_embedding_request_recomputes_its_prompt(model_dir, hf_model, pooling):
    """Generating requests grow into a small KV pool and preempt the embedding request mid-prefill;
    it resumes from scratch (what MEAN and CLS had gathered goes with the preempted state) and its
    embedding is still the model's."""
    runner = make_runner(model_dir, num_blocks=14, block_size=4)
    sched = make_scheduler(num_blocks=14, block_size=4, max_num_batched_tokens=8, prefix_caching=False)
    rng = random.Random(3)
    for i in range(2):
        sched.add_request(greedy_request(f"g{i}", [rng.randrange(256) for _ in range(16)], 20))
    prompt = [rng.randrange(256) for _ in range(23)]
    sched.add_request(_embed_request("e", prompt, embed_normalize=False, embed_pooling=pooling))
    preempted, outputs = [], {}
    run_to_completion(sched, runner.execute_model, on_step=lambda s, so: preempted.extend(so.preempted_req_ids),
                      on_output=lambda o: outputs.update({o.request_id: o.pooling_output})
                      if o.pooling_output is not None else None)
    assert "e" in preempted
    torch.testing.assert_close(torch.tensor(outputs["e"]), _hf_pooled(hf_model, prompt, pooling), atol=1e-4,
                               rtol=1e-4)
    assert not runner.requests.embedding_ids


def test_mean_and_cls_pooling_read_every_chunk_and_no_prefix_hits(model_dir, hf_model):
    """MEAN sums a prompt's hidden states over its prefill chunks and CLS keeps the first token's,
    beside LAST and generating requests. Their prompts never read the prefix cache (the cached
    positions' hidden states would be missing): the second copy of a shared prompt recomputes it
    whole under MEAN, while LAST still hits."""
    runner = make_runner(model_dir, num_blocks=96, block_size=4)
    sched = make_scheduler(num_blocks=96, block_size=4, max_num_batched_tokens=7)
    rng = random.Random(5)
    shared = [rng.randrange(256) for _ in range(17)]
    cases = {"mean0": (shared, "MEAN"), "cls": ([rng.randrange(256) for _ in range(13)], "CLS"),
             "last": (shared, "LAST"), "mean1": (shared, "MEAN"), "short": ([9], "MEAN")}
    sched.add_request(greedy_request("g", [rng.randrange(256) for _ in range(6)], 5))
    outputs, hits = {}, {}
    for rid, (prompt, pooling) in cases.items():
        sched.add_request(_embed_request(rid, prompt, embed_normalize=False, embed_pooling=pooling))
    run_to_completion(sched, runner.execute_model,
                      on_step=lambda s, so: hits.update({n.req_id: n.num_computed_tokens
                                                         for n in so.scheduled_new_reqs}),
                      on_output=lambda o: outputs.update({o.request_id: o.pooling_output})
                      if o.pooling_output is not None else None)
    for rid, (prompt, pooling) in cases.items():
        torch.testing.assert_close(torch.tensor(outputs[rid]), _hf_pooled(hf_model, prompt, pooling),
                                   atol=1e-4, rtol=1e-4)
    assert hits["mean1"] == hits["cls"] == 0 and hits["last"] >= 16
    runner.execute_model(sched.schedule())  # (the runner learns of the last finished requests)
    assert not runner.requests.embedding_ids and not len(runner.requests)


def test_a_bare_decoder_checkpoint_serves_embeddings_without_a_head(tmp_path):
    """e5-mistral ships transformers' MistralModel: no LM head, tensors named without "model.". It
    loads as an embedding-only model (no head built, none read), embeds as transformers does, and
    refuses logits."""
    from transformers import AutoModel

    from gpu_worker.config import ModelConfig
    from tests.gpu_worker.utils import make_config

    torch.manual_seed(0)
    bare = AutoModel.from_config(make_config("mistral"), dtype=torch.float32).eval()
    bare.save_pretrained(tmp_path)
    config = ModelConfig.from_pretrained(tmp_path)
    assert config.raw["architectures"] == ["MistralModel"]
    assert config.architecture == "MistralForCausalLM" and config.embedding_only
    runner = make_runner(tmp_path, num_blocks=32, block_size=4)
    assert runner.model.lm_head is None
    runner.profile_run(4)
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=5)
    prompts = {"a": [3, 1, 4, 1, 5, 9, 2, 6], "b": [2, 7, 1, 8]}
    for rid, prompt in prompts.items():
        sched.add_request(_embed_request(rid, prompt, embed_normalize=False))
    outputs = {}
    run_to_completion(sched, runner.execute_model,
                      on_output=lambda o: outputs.update({o.request_id: o.pooling_output}))
    for rid, prompt in prompts.items():
        torch.testing.assert_close(torch.tensor(outputs[rid]), _hf_pooled(bare, prompt, "LAST"), atol=1e-4,
                                   rtol=1e-4)
    with pytest.raises(RuntimeError, match="embeddings only"):
        runner.model.compute_logits(torch.zeros(1, config.hidden_size))


def test_embedding_only_skips_the_head_a_causal_checkpoint_carries(model_dir, hf_model):
    """--runner pooling on a causal LM checkpoint: the head it stores is not built or read."""
    import dataclasses

    from gpu_worker.config import ModelConfig
    from gpu_worker.model_runner import ModelRunner

    config = dataclasses.replace(ModelConfig.from_pretrained(model_dir), embedding_only=True)
    runner = ModelRunner(config, device="cpu", dtype=torch.float32)
    runner.load_model(model_dir)
    assert runner.model.lm_head is None and not any("lm_head" in n for n, _ in runner.model.named_parameters())
