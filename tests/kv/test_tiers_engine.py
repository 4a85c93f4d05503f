"""The engine with KV tiers: greedy outputs token-identical with tiers off, L2, L2 + L3 and after a
restart; a request waiting for its blocks from disk does not stall the others."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# 12 prompts of 9 blocks each, in a pool of 24 blocks: the second round finds them evicted
PROMPTS = [[1000 + (i * 37 + j * 11) % 20000 for i in range(130)] for j in range(12)]


def _run(model, **tiers):
    llm = LLM(model, dtype="float32", num_blocks=24, block_size=16, check_integrity=True, **tiers)
    outs = [llm.generate([p], SP, use_tqdm=False)[0] for _ in range(2) for p in PROMPTS]
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.stats()["used"] == 0
    llm.engine.shutdown()  # L2 + L3: what L2 holds is written to disk now (write-back)
    stats = llm.engine.kv.stats()
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs], stats


def test_tiers_are_token_identical_and_hit_after_eviction_and_restart(tiny_model_dir, tmp_path):
    base, cached, _ = _run(tiny_model_dir)
    assert cached == [0] * 24  # without tiers every second-round prompt was evicted
    host, cached, st = _run(tiny_model_dir, kv_offload_memory=4 << 20)
    assert host == base and cached[12:] == [128] * 12 and st["host_tier_promoted_blocks"] == 12 * 8
    both, cached, st = _run(tiny_model_dir, kv_offload_memory=4 << 20, kv_disk_path=str(tmp_path))
    assert both == base and cached[12:] == [128] * 12 and st["disk_tier_demoted_blocks"] > 0
    again, cached, st = _run(tiny_model_dir, kv_disk_path=str(tmp_path), kv_eviction="lru")  # a restart
    assert again == base and cached == [128] * 24  # every prompt, the first round too, from disk
    assert st["disk_tier_promoted_blocks"] >= 12 * 8 and st["disk_tier_corrupt"] == 0


def test_waiting_for_disk_does_not_stall_others(tiny_model_dir, tmp_path):
    _run(tiny_model_dir, kv_disk_path=str(tmp_path))
    llm = LLM(tiny_model_dir, dtype="float32", num_blocks=24, block_size=16, check_integrity=True,
              kv_disk_path=str(tmp_path))
    eng = llm.engine
    other = eng.add_request([5] * 40, SP)  # not on disk: runs at once
    back = eng.add_request(PROMPTS[0], SP)  # on disk: waits for its blocks
    eng.step()
    assert [r.request_id for r in eng.core.scheduler.running] == [other]
    assert [r.request_id for r in eng.core.scheduler.waiting] == [back]
    finals = {}
    while eng.has_unfinished():
        finals.update((o.request_id, o) for o in eng.step() if o.finished)
    assert finals[back].num_cached_tokens == 128
    eng.kv.check_integrity()
    eng.shutdown()


def test_bad_tier_settings_name_the_field(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="kv_eviction"):
        LLM(tiny_model_dir, num_blocks=24, block_size=16, kv_offload_memory=1 << 20, kv_eviction="mru")
    with pytest.raises(ValueError, match="kv_offload_memory"):
        LLM(tiny_model_dir, num_blocks=24, block_size=16, kv_offload_memory=10)
    with pytest.raises(ValueError, match="kv_disk_size"):
        LLM(tiny_model_dir, num_blocks=24, block_size=16, kv_disk_path=str(tmp_path), kv_disk_size=0)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(tiny_model_dir, num_blocks=24, block_size=16, kv_offload_memory=1 << 20, enable_prefix_caching=False)


def test_smollm2_fp32_token_identical_with_tiers(smollm2_dir, tmp_path):
    """The real model: greedy fp32 outputs equal with the tiers on (prompts promoted from L2 and disk)."""
    prompts = [[1000 + (i * 31 + j * 17) % 40000 for i in range(100)] for j in range(4)]
    outs = {}
    for name, tiers in (("off", {}), ("on", {"kv_offload_memory": 2 << 20, "kv_disk_path": str(tmp_path)})):
        llm = LLM(smollm2_dir, dtype="float32", num_blocks=14, block_size=16, check_integrity=True, **tiers)
        store = llm.engine.kv.tiers
        outs[name] = []
        for p in prompts * 2:
            if store is not None:  # demotions are stored on the tiers' thread: wait for them, so every hit is due
                store.flush()
            outs[name].append(llm.generate([p], SP, use_tqdm=False)[0])
        llm.engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs["on"]] == [o.outputs[0].token_ids for o in outs["off"]]
    assert [o.num_cached_tokens for o in outs["on"]][4:] == [96] * 4


def test_peer_prefix_export_looks_in_the_tiers(tiny_model_dir):
    """A replica asked for a prefix (scale-out peer fetch) also serves what its L2 holds."""
    from pagedllm.scaleout.kv_transfer import export_prefix

    llm = LLM(tiny_model_dir, dtype="float32", num_blocks=24, block_size=16, check_integrity=True,
              kv_offload_memory=4 << 20)
    for p in PROMPTS:
        llm.generate([p], SP, use_tqdm=False)
    core = llm.engine.core
    assert core.kv.match_prefix(PROMPTS[0], record=False).num_tokens == 0  # evicted from the pool
    blocks = export_prefix(core, PROMPTS[0])
    assert blocks is not None and len(blocks.hashes) == 8
    core.kv.check_integrity()
    llm.engine.shutdown()
