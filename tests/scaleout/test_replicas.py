"""Two data-parallel replicas on a local Ray instance behind one front end (ScaleOutEngine)."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedllm.scaleout.config import ScaleOutConfig
from pagedllm.scaleout.engine import ScaleOutEngine
from tests.scaleout.conftest import assert_no_leaks, generate_all, greedy, prompts, replica_stats


@pytest.fixture(scope="module")
def engine(ray_local, tiny_args):
    eng = ScaleOutEngine(tiny_args, ScaleOutConfig(num_replicas=2, num_cpus_per_replica=0.5))
    yield eng
    eng.shutdown()


def test_outputs_equal_a_single_engine(engine, reference):
    batch = prompts(3, seed=1) + prompts(3, seed=2)
    got = asyncio.run(generate_all(engine, batch, "eq"))
    assert got == [reference(p) for p in batch]
    assert_no_leaks(engine)


def test_shared_prefix_requests_land_on_one_replica(engine):
    before = replica_stats(engine)
    batch = prompts(4, prefix_len=48, seed=3)
    asyncio.run(generate_all(engine, batch[:1], "aff0"))  # the first computes the prefix ...
    asyncio.run(generate_all(engine, batch[1:], "aff"))  # ... the others follow it there
    after = replica_stats(engine)
    queries = [a["queries"] - b["queries"] for a, b in zip(after, before)]
    hit_tokens = [a["hit_tokens"] - b["hit_tokens"] for a, b in zip(after, before)]
    owner = queries.index(4)
    assert queries[1 - owner] == 0
    assert hit_tokens[owner] == 3 * 48  # three requests hit the 3 shared blocks
    assert_no_leaks(engine)


def test_a_replica_that_misses_a_prefix_fetches_it_from_its_peer(engine, reference):
    batch = prompts(2, prefix_len=48, seed=4)
    asyncio.run(generate_all(engine, batch[:1], "peer0"))
    router = engine.client.router
    owner = next(r for r in range(2) if router.hashes(batch[0])[0] in router._where and
                 r in router._where[router.hashes(batch[0])[0]])
    before = replica_stats(engine)[1 - owner]
    router.load[owner] += 100  # the holder looks busy: the other replica serves, fetching the blocks
    try:
        got = asyncio.run(generate_all(engine, batch[1:], "peer"))
    finally:
        router.load[owner] -= 100
    after = replica_stats(engine)[1 - owner]
    assert got == [reference(batch[1])]
    assert after["kv_transfer_blocks"] - before["kv_transfer_blocks"] == 3
    assert after["hit_tokens"] - before["hit_tokens"] == 48
    assert after["kv_transfer_bytes"] > before["kv_transfer_bytes"]
    assert_no_leaks(engine)


def test_aborted_requests_free_their_blocks(engine):
    async def start_and_cancel() -> None:
        async def one(i: int, prompt: list[int]) -> None:
            async for _ in engine.generate(prompt, greedy(400), f"ab-{i}"):
                return  # leaving after the first output aborts the request

        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts(4, seed=5) + prompts(2, seed=6))))

    asyncio.run(start_and_cancel())
    assert_no_leaks(engine)


def test_a_killed_replica_fails_its_requests_and_comes_back(engine, ray_local, reference):
    client = engine.client

    async def run() -> list:
        async def one(i: int, prompt: list[int]):
            try:
                async for _ in engine.generate(prompt, greedy(300), f"kill-{i}"):
                    pass
            except RuntimeError as e:
                return str(e)
            return "finished"

        tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts(2, seed=7) + prompts(2, seed=8))]
        while len(client._inflight) < 4:  # every request routed
            await asyncio.sleep(0.05)
        victim = client._inflight["kill-0"][-1]
        ray_local.kill(client.replicas[victim], no_restart=False)
        return victim, await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)

    victim, results = asyncio.run(run())
    assert "died" in results[0] and f"replica {victim}" in results[0]
    assert any("died" in r for r in results) and all(r == "finished" or "died" in r for r in results)
    deadline = time.monotonic() + 120
    while client.restarts[victim] == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert client.restarts[victim] == 1 and engine.error is None
    batch = prompts(3, seed=9)
    assert asyncio.run(generate_all(engine, batch, "after")) == [reference(p) for p in batch]
    assert_no_leaks(engine)


def test_the_openai_server_runs_on_the_replicas(engine):
    from fastapi.testclient import TestClient

    from pagedllm.server import create_app

    with TestClient(create_app(engine)) as http:
        r = http.post("/v1/completions", json={"prompt": prompts(1, seed=10)[0], "max_tokens": 4, "temperature": 0,
                                               "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        assert http.get("/health").status_code == 200
        metrics = http.get("/metrics").text
        assert f"pagedllm_kv_blocks_total {float(2 * engine.spec.num_blocks)}" in metrics
    assert_no_leaks(engine)


def test_bench_serve_drives_the_replicas_and_summarizes(engine):
    import argparse

    from pagedllm.bench import serve

    args = argparse.Namespace(quick=True, num_requests=6, rate=50.0, long_len=40, short_len="20-24", long_fraction=0.5,
                              num_prefixes=1, output_len=4, seed=0)
    reqs, arrivals = serve.workload(engine.tokenizer, args)
    assert {r.label for r in reqs} == {"short", "long"} and arrivals == sorted(arrivals) and arrivals[0] == 0.0
    longs = [r.prompt_ids for r in reqs if r.label == "long"]
    assert all(p[:40] == longs[0][:40] for p in longs)  # one shared system prompt
    results = asyncio.run(serve.drive(engine, reqs, arrivals, "bench"))
    s = serve.summarize(results, 1.0, asyncio.run(engine.stats()))
    assert s["completed"] == 6 and not s["errors"] and s["tok_s"] == 24.0
    assert s["all"]["n"] == 6 and s["all"]["ttft_p50"] > 0 and len([x for r in results for x in r["itl"]]) == 18
    assert_no_leaks(engine)


def test_replicas_that_cannot_be_placed_fail_the_start(ray_local, tiny_args, monkeypatch):
    from pagedllm.scaleout import client

    monkeypatch.setattr(client, "STARTUP_TIMEOUT_S", 3.0)
    with pytest.raises(RuntimeError, match="did not start within 3 s: they ask for 64 CPU each"):
        client.ReplicaSetClient(tiny_args, ScaleOutConfig(num_replicas=2, num_cpus_per_replica=64), print, print)
