"""Tool-call parsing (whole and streamed), the tool_choice grammars, and the structured-output
request fields, without a server."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedllm.server.chat_tools import ToolPlan
from pagedllm.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.server.request_extras import check_unknown_fields
from pagedllm.server.tool_calls import NamedToolChoice, Tool, forced_tool_calls
from pagedllm.server.tool_parsers import HermesToolParser

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
OUTPUT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kw})


def test_hermes_extracts_calls_and_content():
    content, calls = HermesToolParser().extract(OUTPUT)
    assert content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("text", ["no calls here", "<tool_call>\n{not json}\n</tool_call>",
                                  '<tool_call>{"arguments": {}}</tool_call>', "<tool_call>{\"name\": \"x\""])
def test_hermes_leaves_non_calls_as_content(text):
    assert HermesToolParser().extract(text) == (text, [])


@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_deltas_add_up_to_the_whole(step):
    """Fed growing prefixes, the streamer sends the content once and each call once, when it closes."""
    streamer = HermesToolParser().stream()
    content, calls = "", []
    for end in list(range(step, len(OUTPUT), step)) + [len(OUTPUT)]:
        text, deltas = streamer.advance(OUTPUT[:end], end == len(OUTPUT))
        assert "<" not in text, "a tag prefix leaked into content"
        content += text
        calls += deltas
    assert content.strip() == "Let me check."
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in calls] == [
        (0, "get_weather", {"city": "Paris"}), (1, "get_time", {"tz": "CET"})]


def test_plain_text_streams_whole_at_the_end():
    streamer = HermesToolParser().stream()
    assert streamer.advance("Hello <tool", False) == ("Hello ", [])
    assert streamer.advance("Hello <toolbox", True) == ("<toolbox", [])


def test_named_choice_grammar_is_the_functions_parameters():
    plan = ToolPlan.from_request(chat(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                                          "function": {"name": "get_time"}}), None)
    assert plan.structured.json == TIME["function"]["parameters"]
    content, calls = plan.parse('{"tz": "UTC"}')
    assert content is None and calls[0].function.name == "get_time"


def test_required_choice_grammar_accepts_exactly_listed_calls():
    plan = ToolPlan.from_request(chat(tools=[WEATHER, TIME], tool_choice="required"), None)
    schema = plan.structured.json
    good = [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {"tz": "X"}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "rm_rf", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    calls = forced_tool_calls(json.dumps(good), "required")
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]


@pytest.mark.parametrize("kw, parser, match", [
    ({"tool_choice": "required"}, None, "tool_choice 'required' needs tools"),
    ({"tools": [WEATHER]}, None, "--tool-call-parser"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None, "nope"),
])
def test_impossible_tool_requests(kw, parser, match):
    with pytest.raises(ValueError, match=match):
        ToolPlan.from_request(chat(**kw), parser)


def test_tool_choice_none_offers_no_tools():
    plan = ToolPlan.from_request(chat(tools=[WEATHER], tool_choice="none"), None)
    assert plan.tools is None and plan.structured is None


@pytest.mark.parametrize("body, kind, spec", [
    ({"response_format": {"type": "json_object"}}, "json_object", ""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"},
                                                                 "strict": True}}}, "json", '{"type":"integer"}'),
    ({"guided_json": {"type": "integer"}}, "json", '{"type":"integer"}'),
    ({"guided_regex": "[ab]+"}, "regex", "[ab]+"),
    ({"guided_choice": ["x", "y"]}, "choice", '["x", "y"]'),
    ({"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
    ({"structured_outputs": {"regex": "z"}}, "regex", "z"),
    ({"structured_outputs": {"json": {"type": "integer"}}}, "json", '{"type":"integer"}'),
])
def test_structured_fields_map_to_params(body, kind, spec):
    params = CompletionRequest.model_validate({"prompt": "x", **body}).structured_params()
    assert params.key() == (kind, spec)


def test_two_structured_constraints_conflict():
    req = CompletionRequest.model_validate({"prompt": "x", "guided_regex": "a", "response_format": {
        "type": "json_object"}})
    with pytest.raises(ValueError, match="response_format conflicts with guided_regex"):
        req.structured_params()


def test_text_response_format_and_no_fields_mean_no_constraint():
    assert CompletionRequest.model_validate({"prompt": "x", "response_format": {"type": "text"}}).structured_params() \
        is None


def test_logit_bias_keys_are_token_ids():
    req = CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"5": -100, "7": 2.5}})
    assert req.extra_sampling_kwargs(10)["logit_bias"] == {5: -100, 7: 2.5}
    for key in ("10", "abc", "-1"):
        with pytest.raises(ValueError, match="logit_bias"):
            CompletionRequest.model_validate({"prompt": "x", "logit_bias": {key: 1}}).extra_sampling_kwargs(10)


def test_unknown_fields_are_named_at_every_depth(caplog):
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x", "colour": 1}],
                                                "temprature": 1, "tools": [{**WEATHER, "extra": 1}]})
    with pytest.raises(ValueError) as e:
        check_unknown_fields(req, allow=False)
    assert str(e.value) == "unknown or unsupported fields: temprature, messages[0].colour, tools[0].extra"
    check_unknown_fields(req, allow=True)
    assert "temprature" in caplog.text


def test_tool_choice_parses_named_object():
    assert isinstance(chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "g"}}).tool_choice,
                      NamedToolChoice)
    assert isinstance(chat(tools=[WEATHER]).tools[0], Tool)


def test_forced_output_that_is_not_json_stays_content():
    plan = ToolPlan.from_request(chat(tools=[WEATHER], tool_choice="required"), None)
    assert plan.parse("not json") == ("not json", [])
