"""Several models behind one app (ModelServings): each request goes to the serving, engines and
tokenizer of the model it names; the list, the tokenizer endpoints and the Responses API follow."""

from __future__ import annotations

import asyncio

import openai
import pytest
from starlette.testclient import TestClient

from engine_core.outputs import LoRARequest
from router.app import create_app
from router.engine_client import EngineClient
from router.metrics import RouterMetrics
from router.model_servings import ModelServings
from router.response_store import LocalResponseStore
from router.routing import RoundRobinPolicy
from router.serving import APIError, OpenAIServing, ServingSettings

from .test_request_fields import ScriptedEngine
from .tokenizer_factory import byte_level_tokenizer

ANSWERS = {"alpha": "Hello world", "beta": "Paris is the capital"}


def _serving(name: str, *aliases: str, metrics: RouterMetrics | None = None) -> tuple[OpenAIServing, ScriptedEngine]:
    tokenizer = byte_level_tokenizer.__wrapped__()  # each model its own tokenizer and template
    tokenizer.chat_template = f"[{name}]{{% for m in messages %}}{{{{ m['content'] }}}}{{% endfor %}}"
    client = EngineClient([object()], client_index=1)
    scripted = client._slots[0].channel = ScriptedEngine(client, lambda _: tokenizer.encode(ANSWERS[name]))
    return OpenAIServing(ServingSettings(served_model_name=name, max_model_len=256, served_model_aliases=aliases),
                         client, tokenizer, RoundRobinPolicy(), metrics), scripted


@pytest.fixture
def two_models():
    (alpha, alpha_engine), (beta, beta_engine) = _serving("alpha"), _serving("beta")
    http = TestClient(create_app([alpha, beta], response_store=LocalResponseStore()))
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
    return http, client, {"alpha": (alpha, alpha_engine), "beta": (beta, beta_engine)}


def test_each_request_reaches_the_engines_of_the_model_it_names(two_models):
    _, client, models = two_models
    for name in ("beta", "alpha", "beta"):
        out = client.completions.create(model=name, prompt="Hi", max_tokens=30)
        assert out.model == name and out.choices[0].text == ANSWERS[name]
    assert [len(engine.requests) for _, engine in models.values()] == [1, 2]
    chat = client.chat.completions.create(model="beta", messages=[{"role": "user", "content": "Hi"}], max_tokens=30)
    assert chat.choices[0].message.content == ANSWERS["beta"]
    beta, beta_engine = models["beta"]
    assert beta.tokenizer.decode(beta_engine.requests[-1].prompt_token_ids) == "[beta]Hi"  # beta's own template
    streamed = client.completions.create(model="alpha", prompt="Hi", max_tokens=30, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == ANSWERS["alpha"]
    with pytest.raises(openai.NotFoundError, match="`gamma` does not exist"):
        client.completions.create(model="gamma", prompt="Hi")
    assert [len(engine.requests) for _, engine in models.values()] == [2, 3]
    embedded = client.embeddings.create(model="beta", input="Hi")
    assert embedded.model == "beta" and beta_engine.requests[-1].sampling_params.embed
    assert [len(engine.requests) for _, engine in models.values()] == [2, 4]


def test_each_models_http_metrics_count_its_own_requests():
    """The router's response counts and timelines carry the name of the model each request named,
    refused or not (a request naming none, or an unknown one, counts under the first model's)."""
    metrics = {name: RouterMetrics(name, "r0") for name in ANSWERS}
    servings = [_serving(name, metrics=metrics[name])[0] for name in ANSWERS]
    http = TestClient(create_app(servings))
    for model in ("beta", "beta", "alpha", "gamma"):
        http.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 3, "stream": model == "beta"})
    # Refused by validation, before any handler runs: still the model it named.
    assert http.post("/v1/completions", json={"model": "beta", "prompt": "Hi", "temperature": -1}).status_code == 400

    def responses(name: str, status: str) -> float | None:
        return metrics[name].registry.get_sample_value("llm_cluster:router_http_responses_total", {
            "model_name": name, "replica": "r0", "endpoint": "/v1/completions", "status": status})

    assert (responses("beta", "200"), responses("alpha", "200"), responses("alpha", "404")) == (2, 1, 1)
    assert responses("beta", "404") is None and responses("beta", "400") == 1 and responses("alpha", "400") is None
    assert metrics["beta"].registry.get_sample_value("llm_cluster:router_first_chunk_delay_seconds_count", {
        "model_name": "beta", "replica": "r0"}) == 2
    assert metrics["alpha"].registry.get_sample_value("llm_cluster:router_first_chunk_delay_seconds_count", {
        "model_name": "alpha", "replica": "r0"}) in (None, 0)


def test_models_tokenizers_and_responses_follow_the_model(two_models):
    http, client, models = two_models
    assert [m.id for m in client.models.list()] == ["alpha", "beta"]
    assert client.models.retrieve("beta").id == "beta"
    tokens = http.post("/tokenize", json={"model": "beta", "messages": [{"role": "user", "content": "Hi"}]}).json()
    assert models["beta"][0].tokenizer.decode(tokens["tokens"]) == "[beta]Hi"
    assert http.post("/tokenize", json={"model": "gamma", "prompt": "Hi"}).status_code == 404
    response = client.responses.create(model="beta", input="Hi")
    assert response.output_text == ANSWERS["beta"] and response.model == "beta"
    # One store for every model: found, and continued by the other model, which sees the conversation.
    assert client.responses.retrieve(response.id).output_text == ANSWERS["beta"]
    follow = client.responses.create(model="alpha", input="And?", previous_response_id=response.id)
    alpha, alpha_engine = models["alpha"]
    assert alpha.tokenizer.decode(alpha_engine.requests[-1].prompt_token_ids) == f"[alpha]Hi{ANSWERS['beta']}And?"
    assert follow.output_text == ANSWERS["alpha"]


def test_each_models_adapters_run_on_its_own_engines(two_models):
    """Both models hold adapters: a request naming one reaches its base model's engine under it,
    and the list shows each adapter under its parent. An adapter the serving has not seen yet
    (loaded through another replica) is found by asking the engines."""
    http, client, models = two_models
    (alpha, alpha_engine), (beta, beta_engine) = models["alpha"], models["beta"]
    alpha.lora_adapters["sql"] = LoRARequest("sql", 1, "/adapters/sql")
    on_beta = {"chat": LoRARequest("chat", 1, "/adapters/chat")}

    async def beta_engines_adapters() -> list[LoRARequest]:
        return list(on_beta.values())

    beta.list_loras = beta_engines_adapters
    for model, engine, expected in [("sql", alpha_engine, ANSWERS["alpha"]), ("chat", beta_engine, ANSWERS["beta"])]:
        out = client.completions.create(model=model, prompt="Hi", max_tokens=30)
        assert out.model == model and out.choices[0].text == expected
        assert engine.requests[-1].lora_request.lora_name == model
    cards = {m.id: m for m in client.models.list()}
    assert list(cards) == ["alpha", "sql", "beta", "chat"]
    assert (cards["sql"].parent, cards["chat"].parent) == ("alpha", "beta")
    for card in http.get("/v1/models").json()["data"]:  # (vLLM's permission entry, on adapters too)
        [permission] = card["permission"]
        assert permission["object"] == "model_permission" and permission["id"].startswith("modelperm-")
        assert permission["allow_sampling"] and permission["allow_logprobs"] and permission["organization"] == "*"
    on_beta["late"] = LoRARequest("late", 7, "/adapters/late")
    client.chat.completions.create(model="late", messages=[{"role": "user", "content": "Hi"}], max_tokens=30)
    assert beta_engine.requests[-1].lora_request == on_beta["late"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gone", prompt="Hi")
    # Without runtime adapter updating, there are no endpoints for it.
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"}).status_code == 404


def test_runtime_adapters_load_onto_the_model_named_or_the_first_that_takes_them():
    """POST /v1/load_lora_adapter picks the model by base_model_name (default: the first model with
    runtime adapters); a name already a model's or an adapter's of any model is refused; unloading
    finds the adapter's model. (The engines' side is tested end to end in test_multi_model.)"""
    import dataclasses

    (alpha, _), (beta, _) = _serving("alpha"), _serving("beta")
    beta.settings = dataclasses.replace(beta.settings, allow_runtime_lora_updating=True)
    alpha.lora_adapters["sql"] = LoRARequest("sql", 1, "/adapters/sql")
    calls = []

    async def load(name, path, load_inplace):
        calls.append(("load", name, path, load_inplace))
        beta.lora_adapters[name] = LoRARequest(name, 9, path)

    async def unload(name):
        calls.append(("unload", name))
        beta.lora_adapters.pop(name)

    beta.load_lora_adapter, beta.unload_lora_adapter = load, unload
    http = TestClient(create_app([alpha, beta], response_store=LocalResponseStore()))
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"}).status_code == 200
    for body, status, param in [({"lora_name": "y", "lora_path": "/y", "base_model_name": "alpha"}, 400,
                                 "base_model_name"),
                                ({"lora_name": "y", "lora_path": "/y", "base_model_name": "gamma"}, 404, "model"),
                                ({"lora_name": "alpha", "lora_path": "/y"}, 400, "lora_name"),
                                ({"lora_name": "sql", "lora_path": "/y"}, 400, "lora_name"),
                                ({"lora_name": "x", "lora_path": "/y", "base_model_name": "beta"}, 400, "lora_name"),
                                # (in place: on the adapter's own model, which must take runtime loads)
                                ({"lora_name": "x", "lora_path": "/y", "base_model_name": "alpha",
                                  "load_inplace": True}, 400, "base_model_name"),
                                ({"lora_name": "sql", "lora_path": "/y", "load_inplace": True}, 400,
                                 "base_model_name"),
                                ({"lora_name": "alpha", "lora_path": "/y", "load_inplace": True}, 400, "lora_name")]:
        r = http.post("/v1/load_lora_adapter", json=body)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), body
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x2",
                                                    "load_inplace": True}).status_code == 200
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 200
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 404  # (alpha's: fixed)
    assert calls == [("load", "x", "/x", False), ("load", "x", "/x2", True), ("unload", "x")]


def test_two_models_of_one_name_are_refused():
    with pytest.raises(ValueError, match="two served models are named 'alpha'"):
        ModelServings([_serving("alpha")[0], _serving("alpha")[0]])


@pytest.mark.parametrize("num_models", [1, 2])
def test_a_models_aliases_reach_it_and_responses_carry_its_first_name(num_models):
    """vLLM's --served-model-name a b: a request may name the model by any of its names (and the list
    shows each); responses carry the first name, as vLLM's do."""
    import dataclasses

    alpha, alpha_engine = _serving("alpha", "alpha-latest", "a")
    alpha.settings = dataclasses.replace(alpha.settings, allow_runtime_lora_updating=True, model_root="/models/alpha")

    async def load(name, path, load_inplace=False):
        alpha.lora_adapters[name] = LoRARequest(name, 9, path)

    alpha.load_lora_adapter = load
    servings = [alpha, _serving("beta")[0]][:num_models]
    http = TestClient(create_app(servings, response_store=LocalResponseStore()))
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
    for name in ("alpha-latest", "a", "alpha"):
        out = client.completions.create(model=name, prompt="Hi", max_tokens=30)
        assert out.model == "alpha" and out.choices[0].text == ANSWERS["alpha"]
    chat = client.chat.completions.create(model="a", messages=[{"role": "user", "content": "Hi"}], max_tokens=30)
    assert chat.model == "alpha" and alpha_engine.requests[-1].lora_request is None
    assert client.responses.create(model="alpha-latest", input="Hi").model == "alpha"
    assert [m.id for m in client.models.list()] == ["alpha", "alpha-latest", "a", "beta"][:num_models + 2]
    card = client.models.retrieve("alpha-latest")
    assert (card.id, card.root) == ("alpha-latest", "/models/alpha")  # (the model as the server was given it)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="alpha-old", prompt="Hi")
    # An adapter may not take an alias; one loaded naming an alias as its base runs on the model.
    refused = http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
    assert (refused.status_code, refused.json()["error"]["param"]) == (400, "lora_name")
    loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/x", "base_model_name": "a"})
    assert loaded.status_code == 200 and "sql" in alpha.lora_adapters


def test_an_alias_that_is_another_models_name_is_refused():
    with pytest.raises(ValueError, match="two served models are named 'beta'"):
        ModelServings([_serving("alpha", "beta")[0], _serving("beta")[0]])
    for aliases in (("alpha",), ("a", "a")):
        with pytest.raises(ValueError, match="repeat a name"):
            _serving("alpha", *aliases)


def test_an_adapter_never_takes_a_models_alias_and_one_an_alias_shadows_is_not_served(caplog):
    """The serving's own check (each replica's, whatever the app's): a runtime load may not take an
    alias; an adapter loaded before a redeploy gave the model its name is no longer reachable by it."""
    alpha, _ = _serving("alpha", "alpha-latest")
    on_engines = [LoRARequest("alpha-latest", 3, "/adapters/old"), LoRARequest("sql", 4, "/adapters/sql")]

    async def engines_adapters() -> list[LoRARequest]:
        return list(on_engines)

    alpha.list_loras = engines_adapters

    async def run() -> None:
        with pytest.raises(APIError, match="has already been loaded"):
            await alpha.load_lora_adapter("alpha-latest", "/adapters/new")
        assert list(alpha.lora_adapters) == ["sql"] and "is not served" in caplog.text
        assert await alpha.resolve_model("alpha-latest") is None  # the model itself

    asyncio.run(run())
