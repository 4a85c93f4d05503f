"""KV tiers with the workers in other processes: the ``mp`` executor and tensor parallelism (2 ranks on CPU,
gloo). The core's KV manager owns the tiers; each rank copies its own kv heads out and in through the
executor. Greedy fp32 outputs equal the tiers-off run's, L1 (a small pool) evicts so L2 and L3 hits happen,
a restart under TP=2 finds its prefixes on disk, and the pool's and the tiers' accounting hold."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# 6 prompts of 9 blocks each (8 full, cacheable), in a pool of 24 blocks: the second round finds them evicted
PROMPTS = [[1000 + (i * 37 + j * 11) % 20000 for i in range(130)] for j in range(6)]
HIT = 8 * 16  # a returning prompt's cached tokens: its 8 full blocks


def _run(model, **kw):
    llm = LLM(model, device="cpu", dtype="float32", num_blocks=24, block_size=16, check_integrity=True,
              **kw)  # TP: gloo ranks
    outs = [llm.generate([p], SP, use_tqdm=False)[0] for _ in range(2) for p in PROMPTS]
    kv = llm.engine.kv
    kv.check_integrity()  # free + used = total in the pool; slots and files in the tiers
    assert kv.stats()["used"] == 0
    llm.engine.shutdown()  # L2 + L3: what the pool and L2 hold is written to disk now (write-back)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs], kv.stats()


@pytest.fixture(scope="module")
def baseline(tiny_model_dir):
    tokens, cached, _ = _run(tiny_model_dir)
    assert cached == [0] * 12  # without tiers every second-round prompt was evicted
    return tokens


def test_mp_executor_tiers_token_identical(tiny_model_dir, baseline, tmp_path):
    got, cached, st = _run(tiny_model_dir, distributed_executor_backend="mp", kv_offload_memory=4 << 20)
    assert got == baseline and cached[6:] == [HIT] * 6
    assert st["host_tier_promoted_blocks"] == 6 * 8 and st["host_tier_used"] > 0
    got, cached, st = _run(tiny_model_dir, distributed_executor_backend="mp", kv_disk_path=str(tmp_path))
    assert got == baseline and cached[6:] == [HIT] * 6  # L3 only: every demoted block went to disk
    assert st["disk_tier_promoted_blocks"] == 6 * 8 and st["disk_tier_corrupt"] == 0


def test_tp2_tiers_token_identical_restart_finds_disk_tp1_does_not(tiny_model_dir, baseline, tmp_path):
    tp = {"tensor_parallel_size": 2, "kv_offload_memory": 128 << 10, "kv_disk_path": str(tmp_path)}  # L2: 16 blocks
    got, cached, st = _run(tiny_model_dir, **tp)
    assert got == baseline and cached[6:] == [HIT] * 6
    assert st["host_tier_promoted_blocks"] + st["disk_tier_promoted_blocks"] == 6 * 8
    assert st["disk_tier_promoted_blocks"] > 0  # L2 holds fewer blocks than were evicted: some came from disk
    again, cached, st = _run(tiny_model_dir, tensor_parallel_size=2, kv_disk_path=str(tmp_path))  # a restart
    assert again == baseline and cached == [HIT] * 12  # the first round too, from disk
    assert st["disk_tier_promoted_blocks"] >= 6 * 8 and st["disk_tier_corrupt"] == 0
    _, cached, st = _run(tiny_model_dir, kv_disk_path=str(tmp_path))  # TP=1 keys its own files (the fingerprint)
    assert cached[:6] == [0] * 6 and st["disk_tier_corrupt"] == 0
