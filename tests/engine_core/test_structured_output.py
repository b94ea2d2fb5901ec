"""Structured output's engine side: specs checked up front, grammars compiled off the busy loop
(cached), the allowed-token bitmask per pass, and matchers advanced by the sampled tokens. xgrammar
and the tiny model's real tokenizer."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from engine_core.outputs import EngineCoreRequest
from engine_core.request import FinishReason
from engine_core.sampling_params import SamplingParams
from engine_core.structured_output import MAX_SCHEMA_DEPTH, StructuredOutputManager, check_structured_output
from gpu_worker.sampler import unpack_bitmask
from tests.tiny_model import build_tokenizer

TOKENIZER = build_tokenizer()


@pytest.mark.parametrize(("spec", "message"), [
    ({"json": {"type": "object"}, "regex": "a"}, "exactly one of"),
    ({"xml": "<a/>"}, "exactly one of"),
    ({"regex": "(ab"}, "invalid regex: Regex parsing error"),
    ({"json": {"type": "objekt"}}, "invalid json"),
    ({"json": 5}, "a JSON schema must be an object or a string"),
    ({"choice": []}, "choice must be a non-empty list of strings"),
    ({"grammar": "root ::= "}, "invalid grammar"),
    ({"json_object": False}, "json_object must be true"),
    ({"regex": "a", "whitespace_pattern": " "}, "unsupported structured output option"),
    ({"regex": "a", "disable_any_whitespace": "yes"}, "disable_any_whitespace must be true or false"),
    ({"structural_tag": "not json"}, "a structural tag must be a JSON object"),
    ({"structural_tag": {"type": "structural_tag", "format": {"type": "bogus"}}}, "invalid structural_tag"),
    ({"structural_tag": {"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<a"]}},
     "each structure needs begin, schema and end"),
    ({"structural_tag": {"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>", "content": {
        "type": "json_schema", "json_schema": {"type": "array", "uniqueItems": True}}}}}, "'uniqueItems' .* cannot be"),
])
def test_malformed_specs_are_refused_with_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        check_structured_output(spec)


def test_well_formed_specs_pass():
    for spec in ({"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}, {"json": '{"type": "string"}'},
                 {"json_object": True}, {"regex": "[a-z]+"}, {"choice": ["a b", "c.d"]},
                 {"grammar": 'root ::= "yes" | "no"'}, {"json": {"type": "object"}, "disable_any_whitespace": True},
                 *({"structural_tag": tag} for tag in STRUCTURAL_TAGS.values())):
        check_structured_output(spec)


def test_structured_output_excludes_ignore_eos_and_min_tokens():
    for extra in ({"ignore_eos": True}, {"min_tokens": 2}):
        with pytest.raises(ValueError, match="structured_output must be used without ignore_eos and min_tokens"):
            SamplingParams(max_tokens=4, structured_output={"regex": "a"}, **extra)


@pytest.mark.parametrize(("schema", "where"), [
    ({"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}},
     "'uniqueItems' (at /properties/ids)"),
    ({"type": "array", "contains": {"type": "integer"}}, "'contains' (at /)"),
    ({"type": "integer", "not": {"const": 3}}, "'not' (at /)"),
    ({"anyOf": [{"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}]}, "'if' (at /anyOf/0)"),
    ({"$defs": {"P": {"type": "object", "dependentRequired": {"a": ["b"]}}}, "$ref": "#/$defs/P"},
     "'dependentRequired' (at /$defs/P)"),
    ({"type": "string", "pattern": "a+", "maxLength": 3}, "length limit beside a pattern (at /)"),
    ({"type": "string", "format": "email", "minLength": 5}, "minLength beside a format (at /)"),
    ({"type": "number", "multipleOf": 0.5}, "'multipleOf' on a number or beside bounds (at /)"),
    ({"type": "integer", "multipleOf": 5, "minimum": 0}, "'multipleOf' on a number or beside bounds"),
    ({"allOf": [{"required": ["a"]}, {"required": ["b"]}]}, "'allOf' of several schemas"),
    ({"type": "object", "properties": {"x": {"type": "integer"}}, "allOf": [{"required": ["x"]}]}, "'allOf'"),
])
def test_schemas_whose_keywords_generation_cannot_hold_are_refused(schema, where):
    """xgrammar compiles these keywords but generates as if they were absent: a 200 whose JSON
    breaks the schema is worse than a 400 that says which keyword to drop."""
    for spec in ({"json": schema}, {"json": json.dumps(schema)}):
        with pytest.raises(ValueError, match="cannot be enforced") as refused:
            check_structured_output(spec)
        assert where in str(refused.value)


def test_schemas_with_enforceable_keywords_pass():
    """Keyword names used as property names are names, not keywords; a lone $ref in allOf (pydantic
    v1's wrapping), annotations, oneOf, uniqueItems false and an unknown format (an annotation in
    JSON Schema) pass."""
    for schema in (
            {"type": "object", "properties": {"not": {"type": "integer"}, "contains": {"type": "string"},
                                              "if": {"type": "boolean"}}},
            {"title": "Wrapped", "description": "x", "allOf": [{"$ref": "#/definitions/P"}],
             "definitions": {"P": {"type": "integer", "minimum": 1, "maximum": 10}}},
            {"oneOf": [{"type": "integer"}, {"type": "string", "minLength": 1, "maxLength": 5}]},
            {"type": "array", "items": {"type": "string", "format": "path"}, "uniqueItems": False, "maxItems": 3},
            {"type": "object", "properties": {"d": {"type": "string", "format": "date"}},
             "additionalProperties": False, "required": ["d"]},
            # pydantic's HttpUrl (a maxLength beside a format is not held, as the README says), and an
            # unbounded integer multipleOf (held).
            {"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083},
            {"type": ["integer", "null"], "multipleOf": 5}):
        check_structured_output({"json": schema})


def test_numeric_bounds_are_held_exactly():
    """xgrammar before 0.2 let an integer minimum of 3 take 1 and a range 18..120 take 121."""
    import xgrammar as xgr

    for schema in ({"type": "integer", "minimum": 3}, {"type": "integer", "minimum": 18, "maximum": 120},
                   {"type": "integer", "exclusiveMinimum": 0}, {"type": "number", "minimum": 1.5}):
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema))
        for value in range(-30, 200):
            fits = (value >= schema.get("minimum", -1e9) and value <= schema.get("maximum", 1e9)
                    and value > schema.get("exclusiveMinimum", -1e9))
            assert xgr.testing._is_grammar_accept_string(grammar, str(value)) == fits, (schema, value)


def _manager() -> StructuredOutputManager:
    return StructuredOutputManager(lambda: TOKENIZER, len(TOKENIZER), (TOKENIZER.eos_token_id,))


def _poll_until_done(manager: StructuredOutputManager) -> tuple[list[str], list[tuple[str, str]]]:
    ready, failed = [], []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now_ready, now_failed = manager.poll()
        ready, failed = ready + now_ready, failed + now_failed
        if not manager.has_pending():
            break
        time.sleep(0.01)
    return ready, failed


def _allowed(manager: StructuredOutputManager, request_id: str) -> set[int]:
    grammar, failed = manager.bitmask([request_id])
    assert not failed
    words = np.frombuffer(grammar.bitmask, dtype=np.int32).reshape(len(grammar.request_ids), grammar.num_words)
    mask = unpack_bitmask(torch.from_numpy(words.copy()), len(TOKENIZER))[0]
    return set(torch.nonzero(mask).flatten().tolist())


def test_a_grammar_compiles_then_its_matcher_allows_only_what_fits_and_ends_with_eos():
    manager = _manager()
    manager.submit("a", {"choice": ["yes", "no"]})
    assert manager.is_structured("a") and manager.bitmask(["a"]) == (None, [])  # not compiled yet: no row
    assert _poll_until_done(manager) == (["a"], [])
    first = _allowed(manager, "a")
    assert first and all(TOKENIZER.decode([t]) and ("yes".startswith(TOKENIZER.decode([t]))
                                                    or "no".startswith(TOKENIZER.decode([t]))) for t in first)
    assert manager.accept("a", TOKENIZER.encode("yes", add_special_tokens=False)) is None
    assert _allowed(manager, "a") == {TOKENIZER.eos_token_id}  # the grammar is complete: only EOS
    assert manager.accept("a", [TOKENIZER.eos_token_id]) is None
    # A finished grammar constrains nothing more (xgrammar would raise if asked for its mask).
    assert manager.bitmask(["a"]) == (None, [])
    # A request without a matcher has no row; a removed one neither.
    manager.remove("a")
    assert manager.bitmask(["a", "other"]) == (None, []) and not manager.has_matchers()
    manager.shutdown()


WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                  "additionalProperties": False}
# A tool call inside free text, in xgrammar's structural tag form and in vLLM's older one (as vLLM's
# structured_outputs.structural_tag carries it: a JSON string).
STRUCTURAL_TAGS = {
    "format": {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<call="], "tags": [
        {"begin": "<call=weather>", "content": {"type": "json_schema", "json_schema": WEATHER_SCHEMA},
         "end": "</call>"}]}},
    "legacy": json.dumps({"type": "structural_tag", "triggers": ["<call="], "structures": [
        {"begin": "<call=weather>", "schema": WEATHER_SCHEMA, "end": "</call>"}]}),
}


@pytest.mark.parametrize("form", sorted(STRUCTURAL_TAGS))
def test_a_structural_tag_leaves_text_free_and_holds_each_tagged_structure(form):
    manager = _manager()
    check_structured_output({"structural_tag": STRUCTURAL_TAGS[form]})
    for request_id in ("fits", "breaks"):
        manager.submit(request_id, {"structural_tag": STRUCTURAL_TAGS[form]})
    assert sorted(_poll_until_done(manager)[0]) == ["breaks", "fits"]

    def tokens(text: str) -> list[int]:
        return TOKENIZER.encode(text, add_special_tokens=False)

    # Free text, a call that fits its schema, free text again.
    assert manager.accept("fits", tokens('Let me look. <call=weather>{"city": "Paris"}</call> Done.')) is None
    # Free text, then a call whose arguments break the schema: refused inside the call.
    assert manager.accept("breaks", tokens("Sure.")) is None
    assert manager.accept("breaks", tokens('<call=weather>{"town": "Paris"}')) is not None
    manager.shutdown()


@pytest.mark.parametrize("choices", [["", "yes", "no"], ["a", "", "b"],
                                     ["q\"uote|", "back\\slash (", "nul\x00", "東京"]])
def test_a_choice_matches_each_string_exactly_whatever_it_holds(choices):
    """Empty choices and regex or escape syntax inside one (a regex alternation refused an empty
    first or middle choice, and the request failed in the engine)."""
    import xgrammar as xgr

    from engine_core.structured_output import choice_grammar

    check_structured_output({"choice": choices})
    grammar = xgr.Grammar.from_ebnf(choice_grammar(choices))
    for text in choices:
        assert xgr.testing._is_grammar_accept_string(grammar, text)
    assert not xgr.testing._is_grammar_accept_string(grammar, choices[-1] + "x")
    manager = _manager()
    manager.submit("c", {"choice": choices})
    assert _poll_until_done(manager) == (["c"], [])
    manager.shutdown()


def test_requests_with_the_same_spec_share_one_compile():
    manager = _manager()
    for request_id in ("a", "b", "c"):  # all before the first compile ends (the normal burst)
        manager.submit(request_id, {"regex": "[0-9]{3}"})
    assert len({id(future) for _, future in manager._pending.values()}) == 1
    manager.remove("b")  # one leaving does not cancel the others' compile
    assert sorted(_poll_until_done(manager)[0]) == ["a", "c"] and not manager._compiling
    manager.shutdown()


def test_a_slow_compile_does_not_hold_up_the_grammars_behind_it():
    """Grammars compile on several threads: a large schema (a tool's, taking seconds) submitted first,
    a small regex after it: the regex is ready while the schema still compiles."""
    manager = StructuredOutputManager(lambda: TOKENIZER, len(TOKENIZER), (TOKENIZER.eos_token_id,),
                                      compile_workers=2)
    try:
        manager.submit("warm", {"regex": "a"})  # (xgrammar set up, as by an engine's earlier requests)
        _poll_until_done(manager)
        properties = {f"field{i}": {"type": "string", "pattern": "[a-z]{3,9}@[0-9]{2,5}"} for i in range(3000)}
        manager.submit("large", {"json": {"type": "object", "properties": properties, "required": list(properties)}})
        manager.submit("small", {"regex": "[0-9]{3}"})
        ready: list[str] = []
        deadline = time.monotonic() + 120
        while not ready and time.monotonic() < deadline:
            ready += manager.poll()[0]
            time.sleep(0.005)
        assert ready == ["small"] and manager.has_pending()  # (the schema is still compiling)
        assert _poll_until_done(manager)[0] == ["large"]
    finally:
        manager.shutdown()


def test_json_object_is_an_object_and_whitespace_can_be_disabled():
    manager = _manager()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    manager.submit("object", {"json_object": True})
    manager.submit("spaced", {"json": schema})
    manager.submit("compact", {"json": schema, "disable_any_whitespace": True})
    assert sorted(_poll_until_done(manager)[0]) == ["compact", "object", "spaced"]
    # OpenAI's json_object promises an object: a top-level array does not fit, and the request fails.
    error = manager.accept("object", TOKENIZER.encode("[1]", add_special_tokens=False))
    assert error is not None and "does not fit the grammar" in error and not manager.is_structured("object")
    newline = TOKENIZER.encode("{\n", add_special_tokens=False)
    assert manager.accept("spaced", newline) is None
    assert manager.accept("compact", newline) is not None
    manager.shutdown()


def test_the_same_spec_compiles_once_and_a_failed_compile_is_reported():
    manager = _manager()
    spec = {"json": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}
    manager.submit("a", spec)
    _poll_until_done(manager)
    compiled = dict(manager._compiled)
    manager.submit("b", json.loads(json.dumps(spec)))  # an equal spec: ready at the next poll, no compile
    assert manager._pending["b"][1].done()
    assert manager.poll() == (["b"], []) and dict(manager._compiled) == compiled
    # Unchecked input that xgrammar cannot compile fails that request only, with its error.
    manager.submit("c", {"regex": "(unclosed"})
    ready, failed = _poll_until_done(manager)
    assert ready == [] and [r for r, _ in failed] == ["c"] and "parenthesis" in failed[0][1]
    assert manager.has_matchers()
    manager.shutdown()


def test_the_engine_fails_only_the_request_whose_grammar_does_not_compile(tmp_path):
    from cluster.config import ClusterConfig, EngineSpec
    from engine_core.engine_core import EngineCore
    from gpu_worker.executor import create_executor
    from tests.tiny_model import build_tiny_llama

    config = ClusterConfig(model=str(build_tiny_llama(tmp_path)), defaults=EngineSpec(
        num_gpu_blocks=32, max_model_len=128)).engine_configs()[0]
    engine = EngineCore(config, create_executor(config))
    try:
        prompt = TOKENIZER.encode("Hello")
        # (The engine does not re-check specs: the router and the offline LLM refuse bad ones first.)
        z = TOKENIZER.convert_tokens_to_ids("z")
        # "clash": the grammar allows only a and b, allowed_token_ids only z: nothing fits, it fails alone;
        # "clash_last" the same on its last token (max_tokens): an error too, not "length".
        for rid, spec, allowed, max_tokens in (
                ("bad", {"regex": "(unclosed"}, None, 16), ("good", {"regex": "[ab]{4}"}, None, 16),
                ("clash", {"regex": "[ab]{4}"}, [z], 16), ("clash_last", {"regex": "[ab]{4}"}, [z], 1)):
            params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1, structured_output=spec,
                                    allowed_token_ids=allowed)
            engine.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params))
        # A streaming session's later turns would run without the grammar: refused at admission.
        from engine_core.engine_core import RequestRefusedError

        with pytest.raises(RequestRefusedError, match="cannot constrain a streaming session"):
            engine.add_request(EngineCoreRequest(request_id="session", prompt_token_ids=prompt, resumable=True,
                                                 sampling_params=SamplingParams(max_tokens=4,
                                                                                structured_output={"regex": "a"})))
        finished: dict[str, tuple] = {}
        tokens: list[int] = []
        deadline = time.monotonic() + 60
        while len(finished) < 4 and time.monotonic() < deadline:
            for eco in engine.step().values():
                for out in eco.outputs:
                    if out.request_id == "good":
                        tokens += out.new_token_ids
                    if out.finish_reason is not None:
                        finished[out.request_id] = (out.finish_reason, out.stop_reason)
            time.sleep(0.001)
    finally:
        engine.shutdown()
    assert finished["bad"][0] == FinishReason.ERROR and "parenthesis" in finished["bad"][1]
    for clash in ("clash", "clash_last"):
        assert finished[clash][0] == FinishReason.ERROR and "does not fit the grammar" in finished[clash][1]
    assert not engine._structured.has_matchers() and not engine._structured.has_pending()  # nothing left behind
    assert finished["good"][0] == FinishReason.STOP
    text = TOKENIZER.decode(tokens[:-1])
    assert len(text) == 4 and set(text) <= {"a", "b"} and tokens[-1] == TOKENIZER.eos_token_id


def test_only_requests_that_sample_this_pass_get_a_bitmask_row(tmp_path):
    """A structured request's prompt in 16-token chunks: the passes that end short of the prompt send
    no row for it (nothing is sampled there); the pass that completes it, and each decode, do."""
    from cluster.config import ClusterConfig, EngineSpec
    from engine_core.engine_core import EngineCore
    from gpu_worker.executor import create_executor
    from tests.tiny_model import build_tiny_llama

    config = ClusterConfig(model=str(build_tiny_llama(tmp_path)), defaults=EngineSpec(
        num_gpu_blocks=32, max_model_len=128, max_num_batched_tokens=16, long_prefill_token_threshold=16,
        max_num_partial_prefills=1)).engine_configs()[0]
    engine = EngineCore(config, create_executor(config))
    rows: list[tuple[int, list[str]]] = []  # (tokens scheduled for the request, requests with a row)
    execute = engine.executor.execute_model

    def recording(so):
        if "r" in so.num_scheduled_tokens:
            rows.append((so.num_scheduled_tokens["r"], so.grammar_bitmask.request_ids if so.grammar_bitmask else []))
        return execute(so)

    engine.executor.execute_model = recording
    try:
        prompt = list(range(3, 43))  # 40 tokens: chunks of 16, 16, 8
        params = SamplingParams(max_tokens=4, temperature=0, structured_output={"regex": "[ab]{3}"})
        engine.add_request(EngineCoreRequest(request_id="r", prompt_token_ids=prompt, sampling_params=params))
        finished = False
        deadline = time.monotonic() + 60
        while not finished and time.monotonic() < deadline:
            finished = any(o.finish_reason is not None for eco in engine.step().values() for o in eco.outputs)
    finally:
        engine.shutdown()
    assert rows[:3] == [(16, []), (16, []), (8, ["r"])]
    assert all(ids == ["r"] for n, ids in rows[3:]) and len(rows) == 6  # 3 letters, then EOS


def test_a_grammar_that_starts_after_a_token_sequence_constrains_nothing_before_it():
    manager = _manager()
    end = TOKENIZER.encode("</x>", add_special_tokens=False)
    assert len(end) > 1  # a sequence, seen across calls
    manager.submit("r", {"choice": ["yes"]}, starts_after=end)
    assert _poll_until_done(manager) == (["r"], [])
    assert manager.bitmask(["r"]) == (None, [])  # thinking: no row
    # Free tokens (ones the grammar would refuse), then the end sequence split over two outputs.
    assert manager.accept("r", [*TOKENIZER.encode("zz no", add_special_tokens=False), *end[:1]]) is None
    assert manager.bitmask(["r"]) == (None, [])
    assert manager.accept("r", [*end[1:], *TOKENIZER.encode("y", add_special_tokens=False)]) is None
    # After it the grammar holds, and had already taken the "y" that followed the sequence.
    assert {TOKENIZER.decode([t]) for t in _allowed(manager, "r")} <= {"e", "es"}
    assert manager.accept("r", TOKENIZER.encode("x", add_special_tokens=False)) is not None  # does not fit
    # A grammar that fails to compile leaves nothing behind, nor does clear().
    manager.submit("bad", {"regex": "(unclosed"}, starts_after=end)
    manager.submit("waits", {"choice": ["yes"]}, starts_after=end)
    assert [r for r, _ in _poll_until_done(manager)[1]] == ["bad"]
    assert "bad" not in manager._starts_after
    manager.clear()
    assert not manager._starts_after and not manager.has_matchers()
    manager.shutdown()


def test_a_grammar_that_waits_for_a_token_after_its_start_sequence():
    """Harmony (gpt-oss): the grammar holds over the final channel's body, after "<|channel|>final" and
    then the next "<|message|>", whatever the header names between (" <|constrain|>json"): here "</x>"
    and then "@" stand for them. Drafts are walked through both waits as outputs are."""
    manager = _manager()
    end = TOKENIZER.encode("</x>", add_special_tokens=False)
    message = TOKENIZER.encode("@", add_special_tokens=False)[0]
    manager.submit("r", {"choice": ["yes"]}, starts_after=end, then=message)
    assert _poll_until_done(manager) == (["r"], [])
    between = TOKENIZER.encode(" json", add_special_tokens=False)
    drafts = [*end, *between, message, *TOKENIZER.encode("y", add_special_tokens=False)]
    assert manager.validate_tokens("r", drafts) == drafts
    assert manager.validate_tokens("r", [*drafts, *TOKENIZER.encode("zz", add_special_tokens=False)]) == drafts
    assert manager.accept("r", [*TOKENIZER.encode("zz", add_special_tokens=False), *end, *between]) is None
    assert manager.bitmask(["r"]) == (None, [])  # (the sequence seen: still free until its token)
    assert manager.accept("r", [message]) is None
    assert {TOKENIZER.decode([t]) for t in _allowed(manager, "r")} <= {"y", "ye", "yes"}
    assert manager.accept("r", TOKENIZER.encode("x", add_special_tokens=False)) is not None  # does not fit
    manager.submit("again", {"choice": ["yes"]}, starts_after=end, then=message)
    manager.clear()
    assert not manager._then and not manager._starts_after
    manager.shutdown()


def test_a_first_token_that_opens_the_thinking_makes_the_grammar_wait_and_any_other_is_held():
    """qwen3's answers may think or not: <think> first and the grammar waits for </think>; any
    other first token is one the grammar allows, and it holds from there."""
    manager = _manager()
    opening = TOKENIZER.encode("@", add_special_tokens=False)[0]  # (stand-ins for <think> and </think>)
    end = TOKENIZER.encode("</x>", add_special_tokens=False)
    yes = set(TOKENIZER.encode("yes", add_special_tokens=False)[:1])
    for request_id in ("thinks", "answers"):
        manager.submit(request_id, {"choice": ["yes"]}, starts_after=end, may_open=opening)
    assert _poll_until_done(manager)[1] == []
    for request_id in ("thinks", "answers"):  # the first token: the grammar's or the opening one
        first = _allowed(manager, request_id)
        assert opening in first and first - {opening} and all(
            "yes".startswith(TOKENIZER.decode([t])) for t in first - {opening})
    assert manager.accept("thinks", [opening, *TOKENIZER.encode("zz no", add_special_tokens=False)]) is None
    assert manager.bitmask(["thinks"]) == (None, [])  # thinking: free
    assert manager.accept("thinks", end) is None
    assert opening not in _allowed(manager, "thinks")  # after the thinking: the grammar, from its start
    assert manager.accept("answers", sorted(yes)) is None
    assert opening not in _allowed(manager, "answers")  # (only the first token may open it)
    assert manager.accept("answers", TOKENIZER.encode("zz", add_special_tokens=False)) is not None
    manager.clear()
    assert not manager._may_open and not manager._starts_after
    manager.shutdown()


def test_the_engine_starts_a_grammar_after_the_thinking_ends(tmp_path):
    """Greedy on the tiny model: the answer runs free (as without a grammar) up to and including
    the first occurrence of the 'end of thinking' token, and fits the grammar after it."""
    from cluster.config import ClusterConfig, EngineSpec
    from engine_core.engine_core import EngineCore
    from gpu_worker.executor import create_executor
    from tests.tiny_model import build_tiny_llama

    config = ClusterConfig(model=str(build_tiny_llama(tmp_path)), defaults=EngineSpec(
        num_gpu_blocks=32, max_model_len=128)).engine_configs()[0]
    engine = EngineCore(config, create_executor(config))
    tokenizer = TOKENIZER  # (the tiny model's own)

    def run(request_id: str, params: SamplingParams) -> list[int]:
        engine.add_request(EngineCoreRequest(request_id=request_id, prompt_token_ids=tokenizer.encode("Hello"),
                                             sampling_params=params))
        tokens: list[int] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            outputs = [o for eco in engine.step().values() for o in eco.outputs if o.request_id == request_id]
            tokens += [t for o in outputs for t in o.new_token_ids]
            if any(o.finish_reason is not None for o in outputs):
                return tokens
        raise AssertionError("the request did not finish")

    try:
        free = run("free", SamplingParams(max_tokens=8, temperature=0))
        trigger = next(i for i, t in enumerate(free) if i >= 2 and t not in free[:i])  # first seen at i
        constrained = run("thinks", SamplingParams(max_tokens=24, temperature=0, structured_output={"regex": "[ab]{3}"},
                                                   structured_output_after=[free[trigger]]))
        # The wait is the answer's choice (qwen3): the greedy first token opens it, so the same
        # answer; an answer whose first token is not the opening one (biased away here) is held to
        # the grammar from the start.
        opened = run("opens", SamplingParams(max_tokens=24, temperature=0, structured_output={"regex": "[ab]{3}"},
                                             structured_output_after=[free[trigger]],
                                             structured_output_may_open=free[0]))
        unopened = run("held", SamplingParams(max_tokens=24, temperature=0, structured_output={"regex": "[ab]{3}"},
                                              structured_output_after=[free[trigger]],
                                              structured_output_may_open=free[0], logit_bias={free[0]: -100}))
    finally:
        engine.shutdown()
    assert constrained[:trigger + 1] == free[:trigger + 1]
    answer = constrained[trigger + 1:]
    assert set(tokenizer.decode(answer[:-1])) <= {"a", "b"} and len(tokenizer.decode(answer[:-1])) == 3
    assert answer[-1] == tokenizer.eos_token_id
    assert opened == constrained
    assert len(tokenizer.decode(unopened[:-1])) == 3 and set(tokenizer.decode(unopened[:-1])) <= {"a", "b"}


def _nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("as_text", [False, True])
def test_a_schema_nested_past_the_limit_is_refused_before_it_is_compiled(as_text):
    """600 levels took xgrammar 8 s to convert (on the router's event loop, then the engine's
    compile thread): past MAX_SCHEMA_DEPTH a schema is refused before any conversion."""
    check_structured_output({"json": _nested_arrays(MAX_SCHEMA_DEPTH - 1)})
    deep = _nested_arrays(600)
    with pytest.raises(ValueError, match="nested more than"):
        check_structured_output({"json": json.dumps(deep) if as_text else deep})
