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
    allowed_token_ids, in one batch: the same answers with and without drafting. (Requests short of
    min_tokens are not drafted for; the rest are, the grammar's too.)"""
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


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_penalties_and_bad_words_apply_to_each_draft_as_of_its_position(tiny_model_dir, drafter):
    """Greedy requests with each penalty and with bad words are drafted for (a model whose
    generation config sets a repetition penalty, as Qwen2.5's does, sets it on every request) and
    answer as without drafts: each draft row is penalised as of the tokens before it, not for the
    drafts after it. (The draft model is the target without the penalties: its drafts are often
    the tokens a penalty turns away.)"""
    prompts = PROMPTS[:5]
    params = [SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.0, frequency_penalty=1.5, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.0, presence_penalty=2.0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.05, frequency_penalty=0.5,
                             logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.0, bad_words=["b c", "d"], ignore_eos=True)]
    plain, _ = run(tiny_model_dir, prompts, params, num_gpu_blocks=64)
    spec = NGRAM if drafter == "ngram" else _draft(tiny_model_dir, k=4)
    drafted, stats = run(tiny_model_dir, prompts, params, num_gpu_blocks=64, speculative_config=spec)
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted_tokens > 0
    for a, b in zip(plain, drafted, strict=True):
        x, y = a.outputs[0], b.outputs[0]
        assert (y.token_ids, y.text) == (x.token_ids, x.text)
        if x.logprobs is not None:
            assert [list(p) for p in y.logprobs] == [list(p) for p in x.logprobs]


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


# A draft model (vLLM's draft_model method): the target itself, or another tiny model of the same vocabulary.
def _draft(model_dir, k=3):
    return {"model": str(model_dir), "num_speculative_tokens": k}


def test_a_draft_model_that_is_the_target_has_every_draft_accepted_through_preemption_and_the_prefix_cache(
        tiny_model_dir):
    """The draft's cache mirrors the target's, whatever the scheduler does: with the target as its own
    draft, every proposed token is accepted, through chunked prefill, preemption (recomputed prompts)
    and prefix-cache hits (blocks another request computed), and the answers are transformers'."""
    max_tokens = 24
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=10, max_num_batched_tokens=16, max_num_seqs=8,
              max_model_len=128, speculative_config=_draft(tiny_model_dir))
    try:
        first = llm.generate(PROMPTS, params, use_tqdm=False)
        stats = llm.get_stats()[0]
        llm.generate(PROMPTS[3:4], params, use_tqdm=False)
        before = llm.get_stats()[0]
        again = llm.generate(PROMPTS[3:4], params, use_tqdm=False)  # (its prompt's full blocks are cached)
        stats_again = llm.get_stats()[0]
    finally:
        llm.shutdown()
    expected = hf_greedy(tiny_model_dir, PROMPTS, max_tokens)
    assert [o.outputs[0].token_ids for o in first] == expected
    assert [o.outputs[0].token_ids for o in again] == expected[3:4]
    assert stats.num_preemptions > 0, "the KV pool was meant to force preemption"
    # (At most one draft token lost to a near tie: the draft decodes one token a pass, the target
    # verifies several at once, so their sums may round apart; a stale cache would lose far more.)
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_draft_tokens - stats.spec_decode_num_accepted_tokens <= 1
    assert sum(o.num_cached_tokens for o in again) > 0
    drafted = stats_again.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = stats_again.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    assert drafted > 0 and drafted - accepted <= 1
    assert stats_again.num_free_blocks == stats_again.num_blocks


def test_another_draft_model_changes_no_answer(tiny_model_dir, tmp_path):
    """A draft that often guesses wrong (another random model): the answers are still the target's
    own, greedy and with the other sampling features, and some drafts are accepted."""
    import shutil

    from safetensors.torch import load_file, save_file

    # The target with its last MLP weakened: it agrees with the target on some tokens only.
    draft = shutil.copytree(tiny_model_dir, tmp_path / "draft")
    tensors = load_file(draft / "model.safetensors")
    for name in tensors:
        if name.startswith("model.layers.1.mlp."):
            tensors[name] *= 0.5
    save_file(tensors, draft / "model.safetensors", metadata={"format": "pt"})
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.0, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[40, 41, 42, 43]),
              SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.0, min_tokens=10, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.0, allowed_token_ids=list(range(30, 60)), ignore_eos=True)]
    plain, _ = run(tiny_model_dir, PROMPTS[:6], params, num_gpu_blocks=64)
    drafted, stats = run(tiny_model_dir, PROMPTS[:6], params, num_gpu_blocks=64,
                         speculative_config=_draft(draft, k=4))
    for a, b in zip(plain, drafted, strict=True):
        x, y = a.outputs[0], b.outputs[0]
        assert (y.token_ids, y.finish_reason) == (x.token_ids, x.finish_reason)
        if x.logprobs is not None:
            assert [list(p) for p in y.logprobs] == [list(p) for p in x.logprobs]
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    random_answers, _ = run(tiny_model_dir, PROMPTS, SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True),
                            num_gpu_blocks=64, speculative_config=_draft(draft))
    assert all(len(o.outputs[0].token_ids) == 12 for o in random_answers)


def test_a_draft_model_and_kv_offloading_on_two_tensor_parallel_ranks(ray_cluster, tiny_model_dir):
    """The draft shards over the target's two workers; the sampling rank shares each new token with
    the other, so both run the same draft passes. With KV offloading each rank keeps its share of
    the evicted blocks (the target's and the draft's) and loads them back: a prompt whose blocks
    were pushed out is found in the host tier and its drafts are still all accepted."""
    max_tokens = 16
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(tiny_model_dir), tensor_parallel_size=2, num_gpu_blocks=16, max_num_batched_tokens=16,
              max_model_len=128, speculative_config=_draft(tiny_model_dir), kv_offloading_size=0.001)
    try:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        llm.generate([f"Story number {i}: once upon a time, far away. " * 2 for i in range(8)], params,
                     use_tqdm=False)
        before = llm.get_stats()[0]
        again = llm.generate(PROMPTS[3:4], params, use_tqdm=False)
        stats = llm.get_stats()[0]
    finally:
        llm.shutdown()
    expected = hf_greedy(tiny_model_dir, PROMPTS, max_tokens)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert again[0].outputs[0].token_ids == expected[3]
    assert again[0].num_cached_tokens > 0 and stats.kv_offload_loaded_blocks > before.kv_offload_loaded_blocks
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_draft_tokens - stats.spec_decode_num_accepted_tokens <= 1


@pytest.mark.timeout(180)  # (the failure this guards against is a request that waits forever)
def test_lookahead_slots_never_reach_past_max_model_len(tiny_model_dir):
    """A prompt that fits the pool only without lookahead slots past max_model_len (8 blocks of 16,
    max_model_len 128, a 126-token prompt) is served, not left waiting."""
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=8, max_model_len=128,
              speculative_config=_draft(tiny_model_dir))
    try:
        out = llm.generate([list(range(10, 136))], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)
    finally:
        llm.shutdown()
    assert len(out[0].outputs[0].token_ids) == 2


def _windowed_copy(model_dir, path, window):
    """The tiny Llama read as a Mistral whose every layer attends through ``window`` tokens."""
    import json
    import shutil

    path = shutil.copytree(model_dir, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"],
                                                  "model_type": "mistral", "sliding_window": window}))
    return path


def test_a_windowed_target_takes_a_draft_windowed_no_wider(tiny_model_dir, tmp_path):
    """A target that frees blocks behind its window: a draft attending as far keeps proposing what the
    target would (prompts longer than the window), one attending further is refused."""
    target = _windowed_copy(tiny_model_dir, tmp_path / "target", 16)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain, _ = run(target, PROMPTS, params, num_gpu_blocks=64, max_model_len=128)
    drafted, stats = run(target, PROMPTS, params, num_gpu_blocks=64, max_model_len=128,
                         speculative_config=_draft(target))
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_draft_tokens - stats.spec_decode_num_accepted_tokens <= 1
    with pytest.raises(ValueError, match="the draft model attends further back"):
        LLM(model=str(target), num_gpu_blocks=64, max_model_len=128, speculative_config=_draft(tiny_model_dir))


def test_a_draft_model_keeps_its_cache_on_the_full_attention_group_of_a_hybrid_kv_cache(tmp_path):
    """Gemma 3's pattern (five windowed layers of 8 keys to one full layer) as its own draft, under the
    hybrid KV cache manager: the draft's cache lies on the full-attention group's blocks (its windowed
    layers read their window there), the windowed groups' blocks behind the window go back to the
    pool, and every draft is accepted through chunked prefill, preemption and prefix-cache hits, the
    answers transformers'. Where the draft's pages beside every block would outweigh what the groups
    save, the engine keeps one group."""
    import torch

    from tests.cluster.test_architectures import PROMPTS as ID_PROMPTS
    from tests.engine_core.test_engine_service import _greedy_holding
    from tests.gpu_worker.utils import hf_greedy as hf_greedy_ids
    from tests.gpu_worker.utils import load_hf, save_tiny_model
    from tests.tiny_model import build_tokenizer

    model = save_tiny_model(tmp_path / "gemma3", "gemma3", num_hidden_layers=6, sliding_window_pattern=6,
                            max_position_embeddings=256)
    build_tokenizer().save_pretrained(model)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # (110 blocks of 4: a 256-token request holds 64 blocks in the full group and at most 8 in each windowed
    # one; decoding, 5: 7 pages a block over 89 blocks against 12 over 64, so the groups stay.)
    llm = LLM(model=str(model), num_gpu_blocks=110, block_size=4, max_num_batched_tokens=16, max_num_seqs=8,
              max_model_len=256, speculative_config=_draft(model))
    try:
        engine = llm._engine
        assert len(engine.model_info.kv_cache_groups) == 6
        first = llm.generate(ID_PROMPTS, params, use_tqdm=False)
        stats = llm.get_stats()[0]
        llm.generate(ID_PROMPTS[2:3], params, use_tqdm=False)
        again = llm.generate(ID_PROMPTS[2:3], params, use_tqdm=False)  # (its 45-token prompt's blocks are cached)
        stats_again = llm.get_stats()[0]
        manager = engine.scheduler.kv_cache_manager
        prompt = [(7 * i + 3) % 256 for i in range(100)]
        long_answer, held = _greedy_holding(engine, prompt, 8,
                                            lambda rid: manager.get_num_held_blocks(rid) - manager.get_num_blocks(rid))
        final = llm.get_stats()[0]
    finally:
        llm.shutdown()
    hf = load_hf(model)
    with torch.no_grad():
        expected = [hf_greedy_ids(hf, p, 24) for p in ID_PROMPTS]
        assert long_answer == hf_greedy_ids(hf, prompt, 8)
    assert [o.outputs[0].token_ids for o in first] == expected
    assert [o.outputs[0].token_ids for o in again] == expected[2:3]
    assert stats.num_preemptions > 0, "the KV pool was meant to force preemption"
    assert sum(o.num_cached_tokens for o in again) > 0
    # (At most one draft lost to a near tie a run, as above; a draft reading a released block would lose many.)
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_draft_tokens - stats.spec_decode_num_accepted_tokens <= 1
    drafted = final.spec_decode_num_draft_tokens - stats.spec_decode_num_draft_tokens
    accepted = final.spec_decode_num_accepted_tokens - stats.spec_decode_num_accepted_tokens
    assert drafted > 0 and drafted - accepted <= 2
    # Each windowed group held at most (7 keys behind + 16 new + 3 lookahead) / 4, plus a block at each end.
    assert 0 < held <= 5 * 8
    assert stats_again.num_free_blocks == stats_again.num_blocks and final.num_free_blocks == final.num_blocks
    # Where every request lies within the window, each holds a block in every group a position, and the
    # draft's pages beside each would outweigh what the groups save: one group.
    short = LLM(model=str(model), num_gpu_blocks=110, block_size=4, max_model_len=16, speculative_config=_draft(model))
    try:
        assert short._engine.model_info.kv_cache_groups == ()
    finally:
        short.shutdown()


def test_a_draft_with_the_beginning_of_the_targets_vocabulary(tiny_model_dir, tmp_path):
    """A draft whose vocabulary is the target's first ids (as a target's is padded for its shards):
    target tokens beyond it (a few of the prompts') reach the draft as token 0, and the answers stay
    the target's."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    draft = shutil.copytree(tiny_model_dir, tmp_path / "draft")
    config = json.loads((draft / "config.json").read_text())
    cut = config["vocab_size"] - 8
    (draft / "config.json").write_text(json.dumps({**config, "vocab_size": cut}))
    tensors = load_file(draft / "model.safetensors")
    tensors = {k: v[:cut].clone() if k in ("model.embed_tokens.weight", "lm_head.weight") else v
               for k, v in tensors.items()}
    save_file(tensors, draft / "model.safetensors", metadata={"format": "pt"})
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    drafted, stats = run(tiny_model_dir, PROMPTS, params, num_gpu_blocks=64, speculative_config=_draft(draft))
    expected = hf_greedy(tiny_model_dir, PROMPTS, 24)
    assert [o.outputs[0].token_ids for o in drafted] == expected
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert any(t >= cut for p in PROMPTS for t in tokenizer.encode(p)), "the prompts were meant to use the cut ids"
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_a_draft_model_must_suit_the_target(tiny_model_dir, tmp_path):
    from engine_core.config import EngineConfig, SpeculativeConfig
    from tests.tiny_model import build_tiny_llama

    assert SpeculativeConfig.from_dict({"model": "d", "num_speculative_tokens": 2}).method == "draft_model"
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        SpeculativeConfig.from_dict({"method": "ngram", "model": "d", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"speculative_config\.method"):
        SpeculativeConfig.from_dict({"method": "medusa", "model": "d", "num_speculative_tokens": 2})
    spec = SpeculativeConfig.from_dict({"model": "d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1})
    with pytest.raises(ValueError, match="draft_tensor_parallel_size"):
        EngineConfig(model="m", tensor_parallel_size=2, speculative_config=spec)
    mtp = SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 1, "draft_tensor_parallel_size": 1})
    with pytest.raises(ValueError, match="draft_tensor_parallel_size"):
        EngineConfig(model="m", tensor_parallel_size=2, speculative_config=mtp)
    short = build_tiny_llama(tmp_path / "short", max_positions=64)
    with pytest.raises(ValueError, match="the draft model's context"):
        LLM(model=str(tiny_model_dir), num_gpu_blocks=16, max_model_len=128, speculative_config=_draft(short))
    import json
    import shutil

    wider = shutil.copytree(tiny_model_dir, tmp_path / "wider")
    config = json.loads((wider / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 64}))
    with pytest.raises(ValueError, match=r"the draft model's vocabulary .* is larger than the target's"):
        LLM(model=str(tiny_model_dir), num_gpu_blocks=16, max_model_len=128, speculative_config=_draft(wider))
    from tests.gpu_worker.utils import save_tiny_model
    from tests.tiny_model import build_tokenizer

    hybrid = save_tiny_model(tmp_path / "hybrid", "granitemoehybrid")
    build_tokenizer().save_pretrained(hybrid)
    with pytest.raises(ValueError, match=r"the draft model \(GraniteMoeHybridForCausalLM\) has recurrent layers"):
        LLM(model=str(tiny_model_dir), num_gpu_blocks=16, max_model_len=128, speculative_config=_draft(hybrid))
    with pytest.raises(ValueError, match="takes no drafter"):
        LLM(model=str(tiny_model_dir), num_gpu_blocks=16, runner="pooling", speculative_config=_draft(tiny_model_dir))
