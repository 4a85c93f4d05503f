"""Disaggregated prefill/decode: prefill 1 + decode 1 replicas on a local Ray instance."""

from __future__ import annotations

import asyncio

import pytest

from pagedllm.scaleout.config import ScaleOutConfig
from pagedllm.scaleout.engine import ScaleOutEngine
from tests.scaleout.conftest import assert_no_leaks, generate_all, greedy, prompts, replica_stats


@pytest.fixture(scope="module")
def engine(ray_local, tiny_args):
    eng = ScaleOutEngine(tiny_args, ScaleOutConfig(num_prefill=1, num_decode=1, num_cpus_per_replica=0.5))
    yield eng
    eng.shutdown()


def test_disaggregated_output_equals_colocated(engine, reference):
    batch = prompts(3, prefix_len=40, seed=11) + [list(range(200, 210))]  # the last: too short to hand over
    got = asyncio.run(generate_all(engine, batch, "pd"))
    assert got == [reference(p) for p in batch]
    prefill, decode = replica_stats(engine)
    assert prefill["generation_tokens"] == 3  # one discarded token per handed-over prompt
    assert prefill["prompt_tokens_computed"] + prefill["prompt_tokens_cached"] == sum(map(len, batch[:3]))
    assert decode["kv_transfer_imports"] == 3 and decode["kv_transfer_blocks"] == 2  # the shared 2 blocks, once
    assert decode["hit_tokens"] == 3 * 32
    assert decode["generation_tokens"] == 4 * len(got[0])
    assert decode["kv_transfer_bytes"] == 3 * 2 * engine.client.spec.block_size * 2 * 2 * 2 * 16 * 4
    assert_no_leaks(engine)


def test_aborts_during_prefill_or_decode_leave_no_blocks(engine):
    async def run() -> None:
        async def one(i: int, prompt: list[int], after: int) -> None:
            n = 0
            async for _ in engine.generate(prompt, greedy(300), f"pdab-{i}"):
                n += 1
                if n >= after:
                    return

        async def cancelled_early(i: int, prompt: list[int]) -> None:
            task = asyncio.create_task(one(i, prompt, 10**6))
            await asyncio.sleep(0)  # started: routed and sent, then cancelled while prefilling
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        batch = prompts(4, prefix_len=64, seed=12)
        await asyncio.gather(*(one(i, p, 1 + i) for i, p in enumerate(batch[:2])),
                             *(cancelled_early(10 + i, p) for i, p in enumerate(batch[2:])))

    asyncio.run(run())
    assert_no_leaks(engine)
