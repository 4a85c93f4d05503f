"""The server as a hostile or careless client meets it: every bad input is a 400 naming the field (never
a 500, never internal text), size limits, routes behind the key, a stream that fails ends with an error
event and [DONE], and a client that leaves stops its generation within a second."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from array import array

import httpx
import pytest

from tests.server.conftest import live_server

BIG = 10**12
SURROGATE = "\ud800"


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    with live_server(engine_options={"model": tiny_model_dir, "num_blocks": 512, "check_integrity": False},
                     stats_interval_s=None) as srv:
        yield srv


def post(srv, path: str, body: dict | str, **kw) -> httpx.Response:
    """``body`` as JSON (``json.dumps`` escapes a lone surrogate as \\ud800, as a hostile client would)."""
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {"Authorization": f"Bearer {srv.api_key}", "Content-Type": "application/json", **kw.pop("headers", {})}
    return httpx.post(srv.url + path, content=content, headers=headers, timeout=60, **kw)


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in err["message"] and "Overflow" not in err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


CMPL = {"prompt": "Hello", "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
BAD_FIELDS = [  # (field, value): each out of its documented range
    ("temperature", float("inf")), ("temperature", 1e-300), ("temperature", -1.0), ("temperature", 101.0),
    ("top_p", 0.0), ("top_p", float("nan")), ("min_p", 2.0), ("top_k", 2**63), ("top_k", -2),
    ("repetition_penalty", 1e308), ("repetition_penalty", 0.0), ("presence_penalty", 3.0),
    ("frequency_penalty", float("-inf")), ("seed", 2**63), ("seed", -(2**63) - 1), ("seed", 18 * 10**12 * 10**7),
    ("n", 0), ("n", 10**6), ("max_tokens", BIG), ("max_tokens", -1), ("min_tokens", BIG),
    ("stop_token_ids", [10**9]), ("stop_token_ids", [-1]), ("logit_bias", {"99999999": 1.0}),
    ("logit_bias", {"1": 1e9}), ("best_of", 10**9), ("truncate_prompt_tokens", 0), ("stop", [SURROGATE]),
    ("stop", ""), ("n", True),
]


@pytest.mark.parametrize("field,value", BAD_FIELDS, ids=[f"{f}={v!r}"[:40] for f, v in BAD_FIELDS])
def test_out_of_range_field_is_400_naming_it(live, field, value):
    for path, base in (("/v1/completions", CMPL), ("/v1/chat/completions", CHAT)):
        err = assert_openai_error(post(live, path, {**base, field: value}), 400)
        assert err["param"] == field or field in err["message"], (path, err)


@pytest.mark.parametrize("stream", [False, True])
def test_huge_seed_is_400_not_an_overflow(live, stream):
    r = post(live, "/v1/completions", {**CMPL, "seed": 2 * 10**13 * 10**6, "stream": stream})
    assert_openai_error(r, 400, "seed")
    ok = post(live, "/v1/completions", {**CMPL, "seed": 2**63 - 1, "temperature": 0.7})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {**CMPL, "prompt": "hi " + SURROGATE}, "prompt"),
    ("/v1/completions", {**CMPL, "prompt": ["ok", SURROGATE]}, "prompt"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": SURROGATE}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "stop": ["a", SURROGATE]}, "stop"),
    ("/v1/completions", {**CMPL, SURROGATE: 1}, None),
    ("/tokenize", {"prompt": "a" + SURROGATE}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": SURROGATE}]}, "messages"),
])
def test_lone_surrogate_is_400_naming_the_field(live, path, body, param):
    assert_openai_error(post(live, path, body), 400, param)


def test_body_and_header_size_limits(live):
    huge = json.dumps({**CMPL, "prompt": "x" * (9 << 20)})
    assert_openai_error(post(live, "/v1/completions", huge), 413)

    def chunked():
        yield json.dumps(CMPL)[:-1].encode() + b', "user": "'
        for _ in range(9):
            yield b"y" * (1 << 20)
        yield b'"}'

    r = httpx.post(live.url + "/v1/completions", content=chunked(), timeout=60,
                   headers={"Authorization": f"Bearer {live.api_key}"})  # no Content-Length: chunked
    assert_openai_error(r, 413)
    r = post(live, "/v1/completions", CMPL, headers={f"x-junk-{i}": "z" * 1000 for i in range(40)})
    assert r.status_code in (400, 431)
    if r.status_code == 431:  # our limit (the HTTP parser may refuse such headers itself first)
        assert_openai_error(r, 431)


def test_routes_showing_data_need_the_key(live):
    for path in ("/metrics", "/v1/kv/snapshot", "/v1/models", "/tokenize"):
        r = httpx.request("POST" if path == "/tokenize" else "GET", live.url + path, timeout=10,
                          json={"prompt": "hi"} if path == "/tokenize" else None)
        assert_openai_error(r, 401)
    auth = {"Authorization": f"Bearer {live.api_key}"}
    assert httpx.get(live.url + "/metrics", headers=auth, timeout=10).status_code == 200
    for path in ("/health", "/ping", "/version", "/dashboard"):
        assert httpx.get(live.url + path, timeout=10).status_code == 200, path
    for path in ("/docs", "/redoc", "/openapi.json"):  # off unless --enable-docs
        assert httpx.get(live.url + path, headers=auth, timeout=10).status_code == 404, path


def app_client(live, **options):
    """A second app over the live engine, driven in-process (no lifespan: no stats task)."""
    from starlette.testclient import TestClient

    from pagedllm.server import create_app

    return TestClient(create_app(live.engine, stats_interval_s=None, **options), raise_server_exceptions=False)


def test_metrics_token_metrics_open_and_docs_flag(live):
    c = app_client(live, api_key="k", metrics_token="scrape")
    assert c.get("/metrics", headers={"Authorization": "Bearer scrape"}).status_code == 200
    assert c.get("/v1/models", headers={"Authorization": "Bearer scrape"}).status_code == 401
    assert c.get("/metrics").status_code == 401
    c = app_client(live, api_key="k", metrics_open=True, enable_docs=True)
    assert c.get("/metrics").status_code == 200
    assert c.get("/openapi.json", headers={"Authorization": "Bearer k"}).status_code == 200


def test_host_header_is_checked_beyond_loopback(live):
    from pagedllm.server.guards import default_allowed_hosts

    assert default_allowed_hosts("127.0.0.1") is None and default_allowed_hosts("localhost") is None
    allowed = default_allowed_hosts("0.0.0.0")
    assert "localhost" in allowed and socket.gethostname() in allowed
    c = app_client(live, allowed_hosts=allowed)
    assert_openai_error(c.get("/health", headers={"Host": "evil.example.com"}), 400)
    for host in ("localhost:8000", "10.1.2.3:8000", "[::1]:8000", socket.gethostname()):
        assert c.get("/health", headers={"Host": host}).status_code == 200, host


def test_unhandled_error_hides_its_text(live):
    c = app_client(live)

    @c.app.get("/boom")
    async def boom():
        raise KeyError("secret-internal-detail")

    err = assert_openai_error(c.get("/boom"), 500)
    assert "secret" not in err["message"]


def test_stream_failing_midway_ends_with_error_event_and_done(live):
    c = app_client(live)
    serving = c.app.state.serving
    real_run = serving.run

    async def failing_run(*args, **kwargs):
        async for item in real_run(*args, **kwargs):
            yield item
            raise OverflowError("secret-internal-detail")

    serving.run = failing_run
    for path, base in (("/v1/completions", CMPL), ("/v1/chat/completions", CHAT)):
        r = c.post(path, json={**base, "stream": True, "max_tokens": 8, "ignore_eos": True})
        assert r.status_code == 200
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events
        err = json.loads(events[-2])["error"]
        assert err["type"] == "server_error" and "secret" not in err["message"]
        assert "choices" in json.loads(events[0])


def metric(live, pattern: str) -> float:
    text = httpx.get(live.url + "/metrics", headers={"Authorization": f"Bearer {live.api_key}"}, timeout=10).text
    return float(re.search(pattern, text, re.MULTILINE).group(1))


def generated(live) -> float:
    return metric(live, r"^pagedllm_generation_tokens(?:_total)? (\S+)$")


def running(live) -> float:
    return metric(live, r"^pagedllm_num_requests_running (\S+)$")


def test_abandoned_non_streaming_request_is_aborted(live):
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True}).encode()
    host, port = live.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {live.api_key}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    start = generated(live)
    deadline = time.monotonic() + 30
    while generated(live) < start + 20:  # it is running
        assert time.monotonic() < deadline
        time.sleep(0.05)
    sock.close()
    deadline = time.monotonic() + 30
    while running(live):  # the server notices the client left and aborts the request
        assert time.monotonic() < deadline, "generation went on after the client left"
        time.sleep(0.05)
    assert generated(live) < start + 1000


# ------------------------------------------------------------------ keyed block hashes, the snapshot
def test_block_hashes_are_keyed_per_process_unless_shared(monkeypatch):
    from pagedllm.kv.prefix_cache import HASH_KEY, hash_block, hash_key

    monkeypatch.delenv("PAGEDLLM_HASH_KEY", raising=False)
    assert hash_key() != hash_key()  # random per process (each process draws its own at import)
    monkeypatch.setenv("PAGEDLLM_HASH_KEY", "shared-secret")
    assert hash_key() == hash_key() != HASH_KEY  # cooperating processes set the same secret
    monkeypatch.setenv("PAGEDLLM_HASH_KEY", "other-secret")
    assert hash_key() != HASH_KEY
    ids = list(range(16))
    assert hash_block(None, ids) != _chain_hashes(ids, 16, keyed=False)[0]  # not the public unkeyed digest


def _core_block_hashes(core) -> set[int]:
    return {b.block_hash for b in core.kv.pool.blocks if b.block_hash is not None}


def _chain_hashes(ids: list[int], block_size: int, keyed: bool) -> list[int]:
    """What an attacker computes: the public unkeyed scheme, or the scheme under the attacker's own key."""
    import hashlib

    from pagedllm.kv.prefix_cache import hash_block_chain

    if keyed:
        return hash_block_chain(None, ids, block_size)
    out, parent = [], None
    for i in range(len(ids) // block_size):
        head = b"\x00" if parent is None else b"\x01" + parent.to_bytes(16, "little")
        data = array("q", ids[i * block_size:(i + 1) * block_size]).tobytes()
        parent = int.from_bytes(hashlib.blake2b(head + len(data).to_bytes(4, "little") + data,
                                                digest_size=16).digest(), "little")
        out.append(parent)
    return out


def test_pin_guessing_attack_on_the_snapshot_recovers_nothing(live):
    """A client sends a secret; an attacker reads /v1/kv/snapshot (with and without the key) and hashes
    the 10^4 candidate PINs: nothing in the snapshot, nor the core's own block hashes, matches."""
    secret = "Reminder for the form, keep it private: my bank PIN is {:04d}. Do not share it."
    pin = 5093
    r = post(live, "/v1/completions", {"prompt": secret.format(pin), "max_tokens": 4})
    assert r.status_code == 200
    assert_openai_error(httpx.get(live.url + "/v1/kv/snapshot", timeout=10), 401)
    snap = httpx.get(live.url + "/v1/kv/snapshot", headers={"Authorization": f"Bearer {live.api_key}"},
                     timeout=10).json()
    assert snap["counts"]["cached_free"] > 0  # the secret's blocks are cached, as in the original leak
    for b in snap["blocks"]:
        assert set(b) == {"id", "ref_count", "state", "owners", "requests"}, b
    text = json.dumps(snap)
    assert "cmpl-" not in text and r.json()["id"] not in text  # no request ids
    tok, bs = live.engine.tokenizer, snap["block_size"]
    candidates = tok([secret.format(p) for p in range(10_000)], add_special_tokens=False)["input_ids"]
    assert live.engine.tokenize(secret.format(pin))[1] == candidates[pin]  # the engine's own tokenization
    core = set(asyncio.run(live.engine.call(_core_block_hashes)))
    recovered = []
    for guess, ids in enumerate(candidates):
        for keyed in (False, True):
            hashes = _chain_hashes(ids, bs, keyed)
            assert hashes, "the secret fills no block: the attack would be vacuous"
            if core & set(hashes) or any(f"{h:032x}"[:8] in text for h in hashes):
                recovered.append(guess)
    assert recovered == []


# ------------------------------------------------------------------ fuzz
FIELDS = sorted({*CMPL, *CHAT, "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                 "logprobs", "top_logprobs", "echo", "stream", "stream_options", "logit_bias", "best_of",
                 "response_format", "guided_choice", "tools", "tool_choice", "min_tokens", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "truncate_prompt_tokens", "max_completion_tokens",
                 "cache_salt", "user", "ignore_eos", "include_stop_str_in_output"})


def _junk():
    from hypothesis import strategies as st

    text = st.text(st.characters(codec=None, categories=None), max_size=12)  # surrogates included
    extreme = st.sampled_from([0, -1, 1, 2**31, 2**63, -(2**63) - 1, 10**30, float("nan"), float("inf"),
                               float("-inf"), 1e-300, 1e308, -0.0])
    leaf = st.none() | st.booleans() | st.integers(-3, 40) | extreme | st.floats() | text
    return st.recursive(leaf, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(text | st.sampled_from(FIELDS), inner, max_size=4), max_leaves=12)


def _fuzz(live, path: str, base: dict, seen: dict) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    names = st.sampled_from(FIELDS) | st.text(max_size=8)

    @settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.dictionaries(names, _junk(), max_size=4), st.sampled_from(["json", "top-level junk", "bytes"]))
    def check(fields: dict, shape: str) -> None:
        if shape == "json":
            content = json.dumps({**base, **fields}).encode()
        elif shape == "top-level junk":
            content = json.dumps(list(fields.values()) or "x").encode()
        else:
            content = json.dumps({**base, **fields}).encode()[: len(json.dumps(base)) // 2] + b"\xff\xfe"
        r = httpx.post(live.url + path, content=content, timeout=120,
                       headers={"Authorization": f"Bearer {live.api_key}", "Content-Type": "application/json"})
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (fields, r.text)
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
        elif r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]

    check()


@pytest.mark.parametrize("path,base", [("/v1/completions", CMPL), ("/v1/chat/completions", CHAT)])
def test_fuzzed_bodies_get_no_5xx(live, path, base):
    seen: dict[int, int] = {}
    _fuzz(live, path, base, seen)
    print(f"{path}: {sum(seen.values())} fuzzed bodies, statuses {sorted(seen.items())}")
    assert sum(seen.values()) >= 60 and not any(code >= 500 for code in seen)
