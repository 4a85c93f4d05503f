"""Scale-out fixtures: tiny engines and a greedy driver for an engine core."""

from __future__ import annotations

import pytest

from pagedllm.config.args import EngineArgs
from pagedllm.protocol.core_io import EngineCoreRequest
from pagedllm.protocol.sampling_params import SamplingParams

MAX_TOKENS = 8


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="session")
def tiny_args(tiny_model_dir) -> EngineArgs:
    return EngineArgs(model=tiny_model_dir, num_blocks=48, block_size=16, dtype="float32", seed=0)


def run_core(core, request_id: str, prompt: list[int], salt: str | None = None) -> list[int]:
    """Greedy tokens of one request run alone on an engine core."""
    core.add_request(EngineCoreRequest(request_id, prompt, greedy(), salt))
    tokens: list[int] = []
    while core.has_unfinished():
        for out in core.step():
            for d in out.seqs:
                tokens += d.new_token_ids
    return tokens


def prompts(num: int, prefix_len: int = 40, seed: int = 0) -> list[list[int]]:
    """``num`` prompts sharing one ``prefix_len``-token prefix, each with its own tail."""
    prefix = [(seed * 7919 + 31 * i) % 5000 + 100 for i in range(prefix_len)]
    return [prefix + [6000 + 13 * j + k for k in range(3 + j % 4)] for j in range(num)]


@pytest.fixture(scope="session")
def ray_local():
    """A local Ray instance for the session's replica tests."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def cores(tiny_args):
    """Two in-process engine cores on the tiny model."""
    from pagedllm.core.engine_core import EngineCore

    pair = EngineCore(tiny_args), EngineCore(tiny_args)
    yield pair
    for c in pair:
        c.shutdown()


@pytest.fixture(scope="session")
def reference(cores):
    """Greedy tokens of a prompt run alone (prefix cache emptied first) on an in-process engine core."""
    core = cores[0]
    memo: dict[tuple[int, ...], list[int]] = {}

    def tokens(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in memo:
            core.reset_prefix_cache()
            memo[key] = run_core(core, f"ref{len(memo)}", prompt)
        return memo[key]

    return tokens


async def generate_all(engine, batch: list[list[int]], tag: str, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Run the prompts concurrently through an AsyncEngine-like front end; their output token ids."""
    import asyncio

    async def one(i: int, prompt: list[int]) -> list[int]:
        last = None
        async for out in engine.generate(prompt, greedy(max_tokens), f"{tag}-{i}"):
            last = out
        return last.outputs[0].token_ids

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(batch))))


def replica_stats(engine) -> list[dict]:
    return engine.client.stats()


def assert_no_leaks(engine, timeout: float = 30.0) -> None:
    """Every live replica is idle, holds no block and passes the pool check."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        per = replica_stats(engine)
        busy = [s for s in per if s["running"] or s["waiting"] or s["used"] or s["num_seqs"]]
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not busy, f"replicas still hold requests or blocks: {busy}"
    assert len(per) == len(engine.client.replicas)
    for i in range(len(per)):
        engine.client.call(_check, replica=i).result(timeout=30)


def _check(core) -> None:
    core.check_integrity()
