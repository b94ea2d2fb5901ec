"""/pooling under per-token pooling (reward models, token embeddings) and the chat form of the
pooling endpoints (``messages``), against a scripted engine: what reaches the engine, and how each
input's flattened rows come back."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from router.classification import class_probabilities
from tests.router.tokenizer_factory import byte_level_tokenizer
from tests.tiny_model import CHAT_TEMPLATE

from .test_request_fields import TOKENIZER, _app, scripted_embedding

# (Copies: byte_level_tokenizer() is one cached object the other router tests share.)
CHAT_TOKENIZER = copy.deepcopy(byte_level_tokenizer())
CHAT_TOKENIZER.chat_template = CHAT_TEMPLATE
CONVERSATION = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "It is 4."}]
REWARD_MODEL = {"generates": False, "labels": ("LABEL_0",), "pooling_type": "ALL", "classifier_activation": "none",
                "row_size": 1}
PROCESS_REWARD_MODEL = {"generates": False, "labels": ("LABEL_0", "LABEL_1"), "pooling_type": "STEP",
                        "step_tag_id": 7, "row_size": 2}


def _rendered(messages, add_generation_prompt: bool = False) -> list[int]:
    text = CHAT_TOKENIZER.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return CHAT_TOKENIZER.encode(text, add_special_tokens=False)


def test_a_reward_model_scores_a_conversation_token_by_token():
    """messages are written by the chat template (no generation prompt unless asked) and pooled as one
    input; an outcome reward model answers one raw reward per token."""
    http, engine = _app(tokenizer=CHAT_TOKENIZER, num_pooled=6, pooling=REWARD_MODEL)
    body = http.post("/pooling", json={"model": "tiny", "messages": CONVERSATION}).json()
    prompt = _rendered(CONVERSATION)
    request = engine.requests[0]
    assert request.prompt_token_ids == prompt and body["usage"]["prompt_tokens"] == len(prompt)
    assert request.sampling_params.embed_pooling == "ALL" and not request.sampling_params.embed_normalize
    assert body["data"][0]["data"] == [[v] for v in scripted_embedding(prompt, request.sampling_params)[:6]]
    http.post("/pooling", json={"model": "tiny", "messages": CONVERSATION[:1], "add_generation_prompt": True})
    assert engine.requests[-1].prompt_token_ids == _rendered(CONVERSATION[:1], add_generation_prompt=True)
    # Truncation applies to the conversation's tokens.
    http.post("/pooling", json={"model": "tiny", "messages": CONVERSATION, "truncate_prompt_tokens": 5,
                                "truncation_side": "left"})
    assert engine.requests[-1].prompt_token_ids == prompt[-5:]


def test_a_process_reward_model_answers_each_steps_class_probabilities():
    """STEP pooling: the engine is asked for the step tag's rows; each row (two class logits) comes
    back as its softmax, or as the logits with use_activation (or its older name activation) false."""
    http, engine = _app(num_pooled=6, pooling=PROCESS_REWARD_MODEL)
    body = http.post("/pooling", json={"model": "tiny", "input": [5, 7, 6, 7]}).json()
    params = engine.requests[0].sampling_params
    assert (params.embed_pooling, params.embed_step_tag_id, params.embed_returned_token_ids) == ("STEP", 7, None)
    flat = scripted_embedding([5, 7, 6, 7], params)[:6]
    rows = [flat[i: i + 2] for i in range(0, 6, 2)]
    np.testing.assert_allclose(body["data"][0]["data"], [class_probabilities(r) for r in rows], atol=1e-12)
    for switch in ("use_activation", "activation"):
        raw = http.post("/pooling", json={"model": "tiny", "input": [5, 7, 6, 7], switch: False}).json()
        assert raw["data"][0]["data"] == rows
    for path, payload in (("/classify", {"input": "hi"}), ("/v1/embeddings", {"input": "hi"}),
                          ("/score", {"text_1": "a", "text_2": "b"})):
        r = http.post(path, json={"model": "tiny", **payload})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", path
        assert "/pooling" in r.json()["error"]["message"], path  # (not sent to /classify, which refuses it too)


def test_per_token_embeddings_come_back_row_by_row():
    """ALL pooling on an embedding model: /pooling answers each token's embedding (row_size values
    a row); /v1/embeddings and /score, which need one vector per input, refuse it."""
    http, engine = _app(num_pooled=8, pooling={"pooling_type": "ALL", "row_size": 4, "normalize": False})
    body = http.post("/pooling", json={"model": "tiny", "input": [[5, 6], [9]]}).json()
    for item, prompt, request in zip(body["data"], [[5, 6], [9]], engine.requests, strict=True):
        flat = scripted_embedding(prompt, request.sampling_params)
        assert item["data"] == [flat[:4], flat[4:]] and request.sampling_params.embed_pooling == "ALL"
    for path, payload in (("/v1/embeddings", {"input": "hi"}), ("/score", {"text_1": "a", "text_2": "b"})):
        r = http.post(path, json={"model": "tiny", **payload})
        assert r.status_code == 400 and "pools every token" in r.json()["error"]["message"], path


def test_embeddings_and_classify_read_conversations_too():
    """/v1/embeddings and /classify take messages as /pooling does (vLLM's chat forms of them)."""
    http, engine = _app(tokenizer=CHAT_TOKENIZER)
    body = http.post("/v1/embeddings", json={"model": "tiny", "messages": CONVERSATION}).json()
    assert engine.requests[0].prompt_token_ids == _rendered(CONVERSATION) and len(body["data"]) == 1
    http, engine = _app(tokenizer=CHAT_TOKENIZER, num_pooled=3,
                        pooling={"generates": False, "labels": ("a", "b", "c")})
    body = http.post("/classify", json={"model": "tiny", "messages": CONVERSATION, "use_activation": False}).json()
    params = engine.requests[0].sampling_params
    assert engine.requests[0].prompt_token_ids == _rendered(CONVERSATION)
    assert body["data"][0]["probs"] == scripted_embedding(_rendered(CONVERSATION), params)[:3]


@pytest.mark.parametrize(("payload", "param"), [
    ({"input": "hi", "messages": CONVERSATION}, "input"), ({}, "input"), ({"messages": []}, "messages"),
    ({"messages": CONVERSATION, "add_generation_prompt": True, "continue_final_message": True},
     "continue_final_message"), ({"messages": CONVERSATION, "chat_template": "{{ messages }}"}, "chat_template"),
    ({"messages": CONVERSATION, "chat_template_kwargs": {"chat_template": "{{ messages }}"}}, "chat_template_kwargs")])
def test_conversation_refusals(payload, param):
    http, _ = _app(tokenizer=CHAT_TOKENIZER, num_pooled=6, pooling=REWARD_MODEL)
    r = http.post("/pooling", json={"model": "tiny", **payload})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()


def test_a_trusting_server_pools_the_conversation_its_own_template_writes():
    http, engine = _app(tokenizer=CHAT_TOKENIZER, num_pooled=6, pooling=REWARD_MODEL,
                        trust_request_chat_template=True)
    own = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    r = http.post("/pooling", json={"model": "tiny", "messages": CONVERSATION, "chat_template": own})
    assert r.status_code == 200
    assert CHAT_TOKENIZER.decode(engine.requests[0].prompt_token_ids) == "[user] What is 2 + 2?\n[assistant] It is 4.\n"


def test_a_pooling_task_picks_one_row_per_input_or_per_token():
    """vLLM's task: token_embed pools every token of an embedding model (each row cut to dimensions),
    token_classify every token of a sequence classifier; embed / classify keep the model's pooling;
    a task of the other kind, or classify on a per-token model, is refused naming task."""
    http, engine = _app(num_pooled=8, hidden_size=4, pooling={"pooling_type": "MEAN", "row_size": 4,
                                                              "matryoshka": True})
    body = http.post("/pooling", json={"model": "tiny", "input": [5, 6], "task": "token_embed"}).json()
    params = engine.requests[-1].sampling_params
    assert params.embed_pooling == "ALL" and params.embed_normalize
    flat = scripted_embedding([5, 6], params)
    assert body["data"][0]["data"] == [flat[:4], flat[4:]]
    http.post("/pooling", json={"model": "tiny", "input": [5, 6], "task": "token_embed", "dimensions": 2,
                                "normalize": False})
    params = engine.requests[-1].sampling_params
    assert (params.embed_dimensions, params.embed_normalize) == (2, False)
    http.post("/pooling", json={"model": "tiny", "input": [5, 6], "task": "embed"})
    assert engine.requests[-1].sampling_params.embed_pooling == "MEAN"
    for payload, param in (({"task": "classify"}, "task"), ({"task": "score"}, "task"),
                           ({"dimensions": 5}, "dimensions")):
        r = http.post("/pooling", json={"model": "tiny", "input": "hi", **payload})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, payload

    http, engine = _app(num_pooled=6, pooling={"generates": False, "labels": ("a", "b", "c"), "row_size": 3})
    body = http.post("/pooling", json={"model": "tiny", "input": [5, 6], "task": "token_classify"}).json()
    params = engine.requests[-1].sampling_params
    flat = scripted_embedding([5, 6], params)[:6]
    assert params.embed_pooling == "ALL" and not params.embed_normalize
    np.testing.assert_allclose(body["data"][0]["data"], [class_probabilities(flat[:3]), class_probabilities(flat[3:])],
                               atol=1e-12)
    for payload, param in (({"task": "embed"}, "task"), ({"task": "classify", "dimensions": 2}, "dimensions")):
        r = http.post("/pooling", json={"model": "tiny", "input": "hi", **payload})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, payload
    http, _ = _app(num_pooled=6, pooling=REWARD_MODEL)
    r = http.post("/pooling", json={"model": "tiny", "input": "hi", "task": "classify"})
    assert r.status_code == 400 and "token_classify" in r.json()["error"]["message"]
    assert http.post("/pooling", json={"model": "tiny", "input": [5], "task": "token_classify"}).status_code == 200


def test_one_kept_column_takes_a_sigmoid_and_activation_switches_apply_everywhere():
    """A STEP model keeping one column (returned_token_ids) gets a sigmoid per row, as vLLM counts the
    columns (a softmax over one value is always 1); use_activation false on /classify gives a
    one-output classifier's logit; on an embedding model it switches off the normalisation."""
    http, engine = _app(num_pooled=3, pooling={**PROCESS_REWARD_MODEL, "returned_token_ids": (1,), "row_size": 1})
    body = http.post("/pooling", json={"model": "tiny", "input": [7, 7, 7]}).json()
    flat = scripted_embedding([7, 7, 7], engine.requests[0].sampling_params)[:3]
    assert engine.requests[0].sampling_params.embed_returned_token_ids == [1]
    np.testing.assert_allclose(body["data"][0]["data"], [[1 / (1 + np.exp(-v))] for v in flat], atol=1e-12)
    http, engine = _app(num_pooled=1, pooling={"generates": False, "labels": ("LABEL_0",),
                                               "classifier_activation": "sigmoid"})
    body = http.post("/classify", json={"model": "tiny", "input": [5, 6], "use_activation": False}).json()
    assert body["data"][0]["probs"] == scripted_embedding([5, 6], engine.requests[0].sampling_params)[:1]
    http, engine = _app(pooling={"pooling_type": "ALL", "row_size": 4})
    http.post("/pooling", json={"model": "tiny", "input": [5, 6], "use_activation": False})
    assert not engine.requests[0].sampling_params.embed_normalize


def test_messages_take_add_special_tokens_when_asked():
    """The chat template writes a conversation's special tokens; add_special_tokens true also lets
    the tokenizer add its own (vLLM's default for messages is false)."""
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    tokenizer = copy.deepcopy(CHAT_TOKENIZER)
    eos = tokenizer.convert_tokens_to_ids("<eos>")
    tokenizer._tokenizer.post_processor = TemplateProcessing(single="$A <eos>", special_tokens=[("<eos>", eos)])
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    http, engine = _app(tokenizer=tokenizer, num_pooled=6, pooling=REWARD_MODEL)
    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    http.post("/pooling", json={"model": "tiny", "messages": CONVERSATION})
    http.post("/pooling", json={"model": "tiny", "messages": CONVERSATION, "add_special_tokens": True})
    http.post("/pooling", json={"model": "tiny", "input": "hi"})
    plain, special, single = (r.prompt_token_ids for r in engine.requests)
    assert plain == tokenizer.encode(text, add_special_tokens=False) and special == [*plain, eos]
    assert single[-1] == eos


def test_bge_m3_answers_its_per_token_tasks_with_its_own_heads():
    """An embedding model with per-token heads (BGE-M3): token_classify asks the engine for its
    sparse head's value a token and answers the relu of each, one flat list (as vLLM squeezes it;
    the raw values with use_activation false; normalize and dimensions refused); token_embed asks
    for its ColBERT vectors (normalised rows); /v1/embeddings keeps its dense embedding."""
    http, engine = _app(num_pooled=2, hidden_size=4, pooling={"pooling_type": "CLS", "row_size": 4,
                                                              "token_heads": ("token_embed", "token_classify")})
    body = http.post("/pooling", json={"model": "tiny", "input": [5, 6], "task": "token_classify"}).json()
    params = engine.requests[-1].sampling_params
    assert (params.embed_pooling, params.pooling_task, params.embed_normalize) == ("ALL", "token_classify", False)
    raw = scripted_embedding([5, 6], params)[:2]  # (2.0, then sum % 97: positive)
    assert body["data"][0]["data"] == [max(v, 0.0) for v in raw]
    body = http.post("/pooling", json={"model": "tiny", "input": [5, 40], "task": "token_classify"}).json()
    assert body["data"][0]["data"] == [2.0, 45.0]
    engine.num_pooled = 8  # (-2.0 at index 3: the relu shows)
    relu = http.post("/pooling", json={"model": "tiny", "input": [5, 6], "task": "token_classify"}).json()
    plain = http.post("/pooling", json={"model": "tiny", "input": [5, 6], "task": "token_classify",
                                        "use_activation": False}).json()
    raw = scripted_embedding([5, 6], engine.requests[-1].sampling_params)
    assert plain["data"][0]["data"] == raw and relu["data"][0]["data"] == [max(v, 0.0) for v in raw]
    for name, value in (("normalize", True), ("dimensions", 2)):
        r = http.post("/pooling", json={"model": "tiny", "input": [5], "task": "token_classify", name: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == name
    body = http.post("/pooling", json={"model": "tiny", "input": [5, 6], "task": "token_embed"}).json()
    params = engine.requests[-1].sampling_params
    assert (params.embed_pooling, params.pooling_task, params.embed_normalize) == ("ALL", "token_embed", True)
    assert len(body["data"][0]["data"]) == 2 and len(body["data"][0]["data"][0]) == 4
    http.post("/v1/embeddings", json={"model": "tiny", "input": [5, 6]})
    params = engine.requests[-1].sampling_params
    assert (params.embed_pooling, params.pooling_task) == ("CLS", None)


def test_a_colbert_model_scores_pairs_by_maxsim():
    """A late-interaction model (ColBERT): /score and /rerank embed each distinct text as one vector
    a token (token_embed) and score a pair by MaxSim (each query vector's best dot product with the
    document's, summed); /pooling answers its vectors; /v1/embeddings refuses it."""
    from router.scoring import maxsim_scores

    pooling = {"generates": False, "pooling_type": "ALL", "task": "token_embed", "token_heads": ("token_embed",),
               "row_size": 2, "late_interaction": True}
    http, engine = _app(num_pooled=8, pooling=pooling)
    body = http.post("/score", json={"model": "tiny", "text_1": "Hello world", "text_2": ["Paris", "Berlin is"]}).json()
    by_text = {tuple(r.prompt_token_ids): scripted_embedding(r.prompt_token_ids, r.sampling_params)
               for r in engine.requests}
    assert all(r.sampling_params.pooling_task == "token_embed" and r.sampling_params.embed_normalize
               for r in engine.requests)
    query = np.asarray(by_text[tuple(TOKENIZER.encode("Hello world"))]).reshape(-1, 2)
    for item, doc in zip(body["data"], ["Paris", "Berlin is"], strict=True):
        document = np.asarray(by_text[tuple(TOKENIZER.encode(doc))]).reshape(-1, 2)
        assert item["score"] == pytest.approx(float((query @ document.T).max(axis=1).sum()))
    ranked = http.post("/rerank", json={"model": "tiny", "query": "Hello world", "documents": ["Paris", "Berlin is"]})
    assert [r["relevance_score"] for r in sorted(ranked.json()["results"], key=lambda r: r["index"])] == [
        item["score"] for item in body["data"]]
    assert maxsim_scores([[1.0, 0.0, 0.0, 1.0], [0.6, 0.8]], 2, [(0, 1)]) == pytest.approx([0.6 + 0.8])
    pooled = http.post("/pooling", json={"model": "tiny", "input": [5, 6]}).json()
    assert len(pooled["data"][0]["data"]) == 4 and len(pooled["data"][0]["data"][0]) == 2
    assert http.post("/v1/embeddings", json={"model": "tiny", "input": "hi"}).status_code == 400
