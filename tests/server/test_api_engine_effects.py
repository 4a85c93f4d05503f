"""What the new request fields do to the generated tokens, through the official client.

The server maps every field to ``SamplingParams`` (tested in test_api_surface.py / test_tool_calls.py);
their effect is the engine's: the grammar bitmask filled by the core and applied before the worker's
batched sampler (StructuredOutputManager), logit_bias (apply_logit_bias), best_of,
include_stop_str_in_output and prompt logprobs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest
import torch
from tests.server.conftest import live_server

import pagedllm

pytestmark = [pytest.mark.slow]

TEMPLATE = Path(pagedllm.__file__).parent / "server" / "chat_templates" / "hermes_tools.jinja"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Berlin?"}]
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number", "minimum": 0,
                                                                            "maximum": 1}},
     "required": ["ok", "score"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def srv():
    with live_server(chat_template=TEMPLATE.read_text(), tool_call_parser="hermes") as s:
        yield s


@pytest.fixture(scope="module")
def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=srv.api_key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(srv) -> str:
    return srv.engine.model_name


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_response_format_validates(client, model, schema):
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=60,
        temperature=0.8, seed=1, response_format={"type": "json_schema", "json_schema": {
            "name": "out", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_json_object(client, model):
    ask = 'Write Alice, aged 30, as a JSON object with the keys "name" and "age".'
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": ask}],
                                       max_tokens=60, temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"  # the grammar closed the object; no length cut
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("extra, check", [
    ({"guided_regex": r"[A-Z][a-z]+ [0-9]{3}"}, lambda t: re.fullmatch(r"[A-Z][a-z]+ [0-9]{3}", t)),
    ({"guided_choice": ["alpha", "beta", "gamma"]}, lambda t: t in ("alpha", "beta", "gamma")),
    ({"guided_grammar": 'root ::= "(" [1-9] ("+" [1-9])* ")"'}, lambda t: re.fullmatch(r"\([1-9](\+[1-9])*\)", t)),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
])
def test_regex_choice_grammar(client, model, extra, check):
    r = client.completions.create(model=model, prompt="The answer:", max_tokens=40, temperature=1.0, seed=3, n=3,
                                  extra_body=extra)
    for c in r.choices:
        assert check(c.text), c.text


def collect_stream(stream) -> tuple[str, list[dict], str]:
    content, calls, reason = "", {}, None
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"name": "", "arguments": ""})
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
            reason = ch.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("stream", [False, True])
def test_named_and_required_tool_choice(client, model, stream):
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, names in ((named, {"get_time"}), ("required", {"get_weather", "get_time"})):
        kw = dict(model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=150, temperature=0)
        if stream:
            _, calls, reason = collect_stream(client.chat.completions.create(stream=True, **kw))
        else:
            msg = client.chat.completions.create(**kw).choices[0]
            calls, reason = [{"name": c.function.name, "arguments": c.function.arguments}
                             for c in msg.message.tool_calls], msg.finish_reason
        assert calls and {c["name"] for c in calls} <= names and reason == "tool_calls"
        for c in calls:
            schema = (WEATHER if c["name"] == "get_weather" else TIME)["function"]["parameters"]
            jsonschema.validate(json.loads(c["arguments"]), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_calls_are_parsed(client, model, stream):
    """A grammar makes the model answer in the Hermes format; the parser turns it into tool_calls."""
    regex = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}\n</tool_call>'
    kw = dict(model=model, messages=ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
              extra_body={"guided_regex": regex})
    if stream:
        content, calls, reason = collect_stream(client.chat.completions.create(stream=True, **kw))
    else:
        c = client.chat.completions.create(**kw).choices[0]
        content, reason = c.message.content or "", c.finish_reason
        calls = [{"name": t.function.name, "arguments": t.function.arguments} for t in c.message.tool_calls]
    assert content == "" and reason == "tool_calls"
    assert len(calls) == 1 and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"])["city"] in ("Paris", "Rome")


def test_logit_bias(client, model, srv):
    (tok,) = srv.engine.tokenizer.encode(" banana")
    r = client.completions.create(model=model, prompt="I like", max_tokens=4, temperature=1.0, seed=0,
                                  logit_bias={str(tok): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == " banana" * 4
    greedy = client.completions.create(model=model, prompt="The capital of France is", max_tokens=1, temperature=0,
                                       logprobs=0)
    first = srv.engine.tokenizer.encode(greedy.choices[0].text)[0]
    banned = client.completions.create(model=model, prompt="The capital of France is", max_tokens=1, temperature=0,
                                       logit_bias={str(first): -100})
    assert banned.choices[0].text != greedy.choices[0].text


def test_best_of_returns_the_most_likely_sample(client, model):
    kw = dict(model=model, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=5, logprobs=0)
    four = client.completions.create(n=4, **kw)
    best = client.completions.create(n=1, extra_body={"best_of": 4}, **kw)
    score = {c.text: sum(c.logprobs.token_logprobs) for c in four.choices}
    assert best.choices[0].text == max(score, key=score.get)


def test_include_stop_str_in_output(client, model):
    kw = dict(model=model, prompt="1, 2, 3, 4,", max_tokens=10, temperature=0, stop=[","])
    without = client.completions.create(**kw).choices[0].text
    with_stop = client.completions.create(extra_body={"include_stop_str_in_output": True}, **kw).choices[0].text
    assert with_stop == without + ","


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_match_hf(client, model, srv, smollm2_dir, max_tokens):
    from transformers import AutoModelForCausalLM

    prompt = "The quick brown fox jumps over the lazy dog"
    ids = srv.engine.tokenizer.encode(prompt)
    r = client.completions.create(model=model, prompt=ids, max_tokens=max_tokens, echo=True, logprobs=2,
                                  temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + max_tokens and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(t, dict) and 1 <= len(t) <= 3 for t in lp.top_logprobs[1:])
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(want, abs=2e-3)
