"""The tool-call parsers beside hermes (llama3_json, mistral, pythonic, qwen3_coder): each reads back exactly the
calls its chat template writes, finds calls in model-like outputs, leaves other text as content, and streams the
same content and calls as the whole output gives, however the text arrives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import pagedllm
from pagedllm.entrypoints.cli import TOOL_CALL_PARSERS
from pagedllm.models.loader import load_tokenizer
from pagedllm.server.tool_parsers import TOOL_PARSERS, get_tool_parser

TEMPLATES = Path(pagedllm.__file__).parent / "server" / "chat_templates"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET", "hours": 24, "exact": True})]

OUTPUTS = {  # parser: (output, content, calls)
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
               "Let me check.", CALLS[:1]),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", '
                    '"parameters": {"zone": "CET", "hours": 24, "exact": true}}', None, CALLS),
    "mistral": ('Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "Sure.", CALLS[:1]),
    "pythonic": ('[get_weather(city="Paris"), get_time(zone="CET", hours=24, exact=True)]', None, CALLS),
    "qwen3_coder": ("I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "</function>\n</tool_call>", "I will look.", CALLS[:1]),
}
NOT_CALLS = {"llama3_json": "{not json at all", "mistral": "[TOOL_CALLS] nothing", "pythonic": "[1] is a footnote",
             "hermes": "<tool_call>oops</tool_call>", "qwen3_coder": "<tool_call>no function</tool_call>"}


def named(calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def test_cli_offers_every_parser():
    assert sorted(TOOL_CALL_PARSERS) == sorted(TOOL_PARSERS)


@pytest.mark.parametrize("name", ["llama3_json", "mistral", "pythonic", "qwen3_coder", "hermes"])
def test_template_renders_tools_and_parser_reads_back_its_calls(name):
    tok = load_tokenizer()
    template = (TEMPLATES / f"{name}_tools.jinja").read_text()
    history = [{"role": "user", "content": "Weather and time in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}}
                   for i, (n, a) in enumerate(CALLS)]},
               {"role": "tool", "tool_call_id": "c0", "content": "21 C"}]
    text = tok.apply_chat_template(history, tools=[WEATHER], chat_template=template, tokenize=False,
                                   add_generation_prompt=True)
    assert "get_weather" in text.split("<|im_end|>")[0] and "Current weather of a city" in text
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, calls = get_tool_parser(name).extract(turn)
    assert named(calls) == CALLS and content is None
    assert text.endswith("<|im_start|>assistant\n") and "21 C" in text


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_extract(name):
    output, content, calls = OUTPUTS[name]
    got_content, got_calls = get_tool_parser(name).extract(output)
    assert got_content == content and named(got_calls) == calls
    assert get_tool_parser(name).extract(NOT_CALLS[name]) == (NOT_CALLS[name], [])
    assert get_tool_parser(name).extract("Just words.") == ("Just words.", [])


@pytest.mark.parametrize("name", sorted(OUTPUTS))
@pytest.mark.parametrize("step", [1, 3, 7])
@pytest.mark.parametrize("which", ["calls", "not calls", "words"])
def test_streaming_equals_the_whole(name, step, which):
    text = {"calls": OUTPUTS[name][0], "not calls": NOT_CALLS[name], "words": "Just words."}[which]
    want_content, want_calls = get_tool_parser(name).extract(text)
    streamer = get_tool_parser(name).stream()
    content, calls = "", []
    for end in [*range(step, len(text), step), len(text)]:
        c, deltas = streamer.advance(text[:end], end == len(text))
        content += c
        calls += [(d.function.name, json.loads(d.function.arguments)) for d in deltas]
    assert calls == named(want_calls)
    assert content.strip() == (want_content or "").strip() if want_calls else content == text
