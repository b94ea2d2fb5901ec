"""End to end: real Ray engines (tiny model), the Serve ingress deployment, real HTTP, the openai client."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from cluster.config import ClusterConfig, EngineSpec
from cluster.launcher import start_engines, stop_engines
from tests.serve_cluster import serve_cluster

pytestmark = pytest.mark.slow

TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
                  "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def cluster(ray_cluster, tiny_model_dir):
    config = ClusterConfig(
        model=str(tiny_model_dir), served_model_name="tiny", num_engines=2, routing_policy="round_robin",
        enable_responses_store=True,  # shared by every app of the namespace (prefix2 uses it too)
        enable_prompt_tokens_details=True,
        # (Marked as trained for shorter embeddings, which /v1/embeddings' dimensions needs, as in vLLM.)
        # Sleep mode on, for the operators' /sleep and /wake_up.
        # A custom logits processor, which only requests that name a target_token meet.
        # Prompts may come as embeddings.
        defaults=EngineSpec(num_gpu_blocks=96, max_model_len=256, hf_overrides={"is_matryoshka": True},
                            enable_sleep_mode=True, logits_processors=["tests.logits_processors:TargetTokenProcessor"],
                            enable_prompt_embeds=True),
        # Both engines have short queues (engine 1 the shorter), so flooding them yields 429s: a
        # request one engine refuses for a full queue is tried on the other first.
        engines=[EngineSpec(max_num_seqs=4, max_waiting_requests=4),
                 EngineSpec(max_num_seqs=1, max_waiting_requests=2)])
    # A second router app over the same engines, with another policy, and tool_choice "auto" read
    # with the hermes parser under a chat template that shows the tools, and a reasoning parser.
    prefix_config = config.model_copy(update={"routing_policy": "prefix_aware", "enable_auto_tool_choice": True,
                                              "tool_call_parser": "hermes", "chat_template": TOOLS_TEMPLATE,
                                              "reasoning_parser": "deepseek_r1"})
    # And one whose requests time out long before they could finish.
    timeout_config = config.model_copy(update={"request_timeout_s": 0.05})
    # And a second prefix-aware replica set, which learns what the engines cache from their KV events,
    # and streams in chunks of 5 tokens after the first (--stream-interval).
    # It also serves the operators' endpoints (--server-dev-mode), tracks its load (GET /load) and
    # describes its tokenizer (GET /tokenizer_info).
    prefix2_config = config.model_copy(update={"routing_policy": "prefix_aware", "stream_interval": 5,
                                               "server_dev_mode": True, "enable_server_load_tracking": True,
                                               "enable_tokenizer_info_endpoint": True})
    with serve_cluster(config, {"prefix": prefix_config, "timeout": timeout_config,
                                "prefix2": prefix2_config}) as served:
        yield {"base": served.base, "engines": served.engines, "config": config}


@pytest.fixture
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster['base']}/v1", api_key="unused", max_retries=0, timeout=60)


def _stats(cluster):
    import ray

    return [ray.get(e.actor.get_stats.remote()) for e in cluster["engines"]]


def _wait_idle(cluster, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = _stats(cluster)
        if all(s.num_unfinished_requests == 0 and s.num_free_blocks == s.num_blocks for s in stats):
            return stats
        time.sleep(0.1)
    raise AssertionError(f"engines did not go idle: {stats}")


def test_chat_plain_and_streamed(client, cluster):
    msgs = [{"role": "user", "content": "Hello"}]
    plain = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    assert plain.object == "chat.completion" and plain.choices[0].message.role == "assistant"
    assert plain.choices[0].finish_reason in ("stop", "length")
    assert plain.usage.completion_tokens >= 1 and plain.usage.prompt_tokens > 0
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_a_stream_interval_sends_the_same_tokens_in_fewer_chunks(client, cluster):
    gathered = openai.OpenAI(base_url=f"{cluster['base']}/prefix2/v1", api_key="unused", max_retries=0, timeout=60)

    def chunks(c: openai.OpenAI) -> list:
        return [chunk.choices[0] for chunk in c.completions.create(
            model="tiny", prompt="Hello world", max_tokens=16, temperature=0, logprobs=0, stream=True,
            extra_body={"ignore_eos": True})]

    every, fewer = chunks(client), chunks(gathered)
    assert [t for c in fewer for t in c.logprobs.tokens] == [t for c in every for t in c.logprobs.tokens]
    assert "".join(c.text for c in fewer) == "".join(c.text for c in every)
    sizes = [len(c.logprobs.tokens) for c in fewer]
    assert sum(sizes) == 16 and all(size >= 5 for size in sizes[1:-1]) and len(sizes) <= 4
    assert fewer[-1].finish_reason == "length"


def test_embeddings_are_the_last_tokens_final_hidden_state(client, tiny_model_dir):
    """/v1/embeddings on real engines, through the openai client (base64 on the wire): each text's
    embedding is transformers' final hidden state of its last token, L2-normalised."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    texts = ["Hello world", "Paris is the capital of France.", "Hello world"]
    out = client.embeddings.create(model="tiny", input=texts)
    assert out.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in texts)
    refs = []
    for item, text in zip(out.data, texts, strict=True):
        with torch.no_grad():
            ref = hf.model(torch.tensor([tokenizer.encode(text)])).last_hidden_state[0, -1]
        refs.append(ref / ref.norm())
        torch.testing.assert_close(torch.tensor(item.embedding), refs[-1], atol=1e-4, rtol=1e-4)
    # vLLM's /v1/score and /v1/rerank on the same embeddings: cosine similarities (the client's
    # base URL ends in /v1).
    scored = client.post("/score", body={"model": "tiny", "text_1": texts[1], "text_2": texts}, cast_to=object)
    assert [d["score"] for d in scored["data"]] == pytest.approx([float(refs[1] @ r) for r in refs], abs=1e-4)
    ranked = client.post("/rerank", body={"model": "tiny", "query": texts[0], "documents": texts[1:]},
                         cast_to=object)
    assert [r["index"] for r in ranked["results"]] == [1, 0]  # "Hello world" itself first
    assert ranked["results"][0]["relevance_score"] == 1.0
    cut = client.embeddings.create(model="tiny", input=texts[0], dimensions=8, encoding_format="float")
    assert len(cut.data[0].embedding) == 8
    # The engines report the model's hidden size (64) to the router, which refuses more up front.
    with pytest.raises(openai.BadRequestError, match=r"dimensions \(65\) is larger than the model's embeddings"):
        client.embeddings.create(model="tiny", input=texts[0], dimensions=65)


def test_responses_api_plain_and_streamed_equal_chat(client):
    """POST /v1/responses on real engines: the same greedy answer as chat completions, whole and as
    the Responses event stream (through the openai client's stream helper)."""
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                                                  {"role": "user", "content": "Hello"}],
                                          max_tokens=8, temperature=0)
    response = client.responses.create(model="tiny", instructions="Be brief.", input="Hello", max_output_tokens=8,
                                       temperature=0)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    with client.responses.stream(model="tiny", instructions="Be brief.", input="Hello", max_output_tokens=8,
                                 temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == response.output_text
    # Its tokens' logprobs, when included, are chat's (the model's, as the engines rank them).
    chat_lp = client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                                                     {"role": "user", "content": "Hello"}],
                                             max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    with_lp = client.responses.create(model="tiny", instructions="Be brief.", input="Hello", max_output_tokens=8,
                                      temperature=0, include=["message.output_text.logprobs"], top_logprobs=2)
    ended_by_eos = chat_lp.choices[0].finish_reason == "stop"
    expected = chat_lp.choices[0].logprobs.content[:-1 if ended_by_eos else None]
    got = with_lp.output[-1].content[0].logprobs
    assert [(lp.token, len(lp.top_logprobs)) for lp in got] == [(lp.token, 2) for lp in expected]
    assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in expected], abs=1e-4)
    # The same prompt three more times over two engines: at least one finds its first block cached.
    assert response.usage.input_tokens > 16
    again = [client.responses.create(model="tiny", instructions="Be brief.", input="Hello", max_output_tokens=1)
             for _ in range(3)]
    assert max(r.usage.input_tokens_details.cached_tokens for r in again) >= 16
    # Chat reports the same (--enable-prompt-tokens-details).
    chats = [client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                                                    {"role": "user", "content": "Hello"}],
                                            max_tokens=1) for _ in range(2)]
    assert min(c.usage.prompt_tokens_details.cached_tokens for c in chats) >= 16


def test_a_stored_conversation_continues_through_another_router(client, cluster):
    """The responses store is one actor for every replica: a response made through one router app
    is retrieved and continued through another (prefix2), which sends the whole conversation."""
    other = openai.OpenAI(base_url=f"{cluster['base']}/prefix2/v1", api_key="unused", max_retries=0, timeout=60)
    first = client.responses.create(model="tiny", input="My name is Ada.", max_output_tokens=4, temperature=0)
    assert first.store is True
    assert other.responses.retrieve(first.id).output_text == first.output_text
    second = other.responses.create(model="tiny", input="What is my name?", previous_response_id=first.id,
                                    max_output_tokens=4, temperature=0)
    alone = other.responses.create(model="tiny", input="What is my name?", max_output_tokens=4, temperature=0)
    # The continued prompt carries the first turn (its input and its answer) before the new input.
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(second.id).previous_response_id == first.id
    # What the second was generated from, listed through the first router: both turns' items.
    items = list(client.responses.input_items.list(second.id, order="asc"))
    assert [item.type for item in items] == ["message"] * 3
    assert [item.content[0].text for item in items] == ["My name is Ada.", first.output_text, "What is my name?"]
    client.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError) as refused:
        other.responses.create(model="tiny", input="And now?", previous_response_id=second.id, max_output_tokens=2)
    assert refused.value.code == "previous_response_not_found"


def test_cache_salt_and_return_token_ids_through_the_openai_client(client):
    """vLLM's request extras on real engines: a prompt under a new salt finds nothing cached (not
    even blocks other requests cached unsalted), and the answer carries its token ids."""
    messages = [{"role": "system", "content": "Write a haiku."}, {"role": "user", "content": "About salt"}]
    for _ in range(2):  # the prompt unsalted, on both engines (round robin)
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    salt = f"tenant-{uuid.uuid4().hex}"
    salted = [client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                             extra_body={"cache_salt": salt, "return_token_ids": True})
              for _ in range(3)]
    assert salted[0].usage.prompt_tokens > 16  # (a full block to cache)
    assert salted[0].usage.prompt_tokens_details.cached_tokens == 0
    assert max(c.usage.prompt_tokens_details.cached_tokens for c in salted[1:]) >= 16  # two met on one engine
    first = salted[0]
    assert len(first.prompt_token_ids) == first.usage.prompt_tokens
    assert len(first.choices[0].token_ids) == first.usage.completion_tokens
    assert all(c.choices[0].token_ids == first.choices[0].token_ids for c in salted)  # greedy: the same answer
    completion = client.completions.create(model="tiny", prompt=first.prompt_token_ids, max_tokens=3, temperature=0,
                                           extra_body={"return_token_ids": True})
    assert completion.choices[0].prompt_token_ids == first.prompt_token_ids


def test_a_custom_logits_processor_through_the_openai_client(client):
    """--logits-processors on real engines: vllm_xargs turn the processor on for one request (even a
    random one, streamed or not), its validate_params refuses bad arguments with a 400, and other
    requests in the same batches are left alone."""
    from concurrent.futures import ThreadPoolExecutor

    target = 42

    def plain_answer(_=None):
        return client.completions.create(model="tiny", prompt="Hello there", max_tokens=6, temperature=0,
                                         extra_body={"return_token_ids": True, "ignore_eos": True})

    def steered_answer(n=1):
        return client.completions.create(model="tiny", prompt="Hello there", max_tokens=6, temperature=0.8, n=n,
                                         extra_body={"return_token_ids": True, "ignore_eos": True,
                                                     "vllm_xargs": {"target_token": target}})

    plain = plain_answer()
    assert plain.choices[0].token_ids != [target] * 6
    assert [c.token_ids for c in steered_answer(2).choices] == [[target] * 6] * 2
    # Steered and plain requests at once, so they share the engines' batches (four: engine 1's queue is short).
    with ThreadPoolExecutor(4) as pool:
        mixed = list(pool.map(lambda i: (plain_answer if i % 2 else steered_answer)(), range(4)))
    for i, answer in enumerate(mixed):
        assert answer.choices[0].token_ids == (plain.choices[0].token_ids if i % 2 else [target] * 6)
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                            stream=True, extra_body={"return_token_ids": True, "ignore_eos": True,
                                                                     "vllm_xargs": {"target_token": target}})
    ids = [t for chunk in stream for choice in chunk.choices for t in (getattr(choice, "token_ids", None) or [])]
    assert ids == [target] * 4
    again = client.completions.create(model="tiny", prompt="Hello there", max_tokens=6, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
    assert again.choices[0].token_ids == plain.choices[0].token_ids
    with pytest.raises(openai.BadRequestError, match="target_token must be a non-negative integer"):
        client.completions.create(model="tiny", prompt="Hello", max_tokens=2,
                                  extra_body={"vllm_xargs": {"target_token": "x"}})


def test_prompt_embeddings_through_the_openai_client(client, tiny_model_dir):
    """--enable-prompt-embeds on real engines: the embedding table's rows of a prompt's tokens,
    sent as vLLM's clients send them (base64 of torch.save, the prompt left empty), answer as the
    tokens do, plain and streamed; rows of the wrong width are a 400."""
    import torch
    from safetensors.torch import load_file

    from engine_core.prompt_embeds import encode_prompt_embeds

    table = load_file(str(tiny_model_dir / "model.safetensors"))["model.embed_tokens.weight"]
    ids = client.completions.create(model="tiny", prompt="Hello there, how are", max_tokens=1,
                                    extra_body={"return_token_ids": True}).choices[0].prompt_token_ids
    by_tokens = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
    encoded = encode_prompt_embeds(table[torch.tensor(ids)])
    by_rows = client.completions.create(model="tiny", prompt="", max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True, "prompt_embeds": encoded})
    assert by_rows.choices[0].text == by_tokens.choices[0].text
    assert by_rows.usage.prompt_tokens == len(ids)
    stream = client.completions.create(model="tiny", prompt="", max_tokens=8, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True, "prompt_embeds": encoded})
    assert "".join(c.choices[0].text for c in stream if c.choices) == by_tokens.choices[0].text
    with pytest.raises(openai.BadRequestError, match="hidden size 64"):
        client.completions.create(model="tiny", prompt="", max_tokens=2,
                                  extra_body={"prompt_embeds": encode_prompt_embeds(torch.zeros(3, 8))})


def test_beam_search_through_the_openai_client(client):
    """use_beam_search on real engines: n distinct beams, best first, each beam's logprobs the
    engines' own (its cumulative logprob is its continuation's likelihood as prompt logprobs score it)."""
    prompt = "The capital of France is"
    out = client.completions.create(model="tiny", prompt=prompt, n=3, max_tokens=4, logprobs=0,
                                    extra_body={"use_beam_search": True, "ignore_eos": True, "return_token_ids": True})
    assert [c.index for c in out.choices] == [0, 1, 2] and out.usage.completion_tokens == 12
    assert len({tuple(c.token_ids) for c in out.choices}) == 3
    cums = [sum(c.logprobs.token_logprobs) for c in out.choices]
    assert cums == sorted(cums, reverse=True)
    prompt_ids = out.choices[0].prompt_token_ids
    for choice, cum in zip(out.choices, cums, strict=True):
        scored = client.completions.create(model="tiny", prompt=prompt_ids + choice.token_ids, max_tokens=1,
                                           extra_body={"prompt_logprobs": 0})
        rows = scored.choices[0].prompt_logprobs[len(prompt_ids):]
        assert sum(row[str(t)]["logprob"] for row, t in zip(rows, choice.token_ids, strict=True)) == \
            pytest.approx(cum, abs=1e-3)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], n=2,
                                          max_tokens=3, extra_body={"use_beam_search": True}, stream=True)
    assert {c.choices[0].index for c in chat if c.choices} == {0, 1}


def test_completions_n2_and_echo(client):
    out = client.completions.create(model="tiny", prompt="Paris is", max_tokens=6, n=2, temperature=1.0, seed=3,
                                    extra_body={"ignore_eos": True})
    assert len(out.choices) == 2 and {c.index for c in out.choices} == {0, 1}
    assert out.usage.completion_tokens == 12
    echo = client.completions.create(model="tiny", prompt="Paris is", max_tokens=2, echo=True, temperature=0)
    assert echo.choices[0].text.startswith("Paris is")


def test_seeded_sampling_is_reproducible(client):
    def run():
        return client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=1.0, seed=1234,
                                         extra_body={"ignore_eos": True}).choices[0].text
    assert run() == run()


def test_stop_string_cuts_the_text(client):
    base = client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(base) > 4
    stop = base[2:4]
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == base[:base.find(stop)] and out.choices[0].finish_reason == "stop"
    kept = client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0, stop=stop,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == base[:base.find(stop) + len(stop)]


def test_logit_bias_and_allowed_token_ids_through_the_openai_client(client, cluster):
    """OpenAI's logit_bias (token ids as strings) and vLLM's allowed_token_ids steer the engines'
    sampler; the text is those tokens' decode."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cluster["config"].model)
    forced = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0,
                                       logit_bias={"65": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == tok.decode([65] * 5)
    allowed = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=12, temperature=1.0, seed=7, logprobs=True,
                                             extra_body={"ignore_eos": True, "allowed_token_ids": [65, 66, 67]})
    assert {t.token for t in allowed.choices[0].logprobs.content} <= {tok.decode([t]) for t in (65, 66, 67)}


def test_structured_output_through_the_openai_client(client, cluster):
    """response_format json_schema (chat, streamed too) and vLLM's guided_choice (completions): the
    text fits the constraint and the choice ends with finish_reason "stop"."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cluster["config"].model)
    # The random model would spend its budget on JSON's optional whitespace: keep it out.
    quiet = {str(t): -100 for t in range(len(tok))
             if (text := tok.decode([t])) and not text.strip() and t not in tok.all_special_ids}
    schema = {"type": "object", "properties": {"size": {"enum": ["S", "M", "L"]}, "qty": {"type": "integer"}},
              "required": ["size", "qty"], "additionalProperties": False}
    response_format = {"type": "json_schema", "json_schema": {"name": "order", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "Order a shirt"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=64, temperature=1.0, seed=5,
                                          response_format=response_format, logit_bias=quiet)
    order = json.loads(chat.choices[0].message.content)
    assert order["size"] in ("S", "M", "L") and isinstance(order["qty"], int)
    assert chat.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=64, temperature=1.0, seed=5,
                                            response_format=response_format, logit_bias=quiet, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == chat.choices[0].message.content
    # vLLM's structural_tag response format: here one tag the answer must be (begin, JSON, end), whole.
    tagged_format = {"type": "structural_tag", "format": {"type": "tag", "begin": "<order>", "end": "</order>",
                                                          "content": {"type": "json_schema", "json_schema": schema}}}
    tagged = client.chat.completions.create(model="tiny", messages=messages, max_tokens=64, temperature=1.0, seed=5,
                                            response_format=tagged_format, logit_bias=quiet)
    text = tagged.choices[0].message.content
    assert text.startswith("<order>") and text.endswith("</order>"), text
    assert json.loads(text.removeprefix("<order>").removesuffix("</order>"))["size"] in ("S", "M", "L")
    picked = client.completions.create(model="tiny", prompt="Pick one:", max_tokens=16, temperature=1.0, n=2, seed=2,
                                       extra_body={"guided_choice": ["red", "green", "blue"]})
    assert all(c.text in ("red", "green", "blue") and c.finish_reason == "stop" for c in picked.choices)
    bad = httpx.post(f"{cluster['base']}/v1/completions", json={
        "model": "tiny", "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objekt"}}}}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
    bad_tag = httpx.post(f"{cluster['base']}/v1/completions", json={
        "model": "tiny", "prompt": "x", "structured_outputs": {"structural_tag": '{"type": "structural_tag"}'}},
        timeout=30)
    assert bad_tag.status_code == 400 and bad_tag.json()["error"]["param"] == "structured_outputs"


def test_tool_calls_through_the_openai_client(client, cluster):
    """A named tool_choice and "required" constrain the model to the tools' schemas: the openai
    client gets tool calls whose arguments fit them, whole and streamed; "auto" (enabled on the
    prefix app, hermes parser) leaves the model free, under a chat template that shows the tools."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cluster["config"].model)
    quiet = {str(t): -100 for t in range(len(tok))
             if (text := tok.decode([t])) and not text.strip() and t not in tok.all_special_ids}
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Rome", "Oslo"]}, "days": {"enum": [1, 2, 3]}},
        "required": ["city", "days"], "additionalProperties": False}}}
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    common = {"model": "tiny", "messages": messages, "tools": [weather, clock], "max_tokens": 64, "temperature": 1.0,
              "seed": 3, "logit_bias": quiet}
    named = client.chat.completions.create(**common, tool_choice={"type": "function",
                                                                  "function": {"name": "get_weather"}})
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Rome", "Oslo") and args["days"] in (1, 2, 3)
    assert named.choices[0].finish_reason == "stop" and named.choices[0].message.content is None
    streamed_args = "".join(
        tc.function.arguments or "" for chunk in client.chat.completions.create(
            **common, tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True)
        for tc in (chunk.choices[0].delta.tool_calls or () if chunk.choices else ()))
    assert streamed_args == call.function.arguments
    # The openai client's stream helper (strict tools only) sees each call end and parses it.
    strict = {"type": "function", "function": {**weather["function"], "strict": True}}
    with client.chat.completions.stream(**{**common, "tools": [strict]}, tool_choice={
            "type": "function", "function": {"name": "get_weather"}}) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    assert [(e.name, e.arguments) for e in done] == [("get_weather", call.function.arguments)]
    assert final.choices[0].message.tool_calls[0].function.parsed_arguments == args
    # (One call each: the random model would otherwise go on adding calls up to max_tokens.)
    required = client.chat.completions.create(**common, tool_choice="required", n=2, parallel_tool_calls=False)
    for choice in required.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls) == 1 and choice.message.content is None
        for tc in choice.message.tool_calls:
            schema = {"get_weather": weather, "get_time": clock}[tc.function.name]["function"]["parameters"]
            assert set(json.loads(tc.function.arguments)) == set(schema["required"])
    # "auto" on the app that enabled it: the tools reach the prompt through its chat template.
    # (A short tool: the tiny model's context is 256 tokens.)
    auto = httpx.post(f"{cluster['base']}/prefix/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": messages, "tools": [{"type": "function", "function": {"name": "now"}}],
        "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    plain = httpx.post(f"{cluster['base']}/prefix/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": messages, "max_tokens": 4})
    assert auto.status_code == 200 and plain.status_code == 200, auto.text
    assert auto.json()["usage"]["prompt_tokens"] > plain.json()["usage"]["prompt_tokens"] + 10
    # That app's deepseek_r1 reasoning parser: the random model never closes its thinking, so the
    # whole answer is reasoning.
    message = auto.json()["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"] is None and message["tool_calls"] is None
    # The main app did not enable "auto": the default tool_choice with tools is refused there.
    refused = httpx.post(f"{cluster['base']}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": messages, "tools": [weather]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice"


def test_logprobs(client):
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob <= 0
        # Greedy: the sampled token is the most likely one.
        assert item.logprob == pytest.approx(max(t.logprob for t in item.top_logprobs), abs=1e-5)
    comp = client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0, logprobs=2)
    assert len(comp.choices[0].logprobs.tokens) == 3 and len(comp.choices[0].logprobs.top_logprobs[0]) == 2
    rows = comp.choices[0].logprobs
    assert all(top[token] == lp for token, lp, top in zip(rows.tokens, rows.token_logprobs, rows.top_logprobs))
    # Echo with logprobs scores the prompt too (its first token has none), as evaluation harnesses need.
    prompt = "Paris is the capital of"
    echoed = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=1,
                                       echo=True, extra_body={"ignore_eos": True})
    whole, num_prompt = echoed.choices[0].logprobs, echoed.usage.prompt_tokens
    assert num_prompt > 3 and len(whole.tokens) == num_prompt + 6 and "".join(whole.tokens[:num_prompt]) == prompt
    assert whole.token_logprobs[0] is None and whole.top_logprobs[0] is None
    assert all(lp <= 0 for lp in whole.token_logprobs[1:]) and whole.text_offset[0] == 0
    only_prompt = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, logprobs=1, echo=True)
    assert only_prompt.choices[0].text == prompt and only_prompt.usage.completion_tokens == 0
    assert only_prompt.choices[0].logprobs.token_logprobs == pytest.approx(whole.token_logprobs[:num_prompt])
    # Streamed, the same tokens and offsets: the echo chunk carries the prompt's, then each chunk continues.
    offsets, tokens = [], []
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=1,
                                           echo=True, stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            offsets += chunk.choices[0].logprobs.text_offset
            tokens += chunk.choices[0].logprobs.tokens
    assert tokens == whole.tokens and offsets == whole.text_offset
    # vLLM's prompt_logprobs: per prompt token (None for the first) its logprob, its rank and the
    # k best alternatives; the same numbers as echo's.
    scored = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 2})
    rows = scored.choices[0].model_extra["prompt_logprobs"]
    assert len(rows) == num_prompt and rows[0] is None
    for row, token, logprob in zip(rows[1:], whole.tokens[1:num_prompt], whole.token_logprobs[1:num_prompt],
                                   strict=True):
        first = next(iter(row.values()))  # the prompt's own token comes first
        assert first["decoded_token"] == token and first["logprob"] == pytest.approx(logprob, abs=1e-5)
        assert first["rank"] >= 1 and 2 <= len(row) <= 3
        alternatives = sorted(v["rank"] for v in row.values())
        assert alternatives[-1] <= max(2, first["rank"])
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    rows = chat.model_extra["prompt_logprobs"]
    assert len(rows) == chat.usage.prompt_tokens and rows[0] is None and all(len(r) == 1 for r in rows[1:])
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})


def test_round_robin_sends_traffic_to_both_engines(client, cluster):
    before = [s.num_requests_added for s in _stats(cluster)]
    for _ in range(4):
        client.completions.create(model="tiny", prompt="Hello", max_tokens=2, temperature=0)
    after = [s.num_requests_added for s in _stats(cluster)]
    assert all(a - b >= 1 for a, b in zip(after, before))


def _error(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_error_statuses_with_openai_error_bodies(cluster):
    base = cluster["base"]
    r = httpx.post(f"{base}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and _error(r)
    r = httpx.post(f"{base}/v1/completions", json={"model": "tiny"})
    assert r.status_code == 400 and _error(r)["param"] == "prompt"
    r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "x", "temperature": 9})
    assert r.status_code == 400 and _error(r)["param"] == "temperature"
    r = httpx.post(f"{base}/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and _error(r)["param"] == "model"
    r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 10_000})
    assert r.status_code == 400 and _error(r)["param"] == "max_tokens"
    r = httpx.post(f"{base}/v1/chat/completions", json={"model": "tiny", "messages": [], "max_tokens": 2})
    assert r.status_code == 400 and _error(r)["param"] == "messages"
    r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "x", "priority": 3})
    assert r.status_code == 400 and _error(r)["param"] == "priority"
    _wait_idle(cluster)


def test_queue_limit_gives_429_and_leaks_nothing(cluster):
    base = cluster["base"]

    async def flood():
        async with httpx.AsyncClient(timeout=120) as c:
            # (Long enough that the first are still running when the last arrive on a loaded machine:
            # with 40 tokens, a slow arrival of the 16 let the first finish and free their places.)
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 200, "ignore_eos": True}
            return await asyncio.gather(*(c.post(f"{base}/v1/completions", json=body) for _ in range(16)))

    codes = [r.status_code for r in asyncio.run(flood())]
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}
    _wait_idle(cluster)


@pytest.mark.parametrize("n", [1, 2])
def test_streamed_requests_are_refused_with_a_status_not_an_event(cluster, n):
    # Every choice of a streamed request is sent to its engine before the response starts, so a full
    # queue is a 429 the client sees as such (openai raises RateLimitError), not a 200 carrying an
    # error event; choices already admitted for a refused request are aborted.
    base = cluster["base"]

    async def one(c):
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 40, "ignore_eos": True, "stream": True, "n": n}
        async with c.stream("POST", f"{base}/v1/completions", json=body) as r:
            text = (await r.aread()).decode()
            return r.status_code, text

    async def flood():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(one(c) for _ in range(16)))

    results = asyncio.run(flood())
    codes = [code for code, _ in results]
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}
    for code, text in results:
        if code == 429:
            assert json.loads(text)["error"]["type"] == "RateLimitError"
        else:
            assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text
            assert text.count('"finish_reason":"length"') == n
    stats = _wait_idle(cluster)
    assert all(s.num_free_blocks == s.num_blocks for s in stats)


def test_client_disconnect_aborts_the_request_and_frees_blocks(cluster):
    base = cluster["base"]
    with httpx.stream("POST", f"{base}/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": "Hello", "max_tokens": 200, "stream": True,
                            "ignore_eos": True}) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: ") and '"text"' in line:
                break
        busy = _stats(cluster)
        assert any(s.num_unfinished_requests for s in busy)
    # The stream is closed before 200 tokens were generated: the engine must drop the request.
    stats = _wait_idle(cluster)
    assert all(s.num_free_blocks == s.num_blocks for s in stats)


def test_request_timeout_aborts_and_frees_blocks(cluster):
    url = f"{cluster['base']}/timeout/v1/completions"
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 240, "ignore_eos": True}
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 408 and _error(r)["type"] == "TimeoutError"
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and json.loads(data[-2])["error"]["code"] == 408
    stats = _wait_idle(cluster)
    assert all(s.num_free_blocks == s.num_blocks for s in stats)


def test_streaming_sse_format_ends_with_done(cluster):
    with httpx.stream("POST", f"{cluster['base']}/v1/chat/completions", timeout=60,
                      json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                            "stream": True}) as r:
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert all(json.loads(d)["object"] == "chat.completion.chunk" for d in data[:-1])


def test_answers_are_named_by_serves_request_id_and_browsers_may_call(cluster):
    """Through Serve: the answer's id is cmpl-<X-Request-Id>, the id Serve answers with (the client's,
    or one Serve gives it), and a CORS preflight passes, as vLLM's defaults allow."""
    base = cluster["base"]
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
    named = httpx.post(f"{base}/v1/completions", json=body, headers={"X-Request-Id": "e2e-trace-1"}, timeout=60)
    assert named.json()["id"] == "cmpl-e2e-trace-1" and named.headers["x-request-id"] == "e2e-trace-1"
    unnamed = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert unnamed.json()["id"] == f"cmpl-{unnamed.headers['x-request-id']}"
    # vLLM's request_id field counts behind Serve too (whose made-up header id it comes before).
    in_body = httpx.post(f"{base}/v1/completions", json={**body, "request_id": "job-42"}, timeout=60)
    assert in_body.json()["id"] == "cmpl-job-42"
    preflight = httpx.options(f"{base}/v1/chat/completions", timeout=60, headers={
        "Origin": "https://ui.example.com", "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"


def test_tokenize_detokenize_version_models(cluster):
    base = cluster["base"]
    toks = httpx.post(f"{base}/tokenize", json={"prompt": "Hello world"}).json()
    assert toks["count"] == len(toks["tokens"]) > 0
    assert httpx.post(f"{base}/detokenize", json={"tokens": toks["tokens"]}).json()["prompt"] == "Hello world"
    assert httpx.get(f"{base}/version").json()["version"]
    assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == "tiny"
    assert "llm_cluster:router_requests_routed_total" in httpx.get(f"{base}/metrics").text


def test_vllms_serving_routes_through_serve(cluster, tiny_model_dir):
    """SageMaker's /ping and /invocations, and the flags' /load and /tokenizer_info, on real engines
    through Serve: the flags reach each app's replicas (the base app has neither)."""
    from transformers import AutoTokenizer

    base, tracked = cluster["base"], f"{cluster['base']}/prefix2"
    assert httpx.get(f"{base}/ping").status_code == 200 and httpx.post(f"{base}/ping").status_code == 200
    chat = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0}
    invoked = httpx.post(f"{base}/invocations", json=chat, timeout=60).json()
    direct = httpx.post(f"{base}/v1/chat/completions", json={"model": "tiny", **chat}, timeout=60).json()
    assert invoked["object"] == "chat.completion"
    assert invoked["choices"][0]["message"] == direct["choices"][0]["message"]
    assert httpx.post(f"{base}/invocations", json={"input": "Hello"}, timeout=60).json()["data"][0]["embedding"]
    assert httpx.get(f"{base}/tokenizer_info").status_code == 404
    info = httpx.get(f"{tracked}/tokenizer_info").json()
    assert info["tokenizer_class"] == type(AutoTokenizer.from_pretrained(tiny_model_dir)).__name__
    assert httpx.get(f"{base}/load").json() == {"server_load": 0}
    assert httpx.get(f"{tracked}/load").json() == {"server_load": 0}
    # A request held by paused engines is in progress (counted by the app's one replica) until it ends.
    assert httpx.post(f"{tracked}/pause?mode=keep").json() == {"status": "paused"}
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(httpx.post, f"{tracked}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "Hello", "max_tokens": 8, "stream": True})
        try:
            deadline = time.monotonic() + 10
            while httpx.get(f"{tracked}/load").json()["server_load"] == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert httpx.get(f"{tracked}/load").json() == {"server_load": 1} and not held.done()
        finally:
            httpx.post(f"{tracked}/resume")
        assert held.result().text.endswith("data: [DONE]\n\n")
    deadline = time.monotonic() + 10  # (the count drops once the body's end has been sent)
    while httpx.get(f"{tracked}/load").json()["server_load"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(f"{tracked}/load").json() == {"server_load": 0}


def test_sleeping_engines_hold_requests_until_they_wake_up(cluster):
    """--enable-sleep-mode engines through the dev-mode app: /sleep (level 2: the weights are read
    again), a request sent while asleep waits, /resume leaves them asleep (409), and after /wake_up
    it gets the same answer as before."""
    import ray

    base = f"{cluster['base']}/prefix2"
    body = {"model": "tiny", "prompt": "Hello world", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    before = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert httpx.post(f"{base}/sleep?level=2", timeout=120).json() == {"status": "sleeping", "level": 2}
    try:
        assert httpx.get(f"{base}/is_sleeping").json() == {"is_sleeping": True, "sleeping_engines": 2, "engines": 2}
        # (The level, as an engine the autoscaler starts meanwhile reads it to join them.)
        assert [ray.get(e.actor.sleep_level.remote()) for e in cluster["engines"]] == [2, 2]
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(httpx.post, f"{base}/v1/completions", json=body, timeout=120)
            time.sleep(0.5)
            assert not held.done()
            assert httpx.post(f"{base}/resume").status_code == 409 and not held.done()
            assert httpx.post(f"{base}/wake_up?tags=weights", timeout=300).json() == {"is_sleeping": True}
            assert httpx.post(f"{base}/wake_up", timeout=300).json() == {"is_sleeping": False}
            assert held.result().json()["choices"][0]["text"] == before
    finally:
        httpx.post(f"{base}/wake_up", timeout=300)
    assert httpx.get(f"{base}/is_sleeping").json()["is_sleeping"] is False
    assert [ray.get(e.actor.sleep_level.remote()) for e in cluster["engines"]] == [0, 0]


def test_prefix_aware_routing_sends_shared_prefix_to_the_engine_holding_it(cluster):
    base = f"{cluster['base']}/prefix"
    shared = "The quick brown fox jumps over the lazy dog. " * 4
    before = _stats(cluster)
    for tail in ("Hello", "Paris is", "def main():", "naïve café", "Berlin is"):
        r = httpx.post(f"{base}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": shared + tail, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200
    after = _stats(cluster)
    added = [a.num_requests_added - b.num_requests_added for a, b in zip(after, before)]
    hits = [a.prefix_cache_hits - b.prefix_cache_hits for a, b in zip(after, before)]
    holder = max(range(2), key=lambda i: added[i])
    assert added[holder] == 5 and added[1 - holder] == 0
    # The engines' own prefix-cache counters prove the hits (4 later requests reuse the prefix blocks).
    assert hits[holder] >= 4 * 16


def test_a_prefix_cached_through_one_router_attracts_another_routers_requests(cluster):
    """The "prefix2" replica never routed these prefixes: it knows from the engines' KV cache events
    which engine holds each, and sends the requests that share it there (without the events, each
    would have a 1 in 2 chance; three prefixes make a lucky pass 1 in 8)."""
    def post(app: str, prompt: str) -> None:
        r = httpx.post(f"{cluster['base']}/{app}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200

    for round_ in range(3):
        shared = f"Round {round_}: Berlin is the capital of Germany, Paris is the capital of France. " * 3
        before = _stats(cluster)
        post("prefix", shared + "Rome")
        middle = _stats(cluster)
        holder = max(range(2), key=lambda i: middle[i].num_requests_added - before[i].num_requests_added)
        time.sleep(1.0)  # the events of that pass reach every subscribed replica (generous: CI is 2 busy cores)
        for tail in ("Madrid", "Lisbon"):
            post("prefix2", shared + tail)
        after = _stats(cluster)
        added = [a.num_requests_added - m.num_requests_added for a, m in zip(after, middle)]
        assert added[holder] == 2 and added[1 - holder] == 0, (round_, holder, added)
        assert after[holder].prefix_cache_hits - middle[holder].prefix_cache_hits >= 2 * 16


def test_pause_aborts_streams_holds_new_requests_and_resume_serves_them(cluster):
    """--server-dev-mode on real engines: a stream sent while the engines are frozen (mode keep) waits;
    POST /pause (mode abort) ends it with finish reason "abort" and leaves the engines empty; a request
    sent while paused waits until /resume; /reset_prefix_cache succeeds once idle; the app without the
    flag has no such endpoints."""
    from concurrent.futures import ThreadPoolExecutor

    base = f"{cluster['base']}/prefix2"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
    assert httpx.post(f"{cluster['base']}/pause").status_code == 404  # (the app at / has no dev mode)

    def streamed_finish_reasons():
        stream = client.completions.create(model="tiny", prompt="Paris is", max_tokens=100, stream=True,
                                           temperature=0, extra_body={"ignore_eos": True})
        return [chunk.choices[0].finish_reason for chunk in stream if chunk.choices]

    try:
        assert httpx.post(f"{base}/pause?mode=keep").json() == {"status": "paused"}
        assert httpx.get(f"{base}/is_paused").json() == {"is_paused": True, "paused_engines": 2, "engines": 2}
        with ThreadPoolExecutor(2) as pool:
            frozen = pool.submit(streamed_finish_reasons)
            deadline = time.monotonic() + 30
            while sum(s.num_unfinished_requests for s in _stats(cluster)) == 0:  # it reached an engine
                assert time.monotonic() < deadline and not frozen.done()
                time.sleep(0.05)
            assert not frozen.done()
            assert httpx.post(f"{base}/pause?mode=abort", timeout=30).json() == {"status": "paused",
                                                                                   "cache_cleared": True}
            assert frozen.result(timeout=30)[-1] == "abort"
            stats = _stats(cluster)
            assert all(s.num_unfinished_requests == 0 and s.num_free_blocks == s.num_blocks for s in stats)
            held = pool.submit(client.completions.create, model="tiny", prompt="Berlin is", max_tokens=4,
                               temperature=0)
            deadline = time.monotonic() + 30
            while sum(s.num_unfinished_requests for s in _stats(cluster)) == 0:  # it reached an engine
                assert time.monotonic() < deadline and not held.done()
                time.sleep(0.05)
            time.sleep(0.5)
            assert not held.done()  # waiting in the engine's queue
            assert httpx.post(f"{base}/resume").json() == {"status": "resumed"}
            assert held.result(timeout=60).choices[0].finish_reason == "length"
    finally:
        httpx.post(f"{base}/resume")
    assert httpx.get(f"{base}/is_paused").json()["is_paused"] is False
    _wait_idle(cluster)
    assert httpx.post(f"{base}/reset_prefix_cache").json() == {"status": "reset"}


def test_a_background_response_runs_on_its_replica_and_is_cancelled_through_another(cluster, client):
    """Background responses on real engines: one completes and is read back through another router
    app; one held in a frozen engine (pause, mode keep), named by a client's request_id, is cancelled
    through another app, whose engines tell the replica generating it: it stays cancelled, and the
    engines end up idle."""
    other = openai.OpenAI(base_url=f"{cluster['base']}/prefix/v1", api_key="unused", max_retries=0, timeout=60)
    done = client.responses.create(model="tiny", input="Hello", max_output_tokens=6, background=True)
    assert done.status == "queued"
    deadline = time.monotonic() + 30
    while (read := other.responses.retrieve(done.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert read.status in ("completed", "incomplete") and read.usage.output_tokens >= 1
    base = f"{cluster['base']}/prefix2"
    try:
        assert httpx.post(f"{base}/pause?mode=keep").json() == {"status": "paused"}
        # (Named by a client's request_id: the cancel through another app finds its engine request.)
        held = client.responses.create(model="tiny", input="Paris is", max_output_tokens=50, background=True,
                                       extra_body={"request_id": f"held-{time.monotonic_ns()}"})
        assert held.id.startswith("held-")
        deadline = time.monotonic() + 30
        while sum(s.num_unfinished_requests for s in _stats(cluster)) == 0:  # it reached an engine
            assert time.monotonic() < deadline
            time.sleep(0.05)
        cancelled = other.responses.cancel(held.id)
        assert cancelled.status == "cancelled" and cancelled.id == held.id
        deadline = time.monotonic() + 30
        while sum(s.num_unfinished_requests for s in _stats(cluster)):  # the engine dropped it
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        httpx.post(f"{base}/resume")
    _wait_idle(cluster)
    time.sleep(0.5)  # (the generating replica has heard of the abort, and not stored over the cancel)
    assert client.responses.retrieve(held.id).status == "cancelled"
    # Cancelling what has ended answers it as it ended (OpenAI's cancel is idempotent).
    assert other.responses.cancel(done.id).status == read.status
    assert other.responses.cancel(held.id).status == "cancelled"
    plain = client.responses.create(model="tiny", input="Hello", max_output_tokens=2, store=True)
    with pytest.raises(openai.BadRequestError):
        other.responses.cancel(plain.id)  # (not a background response)


def test_a_streamed_background_response_is_followed_through_another_app(cluster, client):
    """background with stream on real engines: the client reads its first events and leaves; another
    app streams the rest from the shared store (starting_after). A held one cancelled through another
    app ends its followers (with no completed event), and stays cancelled."""
    from concurrent.futures import ThreadPoolExecutor

    other = openai.OpenAI(base_url=f"{cluster['base']}/prefix/v1", api_key="unused", max_retries=0, timeout=60)
    stream = client.responses.create(model="tiny", input="Hello", max_output_tokens=12, temperature=0,
                                     background=True, stream=True)
    seen = []
    for event in stream:
        seen.append(event)
        if event.sequence_number == 2:
            break
    stream.close()  # (the client leaves)
    response_id = seen[0].response.id
    rest = list(other.responses.retrieve(response_id, stream=True, starting_after=2))
    assert [e.sequence_number for e in seen + rest] == list(range(len(seen) + len(rest)))
    assert rest[-1].type in ("response.completed", "response.incomplete")
    stored = other.responses.retrieve(response_id)
    assert (stored.status, stored.output_text) == (rest[-1].response.status, rest[-1].response.output_text)
    base = f"{cluster['base']}/prefix2"
    try:
        assert httpx.post(f"{base}/pause?mode=keep").json() == {"status": "paused"}
        held = client.responses.create(model="tiny", input="Paris is", max_output_tokens=50, background=True,
                                       stream=True)
        first = next(iter(held))
        held.close()
        with ThreadPoolExecutor(1) as pool:
            follower = pool.submit(lambda: list(other.responses.retrieve(first.response.id, stream=True)))
            deadline = time.monotonic() + 30
            while sum(s.num_unfinished_requests for s in _stats(cluster)) == 0:  # it reached an engine
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert not follower.done()
            assert other.responses.cancel(first.response.id).status == "cancelled"
            followed = follower.result(timeout=30)
        assert [e.type for e in followed[:3]] == ["response.created", "response.queued", "response.in_progress"]
        assert not {"response.completed", "response.incomplete", "response.failed"} & {e.type for e in followed}
    finally:
        httpx.post(f"{base}/resume")
    _wait_idle(cluster)
    assert client.responses.retrieve(first.response.id).status == "cancelled"


def test_anthropic_messages_on_real_engines(cluster):
    """The anthropic client against /v1/messages through Serve: a greedy answer whole and streamed
    is the same text, its usage counts the prompt /v1/messages/count_tokens counts."""
    import anthropic

    client = anthropic.Anthropic(base_url=cluster["base"], api_key="unused", max_retries=0, timeout=60)
    ask = {"model": "tiny", "max_tokens": 6, "messages": [{"role": "user", "content": "Hello"}],
           "system": "Be brief.", "extra_body": {"temperature": 0}}
    whole = client.messages.create(**ask)
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.usage.output_tokens >= 1
    with client.messages.stream(**ask) as stream:
        streamed = stream.get_final_message()
    assert [b.text for b in streamed.content] == [b.text for b in whole.content]
    counted = client.messages.count_tokens(model="tiny", system="Be brief.",
                                           messages=[{"role": "user", "content": "Hello"}])
    assert counted.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(**{**ask, "model": "nope"})


def test_health_is_503_when_every_engine_is_dead_and_200_after_restart(cluster):
    import ray

    base = cluster["base"]
    assert httpx.get(f"{base}/health").status_code == 200
    for e in cluster["engines"]:
        ray.kill(e.actor, no_restart=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and httpx.get(f"{base}/health", timeout=10).status_code != 503:
        time.sleep(0.5)
    assert httpx.get(f"{base}/health", timeout=10).status_code == 503
    r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and _error(r)
    stop_engines(cluster["engines"])
    cluster["engines"][:] = start_engines(cluster["config"].engine_configs(), cluster["config"].namespace)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and httpx.get(f"{base}/health", timeout=10).status_code != 200:
        time.sleep(0.5)
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200
