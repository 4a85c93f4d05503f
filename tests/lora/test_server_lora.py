"""Adapters over HTTP: chosen by the OpenAI ``model`` name, listed in /v1/models, loaded and unloaded at runtime
behind the API key; unknown names get a 404 naming them and bad adapters are refused with the reason while the
server keeps serving."""

from __future__ import annotations

import httpx
import pytest

from tests.lora.conftest import peft_greedy
from tests.server.conftest import live_server

PROMPT = [1, 5, 9, 200, 17, 42, 42, 7]
N_NEW = 8


@pytest.fixture(scope="module")
def srv(tiny_model_dir, tiny_adapters):
    opts = dict(model=tiny_model_dir, enable_lora=True, max_loras=2, max_lora_rank=16, kv_cache_memory=8 << 20,
                lora_modules=(f"a0={tiny_adapters[0]}", f"a1={tiny_adapters[1]}"))
    with live_server(opts) as s:
        yield s


def client(srv, key: str | None = "default") -> httpx.Client:
    headers = {} if key is None else {"Authorization": f"Bearer {srv.api_key if key == 'default' else key}"}
    return httpx.Client(base_url=srv.url, headers=headers, timeout=120)


def complete(c: httpx.Client, model: str) -> httpx.Response:
    return c.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": N_NEW, "temperature": 0,
                                           "ignore_eos": True})


def test_models_lists_base_and_adapters(srv):
    with client(srv) as c:
        ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
    assert ids[0] == srv.engine.model_name and sorted(ids[1:]) == ["a0", "a1"]


def test_model_name_picks_the_adapter(srv, tiny_hf, tiny_adapters):
    tok = srv.engine.tokenizer
    with client(srv) as c:
        for name, path in (("a0", tiny_adapters[0]), ("a1", tiny_adapters[1]), (srv.engine.model_name, None)):
            r = complete(c, name)
            assert r.status_code == 200, r.text
            want = tok.decode(peft_greedy(tiny_hf, path, [PROMPT], N_NEW)[0], skip_special_tokens=True)
            assert r.json()["choices"][0]["text"] == want, name


def test_unknown_adapter_is_404_naming_it(srv):
    with client(srv) as c:
        r = complete(c, "nope")
    assert r.status_code == 404
    err = r.json()["error"]
    assert "'nope'" in err["message"] and err["param"] == "model" and err["code"] == "model_not_found"


def test_load_use_unload_at_runtime(srv, tiny_hf, tiny_adapters):
    tok = srv.engine.tokenizer
    with client(srv, key=None) as anon:
        assert anon.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": tiny_adapters[2]}
                         ).status_code == 401
    with client(srv) as c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": tiny_adapters[2]})
        assert r.status_code == 200, r.text
        assert "a2" in [m["id"] for m in c.get("/v1/models").json()["data"]]
        r = complete(c, "a2")
        assert r.json()["choices"][0]["text"] == tok.decode(peft_greedy(tiny_hf, tiny_adapters[2], [PROMPT], N_NEW)[0],
                                                           skip_special_tokens=True)
        again = c.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": tiny_adapters[3]})
        assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 200
        assert complete(c, "a2").status_code == 404
        gone = c.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
        assert gone.status_code == 404 and "'a2'" in gone.json()["error"]["message"]


def pool_view(core) -> tuple[int, dict[int, int]]:
    """The pool's free blocks and each resident adapter's pages (read between steps in the core)."""
    return core.kv.num_free_blocks, {i: len(core.kv.pages_of(("lora", i))) for i in core.scheduler.adapters.resident}


def test_unload_frees_the_adapters_pages_at_once(srv, tiny_adapters):
    """An idle adapter's pages go back to the pool right when it is unloaded, not when the LRU gets to it."""
    with client(srv) as c:
        assert c.post("/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": tiny_adapters[3]}
                      ).status_code == 200
        lid = srv.engine.loras.get("a3").lora_int_id
        assert complete(c, "a3").status_code == 200
        free, pages = srv.engine.client.call(pool_view).result(60)
        assert pages[lid] > 0
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "a3"}).status_code == 200
        free_after, pages_after = srv.engine.client.call(pool_view).result(60)
    assert lid not in pages_after and free_after == free + pages[lid]


@pytest.mark.parametrize("kind,reason", [("rank", "above max_lora_rank 16"), ("shape", "another base model"),
                                         ("broken", "weights file is broken")])
def test_bad_adapter_refused_server_keeps_serving(srv, bad_adapters, kind, reason):
    with client(srv) as c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": f"bad-{kind}", "lora_path": bad_adapters[kind]})
        assert r.status_code == 400
        assert reason in r.json()["error"]["message"]
        assert f"bad-{kind}" not in [m["id"] for m in c.get("/v1/models").json()["data"]]
        assert complete(c, "a0").status_code == 200
        assert c.get("/health").status_code == 200
