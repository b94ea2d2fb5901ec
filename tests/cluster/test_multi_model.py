"""Two models behind one endpoint (``ClusterConfig.models``), on real engines over Ray with the
Serve router: each request reaches its own model's engines; the model list, /health and /metrics
show both."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from cluster.config import ClusterConfig, EngineSpec, ServedModel
from tests.lora_adapters import peft_greedy, save_adapter
from tests.serve_cluster import serve_cluster
from tests.tiny_model import build_tiny_bert, build_tiny_llama, build_tiny_reward_model, build_tokenizer

pytestmark = pytest.mark.slow


def test_one_endpoint_serves_two_models_on_their_own_engines(ray_cluster, tiny_model_dir, tmp_path_factory):
    second = build_tiny_llama(tmp_path_factory.mktemp("second-model"), seed=7, num_layers=1)
    # The second model is served with another tokenizer directory (--tokenizer): its chat template.
    tokenizer_b = tmp_path_factory.mktemp("tokenizer-b")
    tokenizer = build_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    tokenizer.save_pretrained(tokenizer_b)
    # The second model recommends its own sampling in its generation_config.json (the first none).
    generation = json.loads((second / "generation_config.json").read_text())
    (second / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.5, "top_p": 0.75}))
    # And a third: a BERT cross-encoder (ms-marco-style), on an engine of its own.
    reranker = build_tiny_bert(tmp_path_factory.mktemp("bert-reranker"), num_labels=1)
    # And a fourth: a process reward model (Qwen2.5-Math-PRM-style), read through /pooling.
    prm = tmp_path_factory.mktemp("prm")
    prm_reference = build_tiny_reward_model(prm)
    # The second model serves LoRA adapters of its own (the first none).
    adapters = tmp_path_factory.mktemp("adapters-b")
    save_adapter(second, adapters / "b-sql", seed=21)
    save_adapter(second, adapters / "b-late", seed=22, r=4, targets=("q_proj", "v_proj"))
    config = ClusterConfig(model=str(tiny_model_dir), served_model_name="tiny", num_engines=1,
                           defaults=EngineSpec(num_gpu_blocks=64, max_model_len=256),
                           allow_runtime_lora_updating=True,
                           models=[ServedModel(model=str(second), served_model_name=["tiny-b", "b-alias"],
                                               enable_lora=True, tokenizer=str(tokenizer_b),
                                               lora_modules=[f"b-sql={adapters / 'b-sql'}"]),
                                   # (its context is 128 tokens: the cluster's 256 would be refused)
                                   ServedModel(model=str(reranker), served_model_name="bert-ce",
                                               defaults=EngineSpec(max_model_len=128)),
                                   ServedModel(model=str(prm), served_model_name="prm")])
    with serve_cluster(config) as served:
        client = openai.OpenAI(base_url=f"{served.base}/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list()] == ["tiny", "tiny-b", "b-alias", "b-sql", "bert-ce", "prm"]
        _check_bert_reranker(client, reranker)
        _check_process_reward_model(client, prm, prm_reference)
        greedy = {"max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
        a = client.completions.create(model="tiny", prompt="Hello world", **greedy)
        b = [client.completions.create(model="tiny-b", prompt="Hello world", **greedy) for _ in range(2)]
        assert a.model == "tiny" and {r.model for r in b} == {"tiny-b"}
        assert b[0].choices[0].text == b[1].choices[0].text != a.choices[0].text  # another model's weights
        chat = client.chat.completions.create(model="tiny-b", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4)
        # Cohere's /v2/embed on the same engines as /v1/embeddings: the same vectors.
        cohere = httpx.post(f"{served.base}/v2/embed", json={"model": "tiny-b", "texts": ["Hello world"]},
                            timeout=60).json()
        openai_vector = client.embeddings.create(model="tiny-b", input="Hello world").data[0].embedding
        assert cohere["embeddings"]["float"][0] == pytest.approx(openai_vector, abs=1e-6)
        assert chat.model == "tiny-b" and chat.usage.completion_tokens >= 1
        # Engine 0 serves "tiny", engine 1 "tiny-b" (numbered after the first model's), engine 2 "bert-ce".
        assert [s.num_requests_added for s in served.stats()] == [1, 5, 2, 1]
        # Each model's requests that leave them unset get its own defaults (a response repeats them).
        for model, expected in (("tiny", (1.0, 1.0)), ("tiny-b", (0.5, 0.75)), ("b-sql", (0.5, 0.75))):
            response = client.responses.create(model=model, input="Hi", max_output_tokens=2)
            assert (response.temperature, response.top_p) == expected
        own = client.responses.create(model="tiny-b", input="Hi", max_output_tokens=2, temperature=0.2)
        assert (own.temperature, own.top_p) == (0.2, 0.75)
        # The second model's alias (--served-model-name tiny-b b-alias) reaches it; answers carry its first name.
        aliased = client.completions.create(model="b-alias", prompt="Hello world", **greedy)
        assert aliased.model == "tiny-b" and aliased.choices[0].text == b[0].choices[0].text
        # The router replica writes tiny-b's prompts with the tokenizer its engine sent (--tokenizer's).
        for model, prompt in (("tiny-b", "<<Hi>>"), ("tiny", None)):
            ids = httpx.post(f"{served.base}/tokenize", timeout=30, json={
                "model": model, "messages": [{"role": "user", "content": "Hi"}]}).json()["tokens"]
            text = build_tokenizer().decode(ids)
            assert text == prompt if prompt else "<<" not in text
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="tiny-c", prompt="Hello")
        health = httpx.get(f"{served.base}/health", timeout=30).json()
        assert health["models"] == {"tiny": {"healthy_engines": 1, "engines": 1},
                                    "tiny-b": {"healthy_engines": 1, "engines": 1},
                                    "bert-ce": {"healthy_engines": 1, "engines": 1},
                                    "prm": {"healthy_engines": 1, "engines": 1}}
        _check_adapters_of_the_second_model(served, client, second, adapters)
        metrics = httpx.get(f"{served.base}/metrics", timeout=30).text

        def series(name: str, **labels: str) -> list[str]:
            return [line for line in metrics.splitlines() if line.startswith(name + "{")
                    and all(re.search(f'{k}="{re.escape(v)}"', line) for k, v in labels.items())]

        assert series("vllm:request_success_total", model_name="tiny-b", engine="1")
        assert series("vllm:request_success_total", model_name="tiny", engine="0")
        routed = series("llm_cluster:router_requests_routed_total", model_name="tiny-b")
        assert routed and all('engine="1"' in line for line in routed)


def _check_adapters_of_the_second_model(served, client: openai.OpenAI, second, adapters) -> None:
    """The second model's adapters answer on its engine as PEFT's model does; one loaded at runtime
    goes to it (the first model that takes adapters); names stay unique across models."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(second)

    def greedy_text(model: str) -> str:
        out = client.completions.create(model=model, prompt="Hello world", max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.model == model
        return out.choices[0].text

    def peft_text(**adapter) -> str:
        return tokenizer.decode(peft_greedy(second, ["Hello world"], 8, **adapter)[0], skip_special_tokens=True)

    added = [s.num_requests_added for s in served.stats()]
    assert greedy_text("b-sql") == peft_text(seed=21) != greedy_text("tiny-b")
    load = f"{served.base}/v1/load_lora_adapter"
    r = httpx.post(load, json={"lora_name": "b-late", "lora_path": str(adapters / "b-late")}, timeout=60)
    assert r.status_code == 200, r.text
    assert greedy_text("b-late") == peft_text(seed=22, r=4, targets=("q_proj", "v_proj"))
    assert [s.num_requests_added - a for s, a in zip(served.stats(), added, strict=True)] == [0, 3, 0, 0]
    cards = {m.id: m.parent for m in client.models.list()}
    assert (cards["b-sql"], cards["b-late"]) == ("tiny-b", "tiny-b")
    for body, status, message in [
            ({"lora_name": "tiny", "lora_path": str(adapters / "b-late")}, 400, "already been loaded"),
            ({"lora_name": "b-sql", "lora_path": str(adapters / "b-late")}, 400, "already been loaded"),
            ({"lora_name": "x", "lora_path": str(adapters / "b-late"), "base_model_name": "tiny"}, 400,
             "not served with LoRA adapters"),
            ({"lora_name": "x", "lora_path": str(adapters / "b-late"), "base_model_name": "nope"}, 404, "nope")]:
        r = httpx.post(load, json=body, timeout=60)
        assert r.status_code == status and message in r.json()["error"]["message"], r.text
    unload = f"{served.base}/v1/unload_lora_adapter"
    assert httpx.post(unload, json={"lora_name": "b-late"}, timeout=60).status_code == 200
    assert httpx.post(unload, json={"lora_name": "b-late"}, timeout=60).status_code == 404
    assert httpx.post(unload, json={"lora_name": "tiny-b"}, timeout=60).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="b-late", prompt="Hello", max_tokens=2)


def _check_bert_reranker(client: openai.OpenAI, path) -> None:
    """/v1/rerank on the BERT cross-encoder's engine actor: each (query, document) pair scored as
    transformers scores it, token types included; it neither embeds nor generates."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    query, docs = "what is the capital of france?", ["Berlin is in Germany.", "Paris is the capital of France."]
    ranked = client.post("/rerank", body={"model": "bert-ce", "query": query, "documents": docs}, cast_to=object)
    expected = []
    for doc in docs:
        with torch.no_grad():
            expected.append(float(torch.sigmoid(model(**tokenizer(query, text_pair=doc, return_tensors="pt")
                                                      ).logits[0, 0])))
    assert {r["index"]: r["relevance_score"] for r in ranked["results"]} == pytest.approx(dict(enumerate(expected)),
                                                                                       abs=1e-5)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="bert-ce", input="Paris")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="bert-ce", prompt="Paris", max_tokens=2)


def _check_process_reward_model(client: openai.OpenAI, path, reference) -> None:
    """/pooling on the process reward model's engine, given a conversation: its chat template's text
    scored at each step separator ("<extra_0>"), two class probabilities a step, as the reference
    computes them; /classify refers to /pooling."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "What is 17 + 25?"},
                {"role": "assistant", "content": "7 + 5 = 12, carry 1.<extra_0>1 + 2 + 1 = 4, so 42.<extra_0>"}]
    pooled = client.post("/pooling", body={"model": "prm", "messages": messages}, cast_to=object)
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    steps = [i for i, t in enumerate(ids) if t == tokenizer.convert_tokens_to_ids("<extra_0>")]
    assert len(steps) == 2 and pooled["usage"]["prompt_tokens"] == len(ids)
    expected = torch.softmax(reference(ids)[steps], dim=-1)
    got = torch.tensor(pooled["data"][0]["data"], dtype=torch.float32)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(openai.BadRequestError, match="/pooling"):
        client.post("/classify", body={"model": "prm", "input": "1 + 1 = 2<extra_0>"}, cast_to=object)
