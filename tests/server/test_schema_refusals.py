"""Issue 34, items 1 and 2 at the HTTP edge: every schema that used to get a 500 (or a 200 and then an
error event, or an unconstrained answer) is a 400 naming what is wrong, in every form that carries a
schema and in the streaming form too, with no traceback in the log; a prompt whose length alone
proves it cannot fit is refused before it is tokenized."""

from __future__ import annotations

import logging

import pytest

from tests.server.conftest import live_server
from tests.server.test_reliability import assert_openai_error, post
from tests.structured.test_schema_limits import BAD_SCHEMAS

CHAT = {"messages": [{"role": "user", "content": "Give me JSON"}], "max_tokens": 8}


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    with live_server(engine_options=dict(model=tiny_model_dir, num_blocks=256, check_integrity=False),
                     stats_interval_s=None) as srv:
        yield srv


def forms(schema) -> list[tuple[str, dict]]:
    """Each way a request carries a JSON schema, non-streaming and streaming."""
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    out = [("/v1/completions", {"prompt": "JSON:", "max_tokens": 8, "structured_outputs": {"json": schema}}),
           ("/v1/chat/completions", {**CHAT, "response_format": rf}),
           ("/v1/chat/completions", {**CHAT, "guided_json": schema})]
    return out + [(path, {**body, "stream": True}) for path, body in out]


@pytest.mark.parametrize("name", [n for n in BAD_SCHEMAS if n != "false"])
def test_bad_schema_is_400_in_every_form_and_logs_no_traceback(live, name, caplog):
    schema, words = BAD_SCHEMAS[name]
    with caplog.at_level(logging.INFO):
        for path, body in forms(schema):
            err = assert_openai_error(post(live, path, body), 400)
            assert words in err["message"] and "structured_outputs.json" in err["message"], (path, body.keys(), err)
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], caplog.text


def test_server_still_serves_structured_requests(live):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = post(live, "/v1/chat/completions", {**CHAT, "max_tokens": 200, "guided_json": schema})
    assert r.status_code == 200, r.text
    r = post(live, "/v1/completions", {"prompt": "x", "max_tokens": 8, "structured_outputs": {"choice": ["yes", "no"]}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no"), r.text


def test_choice_and_regex_over_limits_are_400(live):
    for so, words in (({"choice": [str(i) for i in range(100_000)]}, "values"), ({"regex": "a" * 10_000}, "regex")):
        for stream in (False, True):
            err = assert_openai_error(post(live, "/v1/completions", {"prompt": "x", "max_tokens": 4, "stream": stream,
                                                                     "structured_outputs": so}), 400)
            assert words in err["message"], err


@pytest.mark.parametrize("path,make", [
    ("/v1/completions", lambda text: {"prompt": text, "max_tokens": 4}),
    ("/v1/completions", lambda text: {"prompt": ["ok", text], "max_tokens": 4, "stream": True}),
    ("/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": 4}),
    ("/tokenize", lambda text: {"prompt": text}),
])
def test_a_prompt_too_long_by_its_length_is_refused_untokenized(live, monkeypatch, path, make):
    """7.9 MB of text cannot fit 1,024 tokens: 400 before the tokenizer sees it (it took 16-34 s)."""
    calls = []
    real = type(live.engine.tokenizer).__call__

    def counting(self, *a, **kw):
        calls.append(1)
        return real(self, *a, **kw)

    monkeypatch.setattr(type(live.engine.tokenizer), "__call__", counting)
    monkeypatch.setattr(type(live.engine.tokenizer), "encode", lambda *a, **kw: calls.append(1) or [1])
    text = "lorem ipsum " * (7_900_000 // 12)
    err = assert_openai_error(post(live, path, make(text)), 400)
    assert err["code"] == "context_length_exceeded" and "max_model_len 1024" in err["message"], err
    assert not calls, "the prompt was tokenized before its refusal"
