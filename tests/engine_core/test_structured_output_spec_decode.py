"""Speculative decoding for structured-output requests, as vLLM does it: a draft is cut at the first
token its grammar refuses before it is scheduled, the pass masks each of a request's rows with its
grammar as of that row's position, and only the tokens the pass keeps advance the matcher. Real
xgrammar, the tiny model's real tokenizer, and a real engine core running the tiny random model."""

from __future__ import annotations

import re
import shutil
import time
from itertools import pairwise
from typing import NamedTuple

import numpy as np
import pytest
import torch

from engine_core.outputs import EngineCoreRequest
from engine_core.request import FinishReason
from engine_core.sampling_params import SamplingParams
from engine_core.sched.output import GrammarBitmask
from engine_core.structured_output import StructuredOutputManager
from gpu_worker.sampler import unpack_bitmask
from tests.tiny_model import build_tokenizer

TOKENIZER = build_tokenizer()
EOS = TOKENIZER.eos_token_id
VOCAB = len(TOKENIZER)


def _id(text: str) -> int:
    (token,) = TOKENIZER.encode(text, add_special_tokens=False)
    return token


A, B, C, Z = _id("a"), _id("b"), _id("c"), _id("z")


def _manager(*requests: tuple) -> StructuredOutputManager:
    """A manager with each (request id, spec, starts_after) compiled and ready."""
    manager = StructuredOutputManager(lambda: TOKENIZER, VOCAB, (EOS,))
    for request_id, spec, *after in requests:
        manager.submit(request_id, spec, after[0] if after else None)
    deadline = time.monotonic() + 60
    ready: list[str] = []
    while manager.has_pending() and time.monotonic() < deadline:
        ready += manager.poll()[0]
        time.sleep(0.01)
    assert sorted(ready) == sorted(r[0] for r in requests)
    return manager


def _rows(manager: StructuredOutputManager, request_ids: list[str], spec_tokens: dict[str, list[int]]
          ) -> dict[str, list[set[int]]]:
    """Each request's rows of the pass's bitmask, as the sets of tokens they allow."""
    grammar, failed = manager.bitmask(request_ids, spec_tokens)
    assert not failed
    if grammar is None:
        return {}
    words = np.frombuffer(grammar.bitmask, dtype=np.int32).reshape(sum(grammar.num_rows), grammar.num_words)
    allowed = unpack_bitmask(torch.from_numpy(words.copy()), VOCAB)
    sets = [set(torch.nonzero(row).flatten().tolist()) for row in allowed]
    out, at = {}, 0
    for request_id, n in zip(grammar.request_ids, grammar.num_rows, strict=True):
        out[request_id], at = sets[at:at + n], at + n
    return out


def _reference(spec_regex: str, tokens: list[int]) -> set[int]:
    """What a fresh matcher of the regex allows after ``tokens`` (xgrammar on its own)."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(TOKENIZER, vocab_size=VOCAB, stop_token_ids=[EOS])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_regex(spec_regex))
    for token in tokens:
        assert matcher.accept_token(token)
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return set(torch.nonzero(unpack_bitmask(bitmask, VOCAB)[0]).flatten().tolist())


def test_a_draft_is_cut_at_the_first_token_its_grammar_refuses_and_the_matcher_stays_put():
    manager = _manager(("r", {"regex": "[ab]{2,3}"}))
    try:
        before = _rows(manager, ["r"], {})["r"]
        assert manager.validate_tokens("r", [A, B, Z, A]) == [A, B]  # z does not fit: cut there
        assert manager.validate_tokens("r", [Z, A]) == []
        assert manager.validate_tokens("r", [A, B, A, B]) == [A, B, A]  # a fourth letter does not fit
        # The grammar ends with EOS: nothing is drafted after it.
        assert manager.validate_tokens("r", [A, B, EOS, A]) == [A, B, EOS]
        assert manager.validate_tokens("unknown", [Z, Z]) == [Z, Z]  # (no grammar: the draft stands)
        assert _rows(manager, ["r"], {})["r"] == before  # each check rolled the matcher back
        assert manager.accept("r", [A]) is None
        assert manager.validate_tokens("r", [B, B, B]) == [B, B]  # checked from where the request is
    finally:
        manager.shutdown()


def test_a_drafted_pass_has_a_mask_per_position_and_the_matcher_advances_by_the_kept_tokens_only():
    """Row j is the grammar's mask after draft j (vLLM's layout); after a draft that ends the grammar
    a row allows every token; a request without drafts keeps one row."""
    regex = "[ab]{2,3}"
    manager = _manager(("r", {"regex": regex}), ("plain", {"regex": regex}))
    try:
        rows = _rows(manager, ["r", "plain"], {"r": [A, B, A]})
        assert [len(rows["r"]), len(rows["plain"])] == [4, 1]
        assert rows["r"] == [_reference(regex, [A, B, A][:j]) for j in range(4)]
        assert rows["r"][3] == {EOS} and Z not in rows["r"][0] and EOS in rows["r"][2]
        assert rows["plain"] == [_reference(regex, [])]
        # A draft that ends the grammar: the row after its EOS constrains nothing.
        ended = _rows(manager, ["r"], {"r": [A, B, EOS]})["r"]
        assert ended[:3] == [_reference(regex, [A, B][:j]) for j in range(3)]
        assert ended[3] == set(range(VOCAB))
        # The pass kept the first draft and drew b where the second was rejected: the matcher
        # advances by those two only (a rejected draft leaves nothing behind).
        assert manager.accept("r", [A, B]) is None
        assert _rows(manager, ["r"], {})["r"] == [_reference(regex, [A, B])]
    finally:
        manager.shutdown()


def test_drafts_through_the_end_of_the_thinking_are_masked_from_the_grammars_start_on():
    """A grammar that starts after a token sequence: the rows up to the sequence's last token allow
    every token (the thinking is free, its drafts are not cut); the rows after it follow the grammar."""
    regex = "[ab]{2}"
    end = TOKENIZER.encode("</x>", add_special_tokens=False)
    manager = _manager(("r", {"regex": regex}, end))
    try:
        thinking = [Z, C, *end[:1]]
        assert manager.validate_tokens("r", thinking) == thinking
        assert _rows(manager, ["r"], {"r": thinking}) == {}  # no position the grammar holds: no rows
        draft = [Z, *end, A, Z]
        assert manager.validate_tokens("r", draft) == draft[:-1]  # z after the thinking does not fit
        rows = _rows(manager, ["r"], {"r": draft[:-1]})["r"]
        every = set(range(VOCAB))
        assert rows == [every] * (1 + len(end)) + [_reference(regex, []), _reference(regex, [A])]
        assert "r" in manager._starts_after  # (checking drafts left the sequence's progress alone)
    finally:
        manager.shutdown()


# -- a real engine ---------------------------------------------------------------------------------

PROMPTS = ["Hello", "Paris is the capital of", "def main():\n    return 42\n",
           "The quick brown fox jumps over the lazy dog. " * 2, "naïve café 😀"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# The letters a and e are refused anywhere: the tiny model's own (unconstrained) picks often hold them.
NO_A_OR_E = "[^ae]{1,60}"


@pytest.fixture(scope="module")
def weakened_draft(tiny_model_dir, tmp_path_factory):
    """The target with its last MLP halved: it proposes tokens the target often rejects."""
    from safetensors.torch import load_file, save_file

    draft = shutil.copytree(tiny_model_dir, tmp_path_factory.mktemp("draft") / "model")
    tensors = load_file(draft / "model.safetensors")
    for name in tensors:
        if name.startswith("model.layers.1.mlp."):
            tensors[name] *= 0.5
    save_file(tensors, draft / "model.safetensors", metadata={"format": "pt"})
    return draft


class Pass(NamedTuple):
    num_scheduled_tokens: dict[str, int]
    scheduled_spec_decode_tokens: dict[str, list[int]]
    grammar_bitmask: GrammarBitmask | None
    proposed: dict[str, list[int]]  # (by the draft model, after the pass)
    sampled: dict[str, list[int]]


def _run(model_dir, params: list[SamplingParams], speculative_config=None, record=None):
    """Each request's tokens and finish reason, and the engine's stats. ``record`` gets each pass."""
    from cluster.config import ClusterConfig, EngineSpec
    from engine_core.engine_core import EngineCore
    from gpu_worker.executor import create_executor

    config = ClusterConfig(model=str(model_dir), defaults=EngineSpec(
        num_gpu_blocks=64, max_model_len=256, speculative_config=speculative_config)).engine_configs()[0]
    engine = EngineCore(config, create_executor(config))
    if record is not None:
        execute = engine.executor.execute_model

        def recording(so):
            out = execute(so)
            sampled = {r: out.sampled_token_ids[i] for r, i in out.req_id_to_index.items()}
            record.append(Pass(dict(so.num_scheduled_tokens), dict(so.scheduled_spec_decode_tokens),
                               so.grammar_bitmask, out.draft_token_ids or {}, sampled))
            return out

        engine.executor.execute_model = recording
    tokens: dict[str, list[int]] = {}
    finished: dict[str, FinishReason] = {}
    try:
        for i, p in enumerate(params):
            request_id = str(i)
            tokens[request_id] = []
            engine.add_request(EngineCoreRequest(request_id=request_id, prompt_token_ids=TOKENIZER.encode(
                PROMPTS[i % len(PROMPTS)]), sampling_params=p))
        deadline = time.monotonic() + 120
        while len(finished) < len(params) and time.monotonic() < deadline:
            for eco in engine.step().values():
                for out in eco.outputs:
                    tokens[out.request_id] += out.new_token_ids
                    if out.finish_reason is not None:
                        finished[out.request_id] = out.finish_reason
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert len(finished) == len(params), "the requests did not finish"
    return tokens, finished, stats


def _greedy_params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=30, temperature=0.0, structured_output={"regex": NO_A_OR_E}),
            SamplingParams(max_tokens=30, temperature=0.0, structured_output={"regex": "[a-z ]{5,30}"}),
            SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),  # (no grammar, in the same batch)
            SamplingParams(max_tokens=30, temperature=0.0, structured_output={"regex": NO_A_OR_E}),
            SamplingParams(max_tokens=30, temperature=0.0, structured_output={"json": {
                "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}})]


@pytest.mark.parametrize("drafter", ["ngram", "draft_model_target", "draft_model_weakened"])
def test_greedy_structured_answers_are_the_same_token_for_token_with_drafts(tiny_model_dir, weakened_draft,
                                                                            drafter):
    """Structured requests are drafted for, drafts are accepted, and each answer is the one plain
    decoding gives. A draft model proposes without the grammar: the target itself proposes its own
    unconstrained picks, which the grammar often refuses (cut before they are scheduled; the pass's
    last row must then carry the grammar's mask after the last draft kept); the weakened model
    proposes tokens the grammar allows but the target rejects (the token drawn in their place comes
    from that row's masked distribution). A mask on the wrong row changes the answer."""
    params = _greedy_params()
    spec = {"ngram": NGRAM, "draft_model_target": {"model": str(tiny_model_dir), "num_speculative_tokens": 4},
            "draft_model_weakened": {"model": str(weakened_draft), "num_speculative_tokens": 4}}[drafter]
    plain, plain_finished, _ = _run(tiny_model_dir, params)
    record: list = []
    drafted, drafted_finished, stats = _run(tiny_model_dir, params, spec, record)
    assert drafted == plain and drafted_finished == plain_finished
    assert FinishReason.ERROR not in plain_finished.values()
    structured = {str(i) for i, p in enumerate(params) if p.structured_output is not None}
    scheduled = [(r, d) for step in record for r, d in step.scheduled_spec_decode_tokens.items() if r in structured]
    assert scheduled, "no structured request was drafted for"
    assert stats.spec_decode_num_accepted_tokens > 0
    for step in record:  # a mask per position: 1 + the drafts scheduled
        if step.grammar_bitmask is not None:
            assert step.grammar_bitmask.num_rows == [1 + len(step.scheduled_spec_decode_tokens.get(r, ()))
                                                     for r in step.grammar_bitmask.request_ids]
    if drafter == "ngram":
        return
    # The draft model proposed tokens the grammar refuses: each scheduled draft is its proposal up
    # to the first such token (as a matcher of its own, fed the request's tokens, tells).
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(TOKENIZER, vocab_size=VOCAB, stop_token_ids=[EOS])
    compiled = xgr.GrammarCompiler(info).compile_regex(NO_A_OR_E)
    outputs: dict[str, list[int]] = {r: [] for r in drafted}
    num_cut = 0
    for step, after in pairwise(record):
        for r, sampled in step.sampled.items():
            outputs[r] += sampled
        for r, proposal in step.proposed.items():
            if params[int(r)].structured_output != {"regex": NO_A_OR_E} or r not in after.num_scheduled_tokens:
                continue
            draft = after.scheduled_spec_decode_tokens.get(r, [])
            matcher = xgr.GrammarMatcher(compiled)
            assert all(matcher.accept_token(t) for t in outputs[r] + draft)
            assert proposal[:len(draft)] == draft
            if len(draft) < len(proposal):
                assert not matcher.accept_token(proposal[len(draft)])
                num_cut += 1
    assert num_cut > 0


def test_random_structured_answers_fit_their_grammar_with_drafts(tiny_model_dir):
    """Unseeded random requests with a grammar are drafted for (by the target as its own draft
    model, which proposes its unconstrained greedy picks): drafts are accepted with the masked
    target's probability, the token drawn after a rejection comes from the masked residual, and
    every answer fits its grammar (a token outside it would fail the request)."""
    import xgrammar as xgr

    params = [SamplingParams(max_tokens=30, temperature=0.3, structured_output={"regex": NO_A_OR_E})] * 6
    tokens, finished, stats = _run(tiny_model_dir, params, {"model": str(tiny_model_dir), "num_speculative_tokens": 4})
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted_tokens > 0
    info = xgr.TokenizerInfo.from_huggingface(TOKENIZER, vocab_size=VOCAB, stop_token_ids=[EOS])
    compiled = xgr.GrammarCompiler(info).compile_regex(NO_A_OR_E)
    for request_id, answer in tokens.items():
        assert finished[request_id] in (FinishReason.STOP, FinishReason.LENGTH)
        matcher = xgr.GrammarMatcher(compiled)
        assert all(matcher.accept_token(t) for t in answer)


def test_a_draft_across_the_end_of_the_thinking_gives_the_greedy_answer_of_plain_decoding(tiny_model_dir):
    """A grammar that starts after a token (a reasoning model's end of thinking): the target, as
    its own draft model, proposes through that token; the draft keeps the free tokens and the end,
    and is cut at the first token after it that the grammar refuses; the pass masks only the rows
    after the end. The answer is plain decoding's: free up to the end, the grammar's after it."""
    free, _, _ = _run(tiny_model_dir, [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)])
    free = free["0"]
    trigger = next(i for i, t in enumerate(free) if i >= 2 and t not in free[:i])  # first seen at i
    regex = "[a-z ]{3,20}"
    params = [SamplingParams(max_tokens=30, temperature=0.0, structured_output={"regex": regex},
                             structured_output_after=[free[trigger]])]
    plain, plain_finished, _ = _run(tiny_model_dir, params)
    record: list[Pass] = []
    drafted, finished, stats = _run(tiny_model_dir, params, {"model": str(tiny_model_dir),
                                                             "num_speculative_tokens": 4}, record)
    assert drafted == plain and finished == plain_finished == {"0": FinishReason.STOP}
    answer = drafted["0"]
    assert answer[:trigger + 1] == free[:trigger + 1]
    assert re.fullmatch(regex, TOKENIZER.decode(answer[trigger + 1:-1])) and answer[-1] == EOS
    # A pass verified a draft that ends the thinking, with the grammar's rows after it.
    crossing = [step for step in record if free[trigger] in step.scheduled_spec_decode_tokens.get("0", ())
                and step.grammar_bitmask is not None]
    assert crossing and stats.spec_decode_num_accepted_tokens > 0
