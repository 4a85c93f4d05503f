"""vLLM's request fields, honoured as vLLM honours them, and OpenAI's inert fields accepted and named: through
the official client and raw HTTP against a real server on the embedded model (greedy fp32)."""

from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest

from pagedllm.server.chat_tools import render_chat
from pagedllm.server.inert_fields import IGNORED_FIELDS_HEADER

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Name three colors."}]
GREEDY = {"temperature": 0, "max_tokens": 4}


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json=body, headers={"Authorization": f"Bearer {srv.api_key}"}, timeout=120)


def sse(srv, path: str, body: dict) -> list[dict]:
    """Every data event of a streamed response but [DONE]."""
    with httpx.stream("POST", f"{srv.url}{path}", json={**body, "stream": True}, timeout=120,
                      headers={"Authorization": f"Bearer {srv.api_key}"}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


def prompt_ids_of(entries: list[dict | None], first: int) -> list[int]:
    """The prompt's token ids, read back from vLLM's prompt_logprobs (each entry's first key is the prompt's
    own token; the first position has no entry)."""
    return [first] + [int(next(iter(e))) for e in entries[1:]]


# ------------------------------------------------------------------ OpenAI's inert fields
INERT = {"store": True, "metadata": {"team": "a"}, "service_tier": "auto", "user": "u1", "safety_identifier": "s",
         "prompt_cache_key": "k", "modalities": ["text"], "reasoning_effort": "low"}


def test_inert_fields_are_accepted_named_in_a_header_and_logged_once(client, model, caplog):
    caplog.set_level(logging.INFO, logger="pagedllm.server")
    plain = client.chat.completions.create(model=model, messages=ASK, **GREEDY)
    raw = client.chat.completions.with_raw_response.create(model=model, messages=ASK, **GREEDY, **INERT)
    assert raw.headers[IGNORED_FIELDS_HEADER] == ", ".join(INERT)
    assert raw.parse().choices[0].message.content == plain.choices[0].message.content
    client.completions.create(model=model, prompt="Hi", **GREEDY, user="u2", extra_body={"store": False})
    for name in INERT:
        assert sum(f"request field {name!r} is accepted and ignored" in r.message for r in caplog.records) == 1
    assert IGNORED_FIELDS_HEADER not in client.chat.completions.with_raw_response.create(
        model=model, messages=ASK, **GREEDY).headers


@pytest.mark.parametrize("body, param", [
    ({"modalities": ["text", "audio"]}, "modalities"),  # audio would change the output
    ({"service_tier": 3}, "service_tier"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"web_search_options": {}}, "web_search_options"),  # would change the output: unsupported, named
    ({"priority": 1}, "priority"),  # the server runs fcfs
    ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
    ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),  # user is last
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"documents": [{"title": "a", "text": "b"}]}, "documents"),  # the model's template does not render them
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_fields_that_cannot_be_honoured_are_400(server, body, param):
    r = post(server, "/v1/chat/completions", {"messages": ASK, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-9", messages=ASK, max_tokens=1)


# ------------------------------------------------------------------ vLLM's fields
def test_prompt_logprobs_match_the_echoed_prompt_scores(server, client, model):
    prompt = "The capital of France is"
    echoed = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    r = post(server, "/v1/completions", {"prompt": prompt, "prompt_logprobs": 2, **GREEDY}).json()
    entries = r["choices"][0]["prompt_logprobs"]
    ids = server.engine.tokenizer.encode(prompt)
    assert entries[0] is None and prompt_ids_of(entries, ids[0]) == ids
    for tid, entry, want in zip(ids[1:], entries[1:], echoed.choices[0].logprobs.token_logprobs[1:]):
        own = entry[str(tid)]
        assert own["logprob"] == pytest.approx(want, abs=1e-5)
        assert own["decoded_token"] == server.engine.tokenizer.decode([tid])
        ranked = sorted((e for e in entry.values() if e["rank"] is not None), key=lambda e: e["rank"])
        assert [e["rank"] for e in ranked] == [1, 2] and ranked[0]["logprob"] >= ranked[1]["logprob"]


def test_chat_template_controls_shape_the_prompt(server):
    tok = server.engine.tokenizer
    reply = [*ASK, {"role": "assistant", "content": "Red, green"}]
    cases = [({"messages": ASK, "add_generation_prompt": False}, dict(conversation=ASK, add_generation_prompt=False)),
             ({"messages": reply, "add_generation_prompt": False, "continue_final_message": True},
              dict(conversation=reply, continue_final_message=True)),
             ({"messages": ASK}, dict(conversation=ASK, add_generation_prompt=True))]
    for body, render in cases:
        r = post(server, "/v1/chat/completions", {**body, "prompt_logprobs": 0, **GREEDY}).json()
        want = tok.encode(tok.apply_chat_template(tokenize=False, **render), add_special_tokens=False)
        assert prompt_ids_of(r["prompt_logprobs"], want[0]) == want
        assert r["usage"]["prompt_tokens"] == len(want)
    assert tok.decode(want).endswith("<|im_start|>assistant\n")


def test_render_chat_passes_template_kwargs_and_special_tokens(server):
    """chat_template_kwargs reach the template; add_special_tokens tokenizes the rendered text with them."""
    tok = server.engine.tokenizer
    template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}{% for d in documents %}" \
               "[{{ d['text'] }}]{% endfor %}"
    ids = render_chat(tok, ASK, None, template, {"greeting": "Hello! ", "documents": [{"text": "doc"}]})
    assert tok.decode(ids) == "Hello! Name three colors.[doc]"

    class WithBos:  # the embedded tokenizer adds nothing: a stand-in that prepends a BOS when asked
        def __getattr__(self, name):
            return getattr(tok, name)

        def encode(self, text, add_special_tokens):
            return [tok.bos_token_id] * add_special_tokens + tok.encode(text, add_special_tokens=False)

    assert render_chat(WithBos(), ASK, None, None, add_special_tokens=True) == [tok.bos_token_id] + render_chat(
        tok, ASK, None, None)


def test_return_tokens_as_token_ids(server):
    r = post(server, "/v1/chat/completions", {"messages": ASK, "logprobs": True, "top_logprobs": 2,
                                               "return_tokens_as_token_ids": True, **GREEDY}).json()
    content = r["choices"][0]["logprobs"]["content"]
    ids = [int(c["token"].removeprefix("token_id:")) for c in content]
    assert server.engine.tokenizer.decode(ids) == r["choices"][0]["message"]["content"]
    assert all(t["token"].startswith("token_id:") for c in content for t in c["top_logprobs"])
    r = post(server, "/v1/completions", {"prompt": "Hi", "logprobs": 1, "return_tokens_as_token_ids": True,
                                         **GREEDY}).json()
    assert all(t.startswith("token_id:") for t in r["choices"][0]["logprobs"]["tokens"])


def test_request_id_names_the_response(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, extra_body={"request_id": "abc"}, **GREEDY)
    assert r.id == "chatcmpl-abc"


def test_continuous_usage_stats_and_the_role_chunk_comes_with_the_first_token(server):
    body = {"messages": ASK, **GREEDY, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = sse(server, "/v1/chat/completions", body)
    role, *rest, last = chunks
    assert role["choices"][0]["delta"]["role"] == "assistant"
    # the role chunk carries the usage of its moment: the first token already exists (TTFT is true)
    assert role["usage"]["completion_tokens"] >= 1
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and last["choices"] == [] and last["usage"]["completion_tokens"] == 4
    assert all(c["usage"]["prompt_tokens"] == last["usage"]["prompt_tokens"] for c in chunks)
    cmpl = sse(server, "/v1/completions", {"prompt": "Hi", **GREEDY, "ignore_eos": True,
                                           "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert all(c["usage"] is not None for c in cmpl) and cmpl[-1]["usage"]["completion_tokens"] == 4
    plain = sse(server, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in plain[:-1])


def test_completions_add_special_tokens_false_keeps_the_text_as_is(server):
    r = post(server, "/v1/completions", {"prompt": "Hello there", "prompt_logprobs": 0, "add_special_tokens": False,
                                         **GREEDY}).json()
    want = server.engine.tokenizer.encode("Hello there", add_special_tokens=False)
    assert prompt_ids_of(r["choices"][0]["prompt_logprobs"], want[0]) == want
