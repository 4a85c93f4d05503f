"""The server over a tensor-parallel engine: the core process spawns the TP ranks (so it may not be a daemonic
process) and the API answers with TP=1's tokens."""

from __future__ import annotations

import httpx
from tests.server.conftest import API_KEY, live_server

from pagedllm import LLM, SamplingParams


def test_server_with_tensor_parallel_equals_tp1(tiny_model_dir, wiki_texts):
    prompts = [t[:200] for t in wiki_texts[:2]]
    want = LLM(tiny_model_dir, kv_cache_memory=16 << 20).generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    with live_server(dict(model=tiny_model_dir, device="cpu", tensor_parallel_size=2, kv_cache_memory=16 << 20)) as srv:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        for prompt, ref in zip(prompts, want):
            r = httpx.post(f"{srv.url}/v1/completions", headers=headers, timeout=120,
                           json={"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                 "logprobs": 1})
            assert r.status_code == 200, r.text
            body = r.json()["choices"][0]
            assert body["text"] == ref.outputs[0].text
            assert len(body["logprobs"]["tokens"]) == 12
        assert srv.engine.client.call(used_blocks).result(timeout=30) == 0


def used_blocks(core) -> int:
    """Runs in the core's process."""
    return core.pool_stats()["used"]
