"""``--reasoning-parser``: ``<think>...</think>`` goes to reasoning_content, whole and streamed (any chunking gives
the same parts), and the server wires it through."""

from __future__ import annotations

import json

import httpx
import pytest
from tests.server.conftest import live_server

from pagedllm.server.reasoning import get_reasoning_parser

CASES = [  # parser, output, (reasoning, content)
    ("deepseek_r1", "Let me see.</think>Paris.", ("Let me see.", "Paris.")),
    ("deepseek_r1", "<think>Hmm</think>\n\nOK", ("Hmm", "\n\nOK")),
    ("deepseek_r1", "still thinking when cut", ("still thinking when cut", "")),
    ("qwen3", "<think>plan</think>answer", ("plan", "answer")),
    ("qwen3", "no thinking here", ("", "no thinking here")),
    ("qwen3", "<think>cut off", ("cut off", "")),
    ("qwen3", "<thinking> is not the tag", ("", "<thinking> is not the tag")),
]


@pytest.mark.parametrize("name, text, parts", CASES)
def test_split(name, text, parts):
    assert get_reasoning_parser(name).split(text) == parts


@pytest.mark.parametrize("name, text, parts", CASES)
@pytest.mark.parametrize("step", [1, 2, 3, 5])
def test_streamed_parts_equal_the_whole(name, text, parts, step):
    streamer = get_reasoning_parser(name).stream()
    got = ["", ""]
    for end in [*range(step, len(text), step), len(text)]:
        r, c = streamer.advance(text[:end], end == len(text))
        got[0] += r
        got[1] += c
    assert tuple(got) == parts


def test_unknown_parser_is_named():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("nope")


@pytest.mark.slow
def test_server_puts_unclosed_reasoning_in_reasoning_content(server):
    """The embedded model never writes </think>: under deepseek_r1 its whole output is reasoning."""
    body = {"messages": [{"role": "user", "content": "Name three colors."}], "temperature": 0, "max_tokens": 6}
    auth = {"Authorization": f"Bearer {server.api_key}"}
    plain = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=auth, timeout=120).json()
    text = plain["choices"][0]["message"]["content"]
    with live_server(reasoning_parser="deepseek_r1") as srv:
        url, auth = f"{srv.url}/v1/chat/completions", {"Authorization": f"Bearer {srv.api_key}"}
        msg = httpx.post(url, json=body, headers=auth, timeout=120).json()["choices"][0]["message"]
        assert msg["reasoning_content"] == text and msg["content"] is None
        hidden = httpx.post(url, json={**body, "include_reasoning": False}, headers=auth, timeout=120).json()
        assert hidden["choices"][0]["message"]["reasoning_content"] is None
        with httpx.stream("POST", url, json={**body, "stream": True}, headers=auth, timeout=120) as r:
            deltas = [json.loads(line[6:])["choices"] for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        streamed = "".join(c[0]["delta"].get("reasoning_content") or "" for c in deltas if c)
        assert streamed == text and not any(c[0]["delta"].get("content") for c in deltas[1:] if c)


BOOL_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
               "additionalProperties": False}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": BOOL_SCHEMA}}


@pytest.mark.slow
def test_structured_output_applies_after_the_reasoning(server):
    """Under deepseek_r1 a json_schema waits for </think>: the embedded model never writes it, so its output
    stays free (the same text as without the schema) and is all reasoning; an assistant prefill that closed
    the reasoning makes the output constrained from its first token, all content, streamed the same."""
    auth = {"Authorization": f"Bearer {server.api_key}"}
    thinking = {"messages": [{"role": "user", "content": "Name three colors."}], "temperature": 0, "max_tokens": 6}
    plain = httpx.post(f"{server.url}/v1/chat/completions", json=thinking, headers=auth, timeout=120).json()
    free_text = plain["choices"][0]["message"]["content"]
    prefilled = {"messages": [{"role": "user", "content": "Is the sky blue? Answer in JSON."},
                              {"role": "assistant", "content": "<think>It is.</think>"}],
                 "continue_final_message": True, "add_generation_prompt": False, "temperature": 0,
                 "max_tokens": 20, "response_format": JSON_FORMAT}
    with live_server(reasoning_parser="deepseek_r1") as srv:
        url, auth = f"{srv.url}/v1/chat/completions", {"Authorization": f"Bearer {srv.api_key}"}
        msg = httpx.post(url, json={**thinking, "response_format": JSON_FORMAT}, headers=auth,
                         timeout=120).json()["choices"][0]["message"]
        assert msg["reasoning_content"] == free_text and msg["content"] is None
        choice = httpx.post(url, json=prefilled, headers=auth, timeout=120).json()["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["message"]["reasoning_content"] is None
        assert isinstance(json.loads(choice["message"]["content"])["ok"], bool)
        with httpx.stream("POST", url, json={**prefilled, "stream": True}, headers=auth, timeout=120) as r:
            deltas = [json.loads(line[6:])["choices"] for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert "".join(c[0]["delta"].get("content") or "" for c in deltas if c) == choice["message"]["content"]
        assert not any(c[0]["delta"].get("reasoning_content") for c in deltas if c)
