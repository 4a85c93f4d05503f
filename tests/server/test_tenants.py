"""Issue 34, item 5: with ``--api-keys-file`` every tenant's prefix cache is salted apart, so a probe by
one tenant learns nothing about another's prompts: not from ``cached_tokens``, and not from timing,
because the engine reuses none of the victim's blocks (its hit counter does not move). The same probe
without tenants is right every time."""

from __future__ import annotations

import random
import re

import httpx
import pytest

from pagedllm.server.tenants import load_api_keys, tenant_cache_salt
from tests.server.conftest import live_server

KEYS = {"key-a": "alice", "key-a2": "alice", "key-b": "bob"}


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    with live_server(engine_options=dict(model=tiny_model_dir, num_blocks=512, check_integrity=False),
                     stats_interval_s=None, api_keys=KEYS) as srv:
        yield srv


def send(srv, key: str, prompt: str, **extra) -> int:
    """``cached_tokens`` of one request by ``key``."""
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, **extra},
                   headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def hit_tokens(srv) -> float:
    text = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {srv.api_key}"}, timeout=10).text
    return float(re.search(r"^pagedllm_prefix_cache_hit_tokens(?:_total)? (\S+)$", text, re.M).group(1))


def secret(i: int) -> str:
    return f"Confidential memo {i}: the merger code word is {random.Random(i).getrandbits(64):x}. " * 12


def probe(srv, victim: str, attacker: str, trials: int = 12) -> tuple[float, set[tuple[int, float]]]:
    """The attacker guesses, for each secret, whether the victim sent it: 'yes' if its own request of
    that prompt reused any cached block. Returns the accuracy and the attacker's observations when the
    victim had sent the secret."""
    rng = random.Random(34)
    right, seen = 0, set()
    for i in range(trials):
        prompt = secret(rng.getrandbits(32))
        sent = i % 2 == 0
        if sent:
            send(srv, victim, prompt)
        before = hit_tokens(srv)
        cached = send(srv, attacker, prompt)
        reused = hit_tokens(srv) - before
        right += (cached > 0 or reused > 0) == sent
        if sent:
            seen.add((cached, reused))
    return right / trials, seen


def test_probe_across_tenants_learns_nothing(live):
    accuracy, seen = probe(live, "key-a", "key-b")
    assert seen == {(0, 0.0)}, seen  # exactly what a never-sent prompt shows: no cached tokens, no reuse
    assert accuracy == 0.5


def test_probe_without_tenants_is_always_right(live):
    accuracy, seen = probe(live, live.api_key, live.api_key)  # one key, no tenant: one shared cache
    assert accuracy == 1.0 and all(c > 0 for c, _ in seen)


def test_a_tenant_shares_its_cache_across_its_keys_and_splits_it_by_its_own_salt(live):
    prompt = secret(99)
    assert send(live, "key-a", prompt) == 0
    assert send(live, "key-a2", prompt) > 0  # the same tenant
    assert send(live, "key-a", prompt, cache_salt="private") == 0
    assert send(live, "key-a", prompt, cache_salt="private") > 0


def test_unknown_key_is_401(live):
    r = httpx.get(live.url + "/v1/models", headers={"Authorization": "Bearer key-c"}, timeout=10)
    assert r.status_code == 401


def test_api_keys_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# key tenant\nk1 alice\n\nk2 alice\nk3 bob\n")
    assert load_api_keys(str(path)) == {"k1": "alice", "k2": "alice", "k3": "bob"}
    for bad, words in (("k1\n", "expected 'KEY TENANT'"), ("k1 a\nk1 b\n", "twice"), ("# none\n", "no API keys")):
        path.write_text(bad)
        with pytest.raises(ValueError, match=words):
            load_api_keys(str(path))
    assert tenant_cache_salt(None, "s") == "s" and tenant_cache_salt("a", None) != tenant_cache_salt("b", None)
    assert tenant_cache_salt("a", "x") != tenant_cache_salt("a", None)
