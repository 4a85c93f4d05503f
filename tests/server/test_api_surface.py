"""The rest of the API a vLLM user expects, through the official client: utility endpoints, vLLM's
metric names, the periodic stats line, tools in the chat template, the sampling extras the server
itself handles, and the 400s for what cannot be served."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import httpx
import openai
import pytest
from tests.server.conftest import live_server
from prometheus_client.parser import text_string_to_metric_families

import pagedllm
from pagedllm.server.stats_logger import stats_line

pytestmark = pytest.mark.slow

TEMPLATE = Path(pagedllm.__file__).parent / "server" / "chat_templates" / "hermes_tools.jinja"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_server():
    """Hermes tools template and parser, unknown fields only warned about, a stats line every 0.3 s."""
    with live_server(chat_template=TEMPLATE.read_text(), tool_call_parser="hermes", allow_unknown_fields=True,
                     stats_interval_s=0.3) as srv:
        yield srv


def client_of(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=srv.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(tool_server) -> openai.OpenAI:
    return client_of(tool_server)


@pytest.fixture(scope="module")
def model(tool_server) -> str:
    return tool_server.engine.model_name


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json=body, headers={"Authorization": f"Bearer {srv.api_key}"}, timeout=60)


# ------------------------------------------------------------------ utility endpoints
def test_tokenize_detokenize_version_ping(tool_server):
    tok = tool_server.engine.tokenizer
    r = post(tool_server, "/tokenize", {"prompt": "Hello world"}).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 1024
    chat = post(tool_server, "/tokenize", {"messages": ASK}).json()
    assert tok.decode(chat["tokens"]).endswith("What is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    assert post(tool_server, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": "Hello world"}
    bad = post(tool_server, "/detokenize", {"tokens": [10**7]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert post(tool_server, "/tokenize", {"prompt": "x", "messages": ASK}).status_code == 400
    assert httpx.get(f"{tool_server.url}/version").json() == {"version": pagedllm.__version__}
    assert httpx.get(f"{tool_server.url}/ping").json() == {"status": "ok"}


def test_retrieve_model(client, model):
    card = client.models.retrieve(model)
    assert card.id == model and card.model_extra["max_model_len"] == 1024
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.models.retrieve("gpt-9")


# ------------------------------------------------------------------ metrics and stats
def samples(srv) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{srv.url}/metrics", headers={"Authorization": f"Bearer {srv.api_key}"}).text
    return {(s.name, s.labels.get("model_name", "")): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name.startswith("vllm:") and "le" not in s.labels}


def test_vllm_metric_names_with_model_name(tool_server, client, model, caplog):
    caplog.set_level(logging.INFO, logger="pagedllm.stats")
    before = samples(tool_server)
    prompt = "A prompt long enough to fill two KV blocks of sixteen tokens, so the second request hits " * 2
    for _ in range(2):
        client.completions.create(model=model, prompt=prompt, max_tokens=3)
    time.sleep(0.8)  # the stats task logs on its interval
    m = samples(tool_server)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count"):
        assert (name, model) in m, name
    assert 0 <= m["vllm:kv_cache_usage_perc", model] <= 1
    assert m["vllm:e2e_request_latency_seconds_count", model] >= before.get(
        ("vllm:e2e_request_latency_seconds_count", model), 0) + 2
    assert m["vllm:prefix_cache_hits_total", model] > before.get(("vllm:prefix_cache_hits_total", model), 0)
    delta = {k: m[k, model] - before.get((k, model), 0) for k in (
        "vllm:time_to_first_token_seconds_sum", "vllm:request_queue_time_seconds_sum",
        "vllm:request_prefill_time_seconds_sum", "vllm:request_queue_time_seconds_count",
        "vllm:request_prefill_time_seconds_count")}
    assert delta["vllm:request_queue_time_seconds_count"] >= 2 and delta["vllm:request_prefill_time_seconds_count"] >= 2
    # TTFT splits into the wait for a first schedule and the steps until the first token (issue 36)
    assert delta["vllm:request_prefill_time_seconds_sum"] > 0
    assert delta["vllm:request_queue_time_seconds_sum"] + delta["vllm:request_prefill_time_seconds_sum"] == \
        pytest.approx(delta["vllm:time_to_first_token_seconds_sum"], rel=1e-6, abs=1e-6)
    assert any("generation throughput" in r.message and "prefix cache hit rate" in r.message for r in caplog.records)


def test_stats_line_rates():
    from pagedllm.server.stats_logger import _Mark

    now = {"prompt_tokens_computed": 300, "prompt_tokens_cached": 100, "generation_tokens": 50, "query_tokens": 400,
           "hit_tokens": 100, "running": 2, "waiting": 1, "usage": 0.25}
    line = stats_line(now, _Mark(0, 0, 0, 0), 10.0)
    assert line == ("prompt throughput: 40.0 tok/s, generation throughput: 5.0 tok/s, running: 2 reqs, waiting: 1 "
                    "reqs, KV cache usage: 25.0%, prefix cache hit rate: 25.0%")


# ------------------------------------------------------------------ fields the server handles itself
def test_unknown_field_is_a_warning_behind_the_flag(client, model, caplog):
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=2, extra_body={"temprature": 0.1})
    assert r.choices[0].message.content is not None
    assert "unknown or unsupported field: temprature" in caplog.text


def test_tools_and_tool_history_are_rendered_by_the_template(client, model):
    plain = client.chat.completions.create(model=model, messages=ASK, max_tokens=1).usage.prompt_tokens
    offered = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], max_tokens=1)
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"}]
    answered = client.chat.completions.create(model=model, messages=history, tools=[WEATHER], max_tokens=1)
    none = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=1)
    # the signature, then the call and its result, are in the prompt; tool_choice none offers nothing
    assert plain < offered.usage.prompt_tokens < answered.usage.prompt_tokens
    assert none.usage.prompt_tokens == plain


def test_truncate_prompt_tokens_and_echo_without_generation(client, model, tool_server):
    ids = tool_server.engine.tokenizer.encode("one two three four five six seven")
    r = client.completions.create(model=model, prompt=ids, max_tokens=2, extra_body={"truncate_prompt_tokens": 3})
    assert r.usage.prompt_tokens == 3
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=0, echo=True)
    assert r.choices[0].text == "The capital of France is" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 0


@pytest.mark.parametrize("body, param", [
    ({"messages": ASK, "tool_choice": "required"}, "tool_choice"),
    ({"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ({"messages": ASK, "guided_regex": "(unclosed"}, "structured_outputs"),
    ({"messages": ASK, "guided_json": {"type": "no-such-type"}}, "structured_outputs"),
    ({"messages": ASK, "guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
    ({"messages": ASK, "response_format": {"type": "json_schema"}}, "response_format"),
    ({"messages": ASK, "logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"messages": ASK, "logit_bias": {"5": 1000}}, "logit_bias"),
    ({"messages": ASK, "n": 2, "best_of": 1}, "best_of"),
    ({"messages": ASK, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"messages": ASK, "max_tokens": 1020}, "max_tokens"),
])
def test_requests_that_cannot_be_served_are_400(tool_server, body, param):
    r = post(tool_server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_forced_tool_choice_needs_no_flag_auto_needs_the_parser(server):
    """A named or required tool_choice works on the model's own template with no flag (the arguments schema
    holds the output, as in vLLM); "auto" must parse free text, so it needs --tool-call-parser."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        r = post(server, "/v1/chat/completions", {"messages": ASK, "tools": [WEATHER], "tool_choice": choice,
                                                  "temperature": 0, "max_tokens": 40})
        assert r.status_code == 200, r.text
        call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
        assert call["name"] == "get_weather" and isinstance(json.loads(call["arguments"])["city"], str)
    r = post(server, "/v1/chat/completions", {"messages": ASK, "tools": [WEATHER]})
    assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"]
