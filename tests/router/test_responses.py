"""POST /v1/responses through the app and the official openai client (its responses.create and its
stream helper), against a scripted engine: input items to the chat template, tools, text formats,
reasoning, the output items, the event stream, and the refusals. (test_e2e runs it on real engines.)"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent
from pydantic import TypeAdapter
from starlette.testclient import TestClient

from engine_core.request import FinishReason
from router.app import create_app
from router.chat_parsing import ChatOutputParser
from router.response_store import EventsPage, LocalResponseStore, ResponseStore
from router.responses import OutputItems, ResponsesRequest, ResponsesServing
from router.tool_parsers import HermesToolCallParser

from .test_tool_calling import _app

WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
HERMES_ANSWER = 'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'


def _client(http) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def _prompt(serving, engine, i: int = 0) -> str:
    return serving.tokenizer.decode(engine.requests[i].prompt_token_ids)




def test_text_in_text_out_with_instructions():
    http, engine, serving = _app("Paris is the capital.")
    response = _client(http).responses.create(model="tiny", input="Capital of France?", instructions="Be brief.",
                                              temperature=0)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "completed" and response.error is None and response.store is False
    assert response.output_text == "Paris is the capital."
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.id.startswith("msg_") and message.content[0].type == "output_text"
    # The instructions are the system message, before the input; the template's generation prompt follows.
    # (The template's newlines go with trim_blocks, as HF renders chat templates.)
    assert _prompt(serving, engine) == "system: Be brief.user: Capital of France?assistant:"
    assert response.usage.input_tokens == len(engine.requests[0].prompt_token_ids)
    assert response.usage.output_tokens == len(serving.tokenizer.encode("Paris is the capital.")) + 1  # and EOS
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert engine.requests[0].sampling_params.temperature == 0.0
    assert response.instructions == "Be brief." and response.model == "tiny"


def test_max_output_tokens_caps_the_answer_and_marks_it_incomplete():
    http, engine, _ = _app("one two three four five six")
    engine.finish = FinishReason.LENGTH  # what an engine reports when max_tokens ends the answer
    response = _client(http).responses.create(model="tiny", input="count", max_output_tokens=3)
    assert engine.requests[0].sampling_params.max_tokens == 3
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output_text == "one"  # one byte-level token each


def test_responses_and_events_validate_strictly_against_the_openai_types():
    http, _, _ = _app("<think>Hmm.</think>" + HERMES_ANSWER, parser="hermes", reasoning="deepseek_r1",
                      think_tokens=True)
    body = {"model": "tiny", "input": "weather in Rome?", "tools": [WEATHER_TOOL]}
    whole = Response.model_validate(http.post("/v1/responses", json=body).json())
    assert [item.type for item in whole.output] == ["reasoning", "message", "function_call"]
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        events = [TypeAdapter(ResponseStreamEvent).validate_python(json.loads(line[6:]))
                  for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1].type == "response.completed"
    # One item streams at a time: each is done before the next is added, as OpenAI streams them.
    lifecycle = [(e.type, e.output_index) for e in events if e.type.startswith("response.output_item.")]
    assert lifecycle == [("response.output_item.added", 0), ("response.output_item.done", 0),
                         ("response.output_item.added", 1), ("response.output_item.done", 1),
                         ("response.output_item.added", 2), ("response.output_item.done", 2)]


@pytest.mark.parametrize("tokens_per_output", range(1, 25))
def test_a_call_and_the_text_after_it_arriving_together_keep_the_calls_arguments_whole(tokens_per_output):
    """An engine output of several tokens (speculative decoding, merged outputs) can bring a call's
    last arguments and the text after it at once: the call gets all its arguments before the text's
    message closes it, and no arguments delta follows its done event."""
    answer = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>Done.'
    http, engine, _ = _app(answer, parser="hermes")
    engine.tokens_per_output = tokens_per_output
    body = {"model": "tiny", "input": "weather in Rome?", "tools": [WEATHER_TOOL], "stream": True}
    with http.stream("POST", "/v1/responses", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    call_id = next(e["item"]["id"] for e in events if e["type"] == "response.output_item.added"
                   and e["item"]["type"] == "function_call")
    done_at = next(i for i, e in enumerate(events) if e["type"] == "response.function_call_arguments.done")
    deltas = [i for i, e in enumerate(events) if e["type"] == "response.function_call_arguments.delta"]
    assert deltas and max(deltas) < done_at
    assert "".join(events[i]["delta"] for i in deltas) == events[done_at]["arguments"] == '{"city": "Rome"}'
    final = events[-1]["response"]
    [call] = [item for item in final["output"] if item["id"] == call_id]
    assert json.loads(call["arguments"]) == {"city": "Rome"}
    assert [item["type"] for item in final["output"]] == ["function_call", "message"]
    assert final["output"][1]["content"][0]["text"].strip() == "Done."


def test_output_items_take_a_calls_last_arguments_before_the_text_that_follows_it():
    """The parser's delta for "…me\"}}</tool_call>Done." carries the call's last arguments and the text
    after it; a delta with text then a new call (text written first) keeps that order."""
    events: list[tuple[str, dict]] = []
    items = OutputItems(lambda kind, **fields: events.append((kind, fields)))
    parser = ChatOutputParser(None, HermesToolCallParser())
    for chunk in ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro', 'me"}}\n</tool_call>Done.',
                  ' More <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'):
        items.add(parser.feed(chunk))
    items.add(parser.finish())
    items.finish("completed")
    done = [fields["item"] for kind, fields in events if kind == "response.output_item.done"]
    assert [(item["type"], item.get("arguments"), item.get("content", [{}])[0].get("text") if item["type"] ==
             "message" else None) for item in done] == [
        ("function_call", '{"city": "Rome"}', None), ("message", None, "Done. More"),
        ("function_call", '{"city": "Oslo"}', None)]


def test_a_stream_cut_by_max_output_tokens_ends_incomplete():
    http, engine, _ = _app("one two three four five six")
    engine.finish = FinishReason.LENGTH
    with _client(http).responses.stream(model="tiny", input="count", max_output_tokens=3) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-2].type == "response.output_item.done" and events[-2].item.status == "incomplete"


def test_input_items_become_chat_turns():
    """An assistant message and the calls after it are one turn; a call right after the user opens
    a turn of its own; outputs (text or text parts) are tool messages; the effort reaches the template."""
    chat = ResponsesRequest.model_validate({"model": "tiny", "reasoning": {"effort": "low"}, "input": [
        {"role": "user", "content": "weather in Rome and Oslo?"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Looking.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Rome"}',
         "status": "completed"},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
        {"role": "user", "content": "and Paris?"},
        {"type": "function_call", "call_id": "c3", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    ]}).chat_request()
    turns = [(m.role, m.content, [c["id"] for c in (m.model_extra or {}).get("tool_calls", [])],
              (m.model_extra or {}).get("tool_call_id")) for m in chat.messages]
    assert turns == [("user", "weather in Rome and Oslo?", [], None), ("assistant", "Looking.", ["c1", "c2"], None),
                     ("tool", "sunny", [], "c1"), ("tool", "rain", [], "c2"), ("user", "and Paris?", [], None),
                     ("assistant", None, ["c3"], None)]
    assert chat.chat_template_kwargs == {"reasoning_effort": "low"}


def test_named_and_required_tool_choices_constrain_as_in_chat():
    http, engine, _ = _app('{"city": "Rome"}')
    client = _client(http)
    named = client.responses.create(model="tiny", input="weather?", tools=[WEATHER_TOOL],
                                    tool_choice={"type": "function", "name": "get_weather"})
    assert engine.requests[0].sampling_params.structured_output == {"json": WEATHER_TOOL["parameters"]}
    [call] = named.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Rome"}
    http, engine, _ = _app('[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    required = _client(http).responses.create(model="tiny", input="weather?", tools=[WEATHER_TOOL],
                                              tool_choice="required")
    assert engine.requests[0].sampling_params.structured_output is not None
    assert [(c.name, json.loads(c.arguments)) for c in required.output] == [("get_weather", {"city": "Oslo"})]


def test_the_stream_is_the_responses_event_sequence_and_adds_up_to_the_final_response():
    http, _, _ = _app("Hello there, friend.")
    with _client(http).responses.stream(model="tiny", input="Hi") as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 3 and "".join(deltas) == "Hello there, friend."
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.status == "completed" and final.output_text == "Hello there, friend."
    created = events[0].response
    assert created.id == final.id and created.status == "in_progress"


def test_function_tools_answer_with_function_call_items_whole_and_streamed():
    http, engine, serving = _app(HERMES_ANSWER, parser="hermes")
    client = _client(http)
    response = client.responses.create(model="tiny", input="weather in Rome?", tools=[WEATHER_TOOL])
    message, call = response.output
    assert message.type == "message" and message.content[0].text == "Let me look."  # as chat's content
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {
        "city": "Rome"}
    assert call.call_id and call.id.startswith("fc_") and call.status == "completed"
    # The template saw the tools, in chat form.
    assert '"name": "get_weather"' in _prompt(serving, engine)
    with client.responses.stream(model="tiny", input="weather in Rome?", tools=[WEATHER_TOOL]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(arguments) == {"city": "Rome"} and done.arguments == arguments
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output[1].arguments == arguments


def test_a_conversation_with_calls_and_their_outputs_reaches_the_template():
    http, engine, serving = _app("It is sunny in Rome.", parser="hermes")
    response = _client(http).responses.create(model="tiny", tools=[WEATHER_TOOL], input=[
        {"role": "developer", "content": "Answer in one line."},
        {"role": "user", "content": [{"type": "input_text", "text": "weather in Rome?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 24 C"},
    ])
    assert response.output_text == "It is sunny in Rome."
    prompt = _prompt(serving, engine)
    assert prompt.endswith("system: Answer in one line.user: weather in Rome?assistant:  CALLS Rome"
                           "tool: sunny, 24 Cassistant:")


def test_text_format_json_schema_constrains_the_output():
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    http, engine, _ = _app('{"city": "Paris"}')
    response = _client(http).responses.create(model="tiny", input="a city", text={"format": {
        "type": "json_schema", "name": "city", "schema": schema, "strict": True}})
    assert engine.requests[0].sampling_params.structured_output == {"json": schema}
    assert json.loads(response.output_text) == {"city": "Paris"}
    assert response.text.format.type == "json_schema"
    _client(http).responses.create(model="tiny", input="json", text={"format": {"type": "json_object"}})
    assert engine.requests[1].sampling_params.structured_output == {"json_object": True}


def test_reasoning_comes_as_a_reasoning_item_before_the_message():
    http, _, serving = _app("<think>Short question.</think>Paris.", reasoning="deepseek_r1", think_tokens=True)
    client = _client(http)
    response = client.responses.create(model="tiny", input="Capital of France?")
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Short question."
    assert response.usage.output_tokens_details.reasoning_tokens == len(
        serving.tokenizer.encode("Short question.", add_special_tokens=False))
    assert message.content[0].text == "Paris." and response.output_text == "Paris."
    with client.responses.stream(model="tiny", input="Capital of France?") as stream:
        events = list(stream)
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == "Short question."
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    [done] = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == "Short question."
    assert stream.get_final_response().output[0].content[0].text == "Short question."


def test_an_engine_error_is_a_500_whole_and_an_error_event_streamed():
    http, engine, _ = _app("partial answer")
    engine.finish, engine.stop_reason = FinishReason.ERROR, "worker died"
    r = http.post("/v1/responses", json={"model": "tiny", "input": "hi"})
    assert r.status_code == 500 and "worker died" in r.json()["error"]["message"]
    with http.stream("POST", "/v1/responses", json={"model": "tiny", "input": "hi", "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[0]["type"] == "response.created" and [e["type"] for e in events[-2:]] == ["error",
                                                                                           "response.failed"]
    assert "worker died" in events[-2]["message"] and events[-2]["code"] == "server_error"
    failed = Response.model_validate(events[-1]["response"])
    assert failed.status == "failed" and failed.error.code == "server_error" and "worker died" in failed.error.message
    assert not any(e["type"] == "response.completed" for e in events)


def test_an_answer_the_engine_aborted_is_failed_not_completed():
    http, engine, _ = _app("partial answer")
    engine.finish = FinishReason.ABORT
    response = Response.model_validate(http.post("/v1/responses", json={"model": "tiny", "input": "hi"}).json())
    assert response.status == "failed" and response.error.code == "server_error"


@pytest.mark.parametrize(("body", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"text": {"format": {"type": "xml"}}}, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 100000}, "max_output_tokens"),  # beyond the context length
    ({"temperature": 3}, "temperature"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"reasoning": {"effort": 5}}, "reasoning"),
    ({"text": {"format": "json"}}, "text"),
    ({"input": [{"role": ["user"], "content": "hi"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": ["input_text"], "text": "hi"}]}]}, "input"),
    ({"input": ["hi"]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}]}, "input"),
])
def test_what_is_not_supported_is_refused_naming_the_parameter(body, param):
    http, engine, _ = _app("x")
    r = http.post("/v1/responses", json={"model": "tiny", "input": "hi", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert "max_tokens" not in r.json()["error"]["message"]  # the Responses name, not chat's
    assert not engine.requests


def test_responses_are_not_stored():
    http, _, _ = _app("x")
    with pytest.raises(openai.NotFoundError, match="does not store responses"):
        _client(http).responses.retrieve("resp_123")


# -- with a store (--enable-responses-store) ------------------------------------------------------


def _stored_app(answers: list[str], parser: str | None = None, max_entries: int = 100):
    """An app with a response store whose engine answers each request with the next of ``answers``."""
    _, engine, serving = _app(answers[0], parser=parser)
    tokenizer = serving.tokenizer
    engine.script = lambda _: [*tokenizer.encode(answers[min(len(engine.requests) - 1, len(answers) - 1)]),
                               tokenizer.eos_token_id]
    store = LocalResponseStore(max_entries)
    return TestClient(create_app(serving, response_store=store)), engine, serving, store


def test_stored_responses_are_retrieved_deleted_and_continued():
    http, engine, serving, _ = _stored_app(["Hello Ada.", "Your name is Ada.", "Still Ada.", "Ada!"])
    client = _client(http)
    first = client.responses.create(model="tiny", instructions="Be kind.", input="My name is Ada.")
    assert first.store is True
    second = client.responses.create(model="tiny", input="What is my name?", previous_response_id=first.id)
    assert second.previous_response_id == first.id and second.output_text == "Your name is Ada."
    # The stored turn (its input and its answer) comes first; its instructions are not carried over.
    assert _prompt(serving, engine, 1) == ("user: My name is Ada.assistant: Hello Ada."
                                           "user: What is my name?assistant:")
    with client.responses.stream(model="tiny", input="Sure?", previous_response_id=second.id) as stream:
        third = stream.get_final_response()
    assert third.output_text == "Still Ada."
    fourth = client.responses.create(model="tiny", input="Once more.", previous_response_id=third.id)
    assert _prompt(serving, engine, 3) == ("user: My name is Ada.assistant: Hello Ada.user: What is my name?"
                                           "assistant: Your name is Ada.user: Sure?assistant: Still Ada."
                                           "user: Once more.assistant:")
    assert client.responses.retrieve(second.id).model_dump() == second.model_dump()
    assert client.responses.retrieve(fourth.id).output_text == "Ada!"
    assert http.delete(f"/v1/responses/{second.id}").json() == {"id": second.id, "object": "response",
                                                               "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    # A conversation through a deleted response cannot be continued: OpenAI's 400, whose code clients
    # recover on (by sending the whole conversation), names the missing one.
    r = http.post("/v1/responses", json={"model": "tiny", "input": "x", "previous_response_id": fourth.id})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    assert r.json()["error"]["code"] == "previous_response_not_found"
    assert fourth.id in r.json()["error"]["message"] and second.id in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="tiny", input="x", previous_response_id="resp_never")
    assert refused.value.code == "previous_response_not_found"
    assert len(engine.requests) == 4


def test_a_request_id_names_the_response_and_a_stored_one_is_its_own():
    """vLLM's request_id: the response's id. Its engine request adds a random part (a client's id
    may name two requests at once); once a response of that id is stored, another is refused
    before it runs; not stored, one id may name many."""
    http, engine, _, store = _stored_app(["Hello.", "Again.", "Third.", "Fourth."])
    client = _client(http)
    named = client.responses.create(model="tiny", input="hi", extra_body={"request_id": "order-42"})
    assert named.id == "order-42" and client.responses.retrieve("order-42").output_text == "Hello."
    assert engine.requests[0].request_id.startswith("order-42-") and engine.requests[0].request_id != "order-42-0"
    r = http.post("/v1/responses", json={"model": "tiny", "input": "hi", "request_id": "order-42"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id" and len(engine.requests) == 1
    unstored = [client.responses.create(model="tiny", input="hi", store=False, extra_body={"request_id": "x"})
                for _ in range(2)]
    assert [u.id for u in unstored] == ["x", "x"] and engine.requests[1].request_id != engine.requests[2].request_id
    assert store.store.get("x") is None


@pytest.mark.parametrize("request_id", ["", "has space", "a/b", "x" * 129])
def test_a_request_id_that_cannot_name_a_response_is_refused(request_id):
    http, engine, _, _ = _stored_app(["Hello."])
    r = http.post("/v1/responses", json={"model": "tiny", "input": "hi", "request_id": request_id})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id" and engine.requests == []


def test_a_conversation_through_a_deleted_response_does_not_go_on_through_a_new_one_of_its_id():
    """A chain whose response was deleted ends there, even once a client's request_id gives its id
    to a new response: the chain is not spliced into another conversation."""
    http, engine, _, _ = _stored_app(["Hello Ada.", "Your name is Ada.", "Hello Bob."])
    client = _client(http)
    client.responses.create(model="tiny", input="My name is Ada.", extra_body={"request_id": "turn-1"})
    second = client.responses.create(model="tiny", input="Name?", previous_response_id="turn-1")
    http.delete("/v1/responses/turn-1")
    client.responses.create(model="tiny", input="My name is Bob.", extra_body={"request_id": "turn-1"})
    r = http.post("/v1/responses", json={"model": "tiny", "input": "x", "previous_response_id": second.id})
    assert r.status_code == 400 and "turn-1" in r.json()["error"]["message"] and len(engine.requests) == 3
    assert http.get(f"/v1/responses/{second.id}/input_items").status_code == 404


def test_the_store_keeps_the_first_response_of_an_id_and_chains_by_entry_not_by_id():
    store = ResponseStore()
    assert store.put({"id": "a", "n": 1}, None, [{"id": "1"}])
    assert not store.put({"id": "a", "n": 2}, None, [])
    assert store.get("a") == {"id": "a", "n": 1}
    assert store.put({"id": "b"}, "a", [{"id": "2"}])
    assert store.conversation("b") == ([{"id": "1"}, {"id": "2"}], None)
    store.delete("a")
    assert store.put({"id": "a", "n": 3}, None, [{"id": "3"}])
    assert store.conversation("b") == (None, "a") and store.input_items("b") == (None, "a")
    assert store.conversation("a") == ([{"id": "3"}], None)
    # A response put while the one it continued was not held cannot be continued either.
    assert store.put({"id": "c"}, "gone", [])
    assert store.conversation("c") == (None, "gone") and store.input_items("c") == (None, "gone")
    # A turn is put once it is generated, linked to the entry it was started from (the serial
    # continuation gave): if that id was freed and taken meanwhile, its conversation ends there.
    store.put({"id": "p"}, None, [{"id": "4"}])
    (history, _), status, started_from = store.continuation("p")
    assert history == [{"id": "4"}] and status is None
    store.delete("p")
    store.put({"id": "p"}, None, [{"id": "5"}])
    assert store.put({"id": "r"}, "p", [{"id": "6"}], previous_serial=started_from)
    assert store.conversation("r") == (None, "p") and store.input_items("r") == (None, "p")


def test_a_response_asked_not_to_be_stored_is_not_kept():
    http, engine, _, store = _stored_app(["Fine."])
    unstored = _client(http).responses.create(model="tiny", input="hi", store=False)
    assert unstored.store is False and len(store.store) == 0
    r = http.post("/v1/responses", json={"model": "tiny", "input": "x", "previous_response_id": unstored.id})
    assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"
    assert len(engine.requests) == 1


def test_a_stored_function_call_is_continued_with_its_output():
    http, engine, serving, _ = _stored_app([HERMES_ANSWER, "It is sunny."], parser="hermes")
    client = _client(http)
    first = client.responses.create(model="tiny", input="weather in Rome?", tools=[WEATHER_TOOL])
    call = first.output[1]
    second = client.responses.create(model="tiny", tools=[WEATHER_TOOL], previous_response_id=first.id, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert second.output_text == "It is sunny."
    assert _prompt(serving, engine, 1).endswith("user: weather in Rome?assistant: Let me look. CALLS Rome"
                                                "tool: sunnyassistant:")


def test_the_store_forgets_the_least_recently_used_and_the_chains_through_them():
    store = ResponseStore(max_entries=2)
    store.put({"id": "a"}, None, [{"role": "user", "content": "1"}])
    store.put({"id": "b"}, "a", [{"role": "user", "content": "2"}])
    assert store.conversation("b") == ([{"role": "user", "content": "1"}, {"role": "user", "content": "2"}], None)
    store.get("a")  # used: b is now the least recently used
    store.put({"id": "c"}, None, [])
    assert store.get("b") is None and store.get("a") == {"id": "a"} and len(store) == 2
    store.put({"id": "d"}, "b", [])
    assert store.conversation("d") == (None, "b")
    assert store.delete("d") and not store.delete("d")


def test_a_call_cut_off_by_max_output_tokens_is_not_replayed():
    """An incomplete answer stored mid-call: its conversation still continues, without the call
    whose arguments never closed (it could not be sent to the template again)."""
    http, engine, serving, _ = _stored_app([HERMES_ANSWER, "Let me try again."], parser="hermes")
    engine.finish = FinishReason.LENGTH
    client = _client(http)
    first = client.responses.create(model="tiny", input="weather in Rome?", tools=[WEATHER_TOOL],
                                    max_output_tokens=len(serving.tokenizer.encode(
                                        HERMES_ANSWER[:HERMES_ANSWER.index("Rome") + 2])))
    assert first.status == "incomplete" and first.output[-1].type == "function_call"
    assert first.output[-1].arguments.endswith('"Ro')
    second = client.responses.create(model="tiny", input="go on", previous_response_id=first.id)
    assert second.status == "incomplete"  # (this engine finishes every answer by length)
    assert "CALLS" not in _prompt(serving, engine, 1) and "user: go onassistant:" in _prompt(serving, engine, 1)


class _BrokenStore(LocalResponseStore):
    async def put(self, *args, **kwargs):
        raise ConnectionError("store actor gone")

    async def get(self, response_id):
        raise ConnectionError("store actor gone")


def test_a_store_that_fails_leaves_the_answer_and_says_so():
    _, _, serving = _app("Fine.")
    http = TestClient(create_app(serving, response_store=_BrokenStore()))
    response = _client(http).responses.create(model="tiny", input="hi")
    assert response.output_text == "Fine." and response.store is False
    r = http.get(f"/v1/responses/{response.id}")
    assert r.status_code == 503 and "store actor gone" in r.json()["error"]["message"]
    assert http.get(f"/v1/responses/{response.id}?stream=true").status_code == 404  # (nor its events)


def test_the_latest_limit_applies_to_an_existing_store():
    store = ResponseStore(max_entries=3)
    for rid in "abc":
        store.put({"id": rid}, None, [])
    store.set_max_entries(1)
    assert len(store) == 1 and store.get("c") == {"id": "c"}


_RESPONSE_ITEM = TypeAdapter(ResponseItem)


def test_input_items_list_what_each_response_was_generated_from():
    http, engine, serving, _ = _stored_app([HERMES_ANSWER, "It is sunny.", "Bye."], parser="hermes")
    client = _client(http)
    first = client.responses.create(model="tiny", tools=[WEATHER_TOOL], input=[
        {"role": "developer", "content": "Answer in one line."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather in Rome?"}]}])
    call = first.output[1]
    second = client.responses.create(model="tiny", tools=[WEATHER_TOOL], previous_response_id=first.id, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    third = client.responses.create(model="tiny", previous_response_id=second.id, input=[
        {"role": "assistant", "content": "Anything else?"}, {"role": "user", "content": "No, thanks."}])

    listed = client.responses.input_items.list(third.id, order="asc", limit=100)
    assert listed.has_more is False
    items = [item.model_dump(exclude_none=True) for item in listed.data]
    for item in items:  # every item is one of OpenAI's item types, as the client would check it
        _RESPONSE_ITEM.validate_python(item, strict=True)
    assert len({item["id"] for item in items}) == len(items)
    summary = [(item["type"], item.get("role"), item.get("name") or item.get("output")) for item in items]
    assert summary == [
        ("message", "developer", None), ("message", "user", None),  # first's input
        ("message", "assistant", None), ("function_call", None, "get_weather"),  # first's output
        ("function_call_output", None, "sunny"),  # second's input
        ("message", "assistant", None),  # second's output
        ("message", "assistant", None), ("message", "user", None)]  # third's input
    texts = [item["content"][0]["text"] for item in items if item["type"] == "message"]
    assert texts == ["Answer in one line.", "weather in Rome?", "Let me look.", "It is sunny.", "Anything else?",
                     "No, thanks."]
    assert items[2]["id"] == first.output[0].id and items[3]["call_id"] == call.call_id
    assert [p["type"] for item in items if item["type"] == "message" for p in item["content"]] == [
        "input_text", "input_text", "output_text", "output_text", "output_text", "input_text"]
    # The default order is newest first; the client's pager walks pages of 3 with after=.
    newest_first = [item.id for item in client.responses.input_items.list(third.id, limit=3)]
    assert newest_first == [item["id"] for item in reversed(items)]
    page = client.responses.input_items.list(third.id, limit=3)
    assert page.has_more is True and len(page.data) == 3
    before = http.get(f"/v1/responses/{third.id}/input_items", params={"before": items[2]["id"], "order": "asc"})
    assert [item["id"] for item in before.json()["data"]] == [items[0]["id"], items[1]["id"]]
    assert [item.id for item in client.responses.input_items.list(first.id, order="asc")] == [
        item["id"] for item in items[:2]]
    # The stored items, in their listed shape, still make the same prompt when continued.
    assert _prompt(serving, engine, 2).startswith("system: Answer in one line.user: weather in Rome?assistant: "
                                                  "Let me look. CALLS Rome")


@pytest.mark.parametrize(("query", "status", "param"), [
    ({"limit": 0}, 400, "limit"), ({"limit": 101}, 400, "limit"), ({"order": "newest"}, 400, "order"),
    ({"after": "msg_nope"}, 400, "after"), ({"before": "msg_nope"}, 400, "before")])
def test_input_items_refuse_bad_pages(query, status, param):
    http, _, _, _ = _stored_app(["Fine."])
    response = _client(http).responses.create(model="tiny", input="hi")
    r = http.get(f"/v1/responses/{response.id}/input_items", params=query)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_input_items_of_a_response_not_held_are_a_404():
    http, _, _, _ = _stored_app(["One.", "Two."])
    client = _client(http)
    first = client.responses.create(model="tiny", input="1")
    second = client.responses.create(model="tiny", input="2", previous_response_id=first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match=first.id):  # the conversation it continued is gone
        client.responses.input_items.list(second.id)
    http, _, _ = _app("x")
    with pytest.raises(openai.NotFoundError, match="does not store responses"):
        _client(http).responses.input_items.list("resp_123")


def test_input_item_ids_stay_unique_when_a_client_resends_items():
    http, _, _, _ = _stored_app(["Hello Ada.", "Yes.", "Bye."])
    client = _client(http)
    first = client.responses.create(model="tiny", input="My name is Ada.")
    answer = first.output[0]
    # The client continues the stored conversation but also resends the answer it got (with its id),
    # twice, and an id of its own twice.
    again = {"type": "message", "role": "assistant", "id": answer.id,
             "content": [{"type": "output_text", "text": "Hello Ada.", "annotations": []}]}
    mine = {"type": "message", "role": "user", "id": "msg_mine", "content": "Right?"}
    second = client.responses.create(model="tiny", previous_response_id=first.id, input=[again, again, mine, mine])
    items = list(client.responses.input_items.list(second.id, order="asc"))
    ids = [item.id for item in items]
    assert len(ids) == 6 and len(set(ids)) == 6
    assert ids[1] == answer.id and ids[4] == "msg_mine"  # the first use keeps its id
    after = client.responses.input_items.list(second.id, order="asc", after=ids[2]).data
    assert [item.id for item in after] == ids[3:]


def test_a_background_response_is_queued_generated_and_read_back():
    """OpenAI's background mode: the answer to the create is the queued response; the replica then
    generates it, and GET finds it in progress, then completed. Cancelling it once it has ended
    answers it as it is (OpenAI's cancel is idempotent); one never stored is a 404."""
    import time

    _, engine, serving, store = _stored_app(["Background answer."])
    with TestClient(create_app(serving, response_store=store)) as http:
        client = _client(http)
        queued = client.responses.create(model="tiny", input="hi", background=True)
        assert (queued.status, queued.background, queued.output) == ("queued", True, [])
        deadline = time.monotonic() + 10
        while (done := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert done.status == "completed" and done.output_text == "Background answer." and done.background
        # Its conversation continues once it has ended (not while it is queued or in progress).
        assert store.store.get(queued.id)["status"] == "completed"
        for _ in range(2):
            again = client.responses.cancel(queued.id)
            assert again.status == "completed" and again.output_text == "Background answer."
        assert http.post("/v1/responses/resp_nope/cancel").status_code == 404
        assert len(engine.requests) == 1
        # Not streamed, it has no events to stream again.
        r = http.get(f"/v1/responses/{queued.id}?stream=true")
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


def test_a_background_response_named_by_a_request_id_reserves_it_before_it_runs():
    """Background with request_id: stored queued under it before its engine request starts, which
    is named by it (as a cancel through any replica names it); a second with that id is refused
    without an engine request; one whose start fails leaves no entry behind."""
    import time

    _, engine, serving, store = _stored_app(["Background answer."])
    with TestClient(create_app(serving, response_store=store)) as http:
        client = _client(http)
        queued = client.responses.create(model="tiny", input="hi", background=True, extra_body={"request_id": "bg-7"})
        assert queued.id == "bg-7"
        deadline = time.monotonic() + 10
        while client.responses.retrieve("bg-7").status in ("queued", "in_progress"):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        # Its engine request's id is new to it (an id freed by a delete may name another response while
        # this one's request still runs), and the store keeps it for a cancel through any replica.
        [started] = engine.requests
        assert started.request_id.startswith("bg-7-") and started.request_id != "bg-7-0"
        assert f"{store.store._entries['bg-7'].engine_base}-0" == started.request_id
        again = http.post("/v1/responses", json={"model": "tiny", "input": "hi", "background": True,
                                                 "request_id": "bg-7"})
        assert again.status_code == 400 and again.json()["error"]["param"] == "request_id"
        too_long = http.post("/v1/responses", json={"model": "tiny", "input": "hi " * 400, "background": True,
                                                    "request_id": "bg-8"})
        assert too_long.status_code == 400 and store.store.get("bg-8") is None
        assert len(engine.requests) == 1


def test_the_store_keeps_a_cancel_or_delete_over_a_background_responses_later_progress():
    store = ResponseStore()
    base = {"id": "resp_1", "object": "response", "output": [], "background": True}
    assert store.cancel("resp_1") is None
    first = store.put(base | {"status": "queued"}, None, [{"id": "msg_1"}], engine_base="resp_1-ab")
    assert store.settle(base | {"status": "in_progress"}, first)
    assert store.input_items("resp_1") == ([{"id": "msg_1"}], None)  # (its input kept)
    cancelled = store.cancel("resp_1")
    assert cancelled.response["status"] == "cancelled" and cancelled.engine_base == "resp_1-ab"
    assert not store.settle(base | {"status": "completed"}, first)  # (the generating replica, too late)
    assert store.get("resp_1")["status"] == "cancelled"
    again = store.cancel("resp_1")  # (idempotent: the cancelled response, with no engine requests to stop)
    assert again.response["status"] == "cancelled" and again.engine_base is None
    second = store.put(base | {"id": "resp_2", "status": "queued"}, None, [])
    assert store.delete("resp_2") and not store.settle(base | {"id": "resp_2", "status": "completed"}, second)
    assert store.get("resp_2") is None  # (a deleted one does not come back)
    # Nor does a stopping replica's failure replace an answer that had ended.
    third = store.put(base | {"id": "resp_3", "status": "queued"}, None, [])
    assert store.settle(base | {"id": "resp_3", "status": "completed"}, third)
    assert not store.settle(base | {"id": "resp_3", "status": "failed"}, third)
    assert store.get("resp_3")["status"] == "completed"


def test_a_background_response_whose_id_was_freed_never_touches_the_next_response_of_that_id():
    """A client's request_id freed by a delete names a new response while the old one's replica
    still runs: the old one's progress, events and failed-start cleanup name their entry by serial,
    so they change nothing of the new one's."""
    store = ResponseStore()
    old = store.put({"id": "x", "status": "queued"}, None, [], streamed=True)
    store.delete("x")
    new = store.put({"id": "x", "status": "queued"}, None, [], streamed=True)
    assert new != old
    assert not store.settle({"id": "x", "status": "failed"}, old)
    assert not store.append_events("x", old, 0, ["stale"], True)
    assert store.delete("x", old) is None
    assert store.get("x") == {"id": "x", "status": "queued"}
    assert store.settle({"id": "x", "status": "in_progress"}, new) and store.append_events("x", new, 0, ["e"], False)
    # Nor does a follower of the old one go on with the new one's events.
    assert asyncio.run(store.events_after("x", -1, 0, old)) is None
    page = asyncio.run(store.events_after("x", -1, 0))
    assert page.events == ["e"] and page.serial == new


def test_a_replica_stopping_ends_its_background_responses_as_failed():
    """(Serve runs the app's lifespan shutdown when it stops a replica.) A response still generating
    is stored failed, and its engine request aborted, rather than left in progress."""
    import time

    _, engine, serving, store = _stored_app(["never finishes"])
    engine.finish = None  # (its last output does not end it)
    app = create_app(serving, response_store=store)
    with TestClient(app) as http:
        response_id = http.post("/v1/responses", json={"model": "tiny", "input": "hi", "background": True}).json()["id"]
        deadline = time.monotonic() + 10
        while store.store.get(response_id)["status"] != "in_progress":
            assert time.monotonic() < deadline
            time.sleep(0.01)
    stored = store.store.get(response_id)
    assert stored["status"] == "failed" and "shut down" in stored["error"]["message"]
    assert engine.aborted == [engine.requests[0].request_id]
    # One arriving as it stops is refused (none would generate it), and nothing of it is kept.
    late = TestClient(app).post("/v1/responses", json={"model": "tiny", "input": "hi", "background": True})
    assert late.status_code == 503 and len(engine.requests) == 1 and len(store.store) == 1


def test_a_background_response_whose_start_a_shutdown_overtakes_ends_failed(monkeypatch):
    """shut_down begins while a background response is being stored and started (after the check
    that refuses new ones): it ends failed, its engine request dropped, as those shut_down stops."""
    made: list[ResponsesServing] = []
    init = ResponsesServing.__init__

    def keep(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(ResponsesServing, "__init__", keep)
    _, engine, serving, store = _stored_app(["never finishes"])
    engine.finish = None
    app = create_app(serving, response_store=store)
    responses = made[-1]  # (this app's)
    started = serving.start_chat_as

    async def start_then_shut_down(*args, **kwargs):
        run = await started(*args, **kwargs)
        responses._closing = True  # (as shut_down sets it, before this start is done)
        return run

    serving.start_chat_as = start_then_shut_down
    with TestClient(app) as http:  # (its loop runs on: only this start can end it)
        queued = http.post("/v1/responses", json={"model": "tiny", "input": "hi", "background": True}).json()
        stored = store.store.get(queued["id"])
        assert stored["status"] == "failed" and "shut down" in stored["error"]["message"]
        assert engine.aborted == [engine.requests[0].request_id]


def _raw_events(http, url: str) -> list[dict]:
    """A Responses event stream read whole, each event checked strictly against OpenAI's types."""
    with http.stream("GET", url) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    for event in events:
        TypeAdapter(ResponseStreamEvent).validate_python(event)
    return events


def test_a_streamed_background_response_is_streamed_again_from_any_event():
    """background with stream: the create streams the events as the replica generates them (the
    first says queued), and GET with stream gives the same events again, from any sequence number."""
    _, _, serving, store = _stored_app(["Background answer."])
    with TestClient(create_app(serving, response_store=store)) as http:
        client = _client(http)
        events = list(client.responses.create(model="tiny", input="hi", background=True, stream=True))
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert (events[0].type, events[0].response.status, events[0].response.background) == \
            ("response.created", "queued", True)
        assert [e.type for e in events[1:3]] == ["response.queued", "response.in_progress"]
        assert events[-1].type == "response.completed" and events[-1].response.output_text == "Background answer."
        response_id = events[0].response.id
        assert client.responses.retrieve(response_id).status == "completed"
        dumped = [e.model_dump() for e in events]
        assert [e.model_dump() for e in client.responses.retrieve(response_id, stream=True)] == dumped
        assert [e.model_dump() for e in client.responses.retrieve(response_id, stream=True, starting_after=3)] \
            == dumped[4:]
        assert _raw_events(http, f"/v1/responses/{response_id}?stream=true&starting_after={len(events) + 5}") == []
        raw = _raw_events(http, f"/v1/responses/{response_id}?stream=true")
        assert [(e["type"], e["sequence_number"]) for e in raw] == [(e.type, e.sequence_number) for e in events]
        r = http.get(f"/v1/responses/{response_id}?stream=true&starting_after=-1")
        assert r.status_code == 400 and r.json()["error"]["param"] == "starting_after"
        assert http.get("/v1/responses/resp_nope?stream=true").status_code == 404


def test_a_streamed_background_response_outlives_its_client_and_its_replica_ends_it():
    """The client that asked for it leaving does not stop it (its engine request runs on); a replica
    stopping ends it as failed, with a last response.failed event for whoever follows it."""
    import asyncio

    _, engine, serving, store = _stored_app(["never finishes"])
    engine.finish = None  # (its last output does not end it)
    responses = ResponsesServing(serving, store)

    async def run() -> None:
        request = ResponsesRequest(model="tiny", input="hi", background=True, stream=True)
        stream = await responses.create(request)
        first = await anext(aiter(stream))
        response_id = json.loads(first.split("data: ", 1)[1].split("\n", 1)[0])["response"]["id"]
        await stream.aclose()  # the client left
        while not (await store.events_after(response_id, -1, 0.0)).events[-1].startswith(
                "event: response.output_text.delta"):
            await asyncio.sleep(0.01)
        assert engine.aborted == [] and store.store.get(response_id)["status"] == "in_progress"
        follower = await responses.follow(response_id, 1)
        seen = [await anext(aiter(follower))]
        await responses.shut_down()
        seen += [chunk async for chunk in follower]
        events = [json.loads(line[6:]) for chunk in seen for line in chunk.splitlines() if line.startswith("data: ")]
        assert events[0]["sequence_number"] == 2
        assert [e["sequence_number"] for e in events] == list(range(2, 2 + len(events)))
        assert events[-1]["type"] == "response.failed" and "shut down" in events[-1]["response"]["error"]["message"]
        assert store.store.get(response_id)["status"] == "failed"
        assert engine.aborted == [engine.requests[0].request_id]

    asyncio.run(run())


def test_followers_of_a_background_stream_wait_for_its_events_and_end_with_it():
    import asyncio

    async def run() -> None:
        store = ResponseStore(max_entries=2)
        store.put({"id": "resp_1", "status": "queued", "background": True}, None, [], streamed=True)
        store.put({"id": "resp_2", "status": "queued"}, None, [])
        assert await store.events_after("resp_2", -1, 1.0) == EventsPage([], True, "not_streamed")
        assert await store.events_after("resp_nope", -1, 1.0) is None
        waiting = asyncio.create_task(store.events_after("resp_1", -1, 30.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        assert store.append_events("resp_1", None, 0, ["a", "b"], False)
        assert await waiting == EventsPage(["a", "b"], False)
        assert await store.events_after("resp_1", 0, 30.0) == EventsPage(["b"], False)
        assert await store.events_after("resp_1", 1, 0.01) == EventsPage([], False)  # (none came in time)
        assert not store.append_events("resp_1", None, 3, ["d"], False)  # (a gap: event 2 is missing)
        waiting = asyncio.create_task(store.events_after("resp_1", 1, 30.0))
        await asyncio.sleep(0.05)
        assert store.append_events("resp_1", None, 1, ["b", "c"], True)  # (b again: a resend after a failed call)
        assert await waiting == EventsPage(["c"], True)
        assert await store.events_after("resp_1", 2, 30.0) == EventsPage([], True)  # (ended: no wait)
        assert await store.events_after("resp_1", -1, 0) == EventsPage(["a", "b", "c"], True)
        assert not store.append_events("resp_1", None, 3, ["late"], False)  # (nothing after the end)
        assert not store.append_events("resp_2", None, 0, ["x"], False)  # (no event stream)
        # A follower of a deleted or forgotten response ends at once.
        store.put({"id": "resp_3", "status": "queued"}, None, [], streamed=True)
        waiting = asyncio.create_task(store.events_after("resp_3", -1, 30.0))
        await asyncio.sleep(0.05)
        store.delete("resp_3")
        assert await asyncio.wait_for(waiting, 5) is None and not store.append_events("resp_3", None, 0, ["d"], True)
        store.put({"id": "resp_4", "status": "queued"}, None, [], streamed=True)
        waiting = asyncio.create_task(store.events_after("resp_4", -1, 30.0))
        await asyncio.sleep(0.05)
        store.put({"id": "resp_5", "status": "queued"}, None, [])
        store.put({"id": "resp_6", "status": "queued"}, None, [])  # (resp_4 is the least recently used)
        assert await asyncio.wait_for(waiting, 5) is None

    asyncio.run(run())


def test_only_a_background_response_can_be_cancelled():
    _, _, serving, store = _stored_app(["Fine."])
    with TestClient(create_app(serving, response_store=store)) as http:
        plain = _client(http).responses.create(model="tiny", input="hi")
        assert plain.store and not plain.background
        with pytest.raises(openai.BadRequestError, match="not created with background"):
            _client(http).responses.cancel(plain.id)
        assert store.store.get(plain.id)["status"] == "completed"


def test_a_cancel_ends_a_background_stream_and_old_ended_streams_give_way_to_the_budget(monkeypatch):
    import asyncio

    from router import response_store

    async def run() -> None:
        store = ResponseStore()
        store.put({"id": "resp_1", "status": "queued", "background": True}, None, [], streamed=True)
        assert store.append_events("resp_1", None, 0, ["a"], False)
        waiting = asyncio.create_task(store.events_after("resp_1", 0, 30.0))
        await asyncio.sleep(0.05)
        store.cancel("resp_1")  # its followers end, and the generating replica's next send is refused
        assert await asyncio.wait_for(waiting, 5) == EventsPage([], True)
        assert not store.append_events("resp_1", None, 1, ["b"], False)
        # Beyond the budget, the least recently used ended streams lose their events (not their responses).
        monkeypatch.setattr(response_store, "EVENT_BYTES_BUDGET", 10)
        for i in (2, 3, 4):
            store.put({"id": f"resp_{i}", "status": "queued"}, None, [], streamed=True)
        assert store.append_events("resp_2", None, 0, ["0123"], True)
        assert store.append_events("resp_3", None, 0, ["4567"], True)
        assert store.append_events("resp_4", None, 0, ["89ab"], False)  # (12 bytes: resp_1's one, then resp_2's go)
        assert await store.events_after("resp_1", -1, 0) == EventsPage([], True, "dropped")
        assert await store.events_after("resp_2", -1, 0) == EventsPage([], True, "dropped")
        assert await store.events_after("resp_3", -1, 0) == EventsPage(["4567"], True)
        assert store.get("resp_2") is not None
        store.delete("resp_3")
        assert store._event_bytes == 4

    asyncio.run(run())


def test_a_background_stream_whose_events_were_dropped_is_a_400():
    _, _, serving, store = _stored_app(["Background answer."])
    with TestClient(create_app(serving, response_store=store)) as http:
        events = list(_client(http).responses.create(model="tiny", input="hi", background=True, stream=True))
        response_id = events[0].response.id
        entry = store.store._entries[response_id]
        entry.events, entry.events_dropped = None, True
        r = http.get(f"/v1/responses/{response_id}?stream=true")
        assert r.status_code == 400 and "no longer kept" in r.json()["error"]["message"]


def test_a_cancel_stops_a_streamed_background_generation_even_when_the_engines_were_not_told():
    """(This scripted engine cannot be reached by the cancel's abort.) The store refuses the
    generating replica's next events, so it stops and drops the engine request itself; followers
    end with no terminal event."""
    import asyncio

    _, engine, serving, store = _stored_app(["never finishes"])
    engine.finish = None
    responses = ResponsesServing(serving, store)

    async def run() -> None:
        stream = await responses.create(ResponsesRequest(model="tiny", input="hi", background=True, stream=True))
        first = await anext(aiter(stream))
        response_id = json.loads(first.split("data: ", 1)[1].split("\n", 1)[0])["response"]["id"]
        follower = await responses.follow(response_id, None)
        await responses.cancel(response_id)
        followed = [chunk async for chunk in follower]
        types = [json.loads(line[6:])["type"] for chunk in followed for line in chunk.splitlines()
                 if line.startswith("data: ")]
        assert types[0] == "response.created"
        assert not {"response.completed", "response.incomplete", "response.failed"} & set(types)
        deadline = asyncio.get_running_loop().time() + 10
        while engine.aborted != [engine.requests[0].request_id]:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        await stream.aclose()
        assert store.store.get(response_id)["status"] == "cancelled"

    asyncio.run(run())


def test_an_unexpected_failure_ends_a_streamed_background_response_as_failed(monkeypatch):
    import asyncio

    _, _, serving, store = _stored_app(["Background answer."])
    responses = ResponsesServing(serving, store)

    def broken(*_):
        raise RuntimeError("the final response could not be built")

    monkeypatch.setattr(responses, "_final", broken)

    async def run() -> None:
        stream = await responses.create(ResponsesRequest(model="tiny", input="hi", background=True, stream=True))
        chunks = [chunk async for chunk in stream]
        events = [json.loads(line[6:]) for chunk in chunks for line in chunk.splitlines() if line.startswith("data: ")]
        assert events[-1]["type"] == "response.failed" and "could not be built" in \
            events[-1]["response"]["error"]["message"]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert store.store.get(events[0]["response"]["id"])["status"] == "failed"

    asyncio.run(run())


def _token_logprob(token: int) -> float:
    return -token / 1000  # (distinct per token: a row given to the wrong token shows)


def _logprob_tokens(serving, logprobs) -> list[int]:
    """The token each logprob entry belongs to, told by its value."""
    return [round(-lp["logprob"] * 1000) for lp in logprobs]


def _included(http, body: dict) -> tuple[dict, list[dict]]:
    whole = Response.model_validate(http.post("/v1/responses", json=body).json()).model_dump()
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        events = [TypeAdapter(ResponseStreamEvent).validate_python(json.loads(line[6:])).model_dump()
                  for line in r.iter_lines() if line.startswith("data: ")]
    return whole, events


LOGPROBS_BODY = {"model": "tiny", "input": "Capital of France?", "include": ["message.output_text.logprobs"],
                 "top_logprobs": 2}


@pytest.mark.parametrize("spaced", [True, False])
def test_output_text_logprobs_when_included_whole_and_streamed(spaced):
    """OpenAI's include ["message.output_text.logprobs"] with top_logprobs: the message's text parts
    carry a logprob per token of their text (not of the reasoning before it, nor of the EOS that
    ended it), whole, in each streamed delta and in the done events, also when the engine's outputs
    come merged (spaced False: one event brings the thinking and the text)."""
    http, engine, serving = _app("<think>Short question.</think>Paris.", reasoning="deepseek_r1", think_tokens=True,
                                 spaced=spaced)
    engine.logprob_of = _token_logprob
    whole, events = _included(http, LOGPROBS_BODY)
    assert (engine.requests[-1].sampling_params.logprobs, whole["top_logprobs"]) == (2, 2)
    logprobs = whole["output"][-1]["content"][0]["logprobs"]
    content_tokens = serving.tokenizer.encode("Paris.", add_special_tokens=False)
    assert _logprob_tokens(serving, logprobs) == content_tokens
    assert [lp["token"] for lp in logprobs] == [serving.tokenizer.decode([t]) for t in content_tokens]
    assert all(len(lp["top_logprobs"]) == 2 for lp in logprobs)
    streamed = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    assert streamed == logprobs
    [done] = [e for e in events if e["type"] == "response.output_text.done"]
    [part_done] = [e for e in events if e["type"] == "response.content_part.done" and e["part"]["type"] ==
                   "output_text"]
    assert done["logprobs"] == part_done["part"]["logprobs"] == logprobs
    assert events[-1]["response"]["output"][-1]["content"][0]["logprobs"] == logprobs


@pytest.mark.parametrize("spaced", [True, False])
def test_output_text_logprobs_without_a_parser_are_every_text_token_and_before_calls_the_first(spaced):
    http, engine, serving = _app("Paris is the capital.", spaced=spaced)
    engine.logprob_of = _token_logprob
    whole, _ = _included(http, LOGPROBS_BODY)
    text_tokens = serving.tokenizer.encode("Paris is the capital.", add_special_tokens=False)
    assert _logprob_tokens(serving, whole["output"][-1]["content"][0]["logprobs"]) == text_tokens  # (no EOS)
    http, engine, serving = _app(HERMES_ANSWER, parser="hermes", spaced=spaced)
    engine.logprob_of = _token_logprob
    whole, _ = _included(http, {**LOGPROBS_BODY, "tools": [WEATHER_TOOL]})
    message = next(item for item in whole["output"] if item["type"] == "message")
    tokens = _logprob_tokens(serving, message["content"][0]["logprobs"])
    text_tokens = serving.tokenizer.encode("Let me look.", add_special_tokens=False)
    if spaced:  # (a blank held back while a tag might follow brings no text of its own: its logprob is dropped)
        remaining = iter(text_tokens)
        assert all(t in remaining for t in tokens) and len(tokens) == len(text_tokens) - 1
    else:  # (one event brings the text and the call: the text's tokens are the first ones)
        assert tokens == text_tokens


def test_logprobs_only_when_included_and_include_values_are_openais():
    http, engine, _ = _app("Paris.")
    plain = http.post("/v1/responses", json={**LOGPROBS_BODY, "include": None}).json()
    assert engine.requests[-1].sampling_params.logprobs is None
    assert plain["output"][-1]["content"][0]["logprobs"] == [] and plain["top_logprobs"] == 2
    assert http.post("/v1/responses", json={"model": "tiny", "input": "x"}).json()["top_logprobs"] == 0
    # OpenAI's other values are accepted (clients send them by default); an unknown one is a 400.
    assert http.post("/v1/responses", json={**LOGPROBS_BODY, "include": ["reasoning.encrypted_content"]}
                     ).status_code == 200
    for bad in ({"include": ["message.output_text.logprob"]}, {"top_logprobs": 21}):
        r = http.post("/v1/responses", json={**LOGPROBS_BODY, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(bad)), r.text


THINKING_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}:{% if m.reasoning_content %}<think>"
                     "{{ m.reasoning_content }}</think>{% endif %}{{ m['content'] or '' }}"
                     "{% if m.tool_calls %} CALL {{ m.tool_calls[0].function.name }}{% endif %}{% endfor %}"
                     "{% if add_generation_prompt %}assistant:{% endif %}")


def test_an_earlier_answers_reasoning_item_reaches_the_template_with_its_turn():
    """As chat takes an earlier answer's reasoning back (and vLLM's Responses), a reasoning item's
    text is its assistant turn's reasoning, joined by the message or calls that follow it."""
    http, engine, serving = _app("ok")
    serving.tokenizer.chat_template = THINKING_TEMPLATE
    items = [{"role": "user", "content": "q"},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "I should call it"}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
             {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "It is sunny"}]},
             {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "thanks"}]
    _client(http).responses.create(model="tiny", input=items)
    assert _prompt(serving, engine) == ("user:qassistant:<think>I should call it</think> CALL get_weathertool:sunny"
                                        "assistant:<think>It is sunny</think>Sunny.user:thanksassistant:")


def test_an_unfinished_final_assistant_message_is_continued():
    http, engine, serving = _app(" Rome.")
    items = [{"role": "user", "content": "Capital of Italy?"},
             {"type": "message", "role": "assistant", "status": "incomplete",
              "content": [{"type": "output_text", "text": "It is"}]}]
    response = http.post("/v1/responses", json={"model": "tiny", "input": items}).json()
    assert _prompt(serving, engine) == "user: Capital of Italy?assistant: It is"  # (no new turn opened)
    assert response["output"][0]["content"][0]["text"] == " Rome."
    assert isinstance(response["completed_at"], int)  # (whole seconds, as created_at and OpenAI's)
    refused = http.post("/v1/responses", json={"model": "tiny", "input": items,
                                               "text": {"format": {"type": "json_object"}}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "text"
    missing = http.post("/v1/responses", json={"model": "tiny", "input": [
        {"type": "function_call_output", "call_id": "c1", "output": 5}]})
    assert missing.status_code == 400 and "input[0].output" in missing.json()["error"]["message"]
