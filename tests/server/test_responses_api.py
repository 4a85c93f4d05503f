"""``/v1/responses`` through the official openai client: create (plain and streamed, which agree), instructions,
input items with a function call and its output, function tools, json_schema, and the previous_response_id chain
kept in memory (bounded, expiring)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pagedllm.server.responses_api import ResponseStore

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_create_matches_chat_and_stream_matches_create(client, model):
    r = client.responses.create(model=model, input="Name three colors.", instructions="Answer briefly.",
                                temperature=0, max_output_tokens=8)
    chat = client.chat.completions.create(model=model, temperature=0, max_tokens=8, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three colors."}])
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == 8
    events = list(client.responses.create(model=model, input="Name three colors.", instructions="Answer briefly.",
                                          temperature=0, max_output_tokens=8, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output[0].content[0].text == r.output_text


def test_previous_response_id_continues_the_conversation(client, model, server):
    first = client.responses.create(model=model, input="My name is Ada.", temperature=0, max_output_tokens=4)
    second = client.responses.create(model=model, input="What is my name?", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=4)
    chat = client.chat.completions.create(model=model, temperature=0, max_tokens=4, messages=[
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert client.responses.retrieve(second.id).id == second.id
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.create(model=model, input="x", previous_response_id="resp_nope")
    unstored = client.responses.create(model=model, input="x", store=False, max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_forced_function_call_and_its_output_as_input_items(client, model):
    r = client.responses.create(model=model, input="Weather in Paris?", tools=[WEATHER], temperature=0,
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40)
    call = next(o for o in r.output if o.type == "function_call")
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    follow = client.responses.create(model=model, tools=[WEATHER], tool_choice="none", temperature=0,
                                     max_output_tokens=4, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "21 C, sunny"}])
    assert follow.output[0].type == "message" and follow.usage.input_tokens > r.usage.input_tokens


def test_json_schema_text_format(client, model):
    schema = {"type": "object", "properties": {"color": {"type": "string"}}, "required": ["color"]}
    r = client.responses.create(model=model, input="Pick a color.", temperature=0, max_output_tokens=30,
                                text={"format": {"type": "json_schema", "name": "pick", "schema": schema}})
    assert isinstance(json.loads(r.output_text)["color"], str)


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "message", "content": "no role"}]}, "input"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text"),
    ({"input": "x", "background": True}, "background"),
])
def test_bad_requests_are_400(server, body, param):
    r = httpx.post(f"{server.url}/v1/responses", json=body, headers={"Authorization": f"Bearer {server.api_key}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_store_is_bounded_and_expires():
    store = ResponseStore(max_items=2, ttl_s=3600)
    for i in range(3):
        store.put(f"r{i}", [], {"id": f"r{i}"})
    assert store.get("r0") is None and store.get("r2") is not None
    store.ttl_s = -1
    assert store.get("r2") is None
