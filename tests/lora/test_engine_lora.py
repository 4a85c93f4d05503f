"""The engine with adapters: the prefix cache never shares KV across adapters; adapters live in KV pages of the
pool, paged in on demand and evicted under pressure with exact outputs and no leaks; a blocked adapter read
stalls nobody; the compute slots come out of the KV budget."""

from __future__ import annotations

import threading

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.kv.kv_cache import KVCache
from pagedllm.lora.adapter import LoRAShapes
from pagedllm.lora.slots import LoRASlots
from pagedllm.protocol.lora_request import LoRARequest
from tests.lora.conftest import peft_greedy

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
LONG = list(range(100, 150))  # 3 full blocks of 16


def make_llm(model_dir, **kw) -> LLM:
    opts = dict(enable_lora=True, max_loras=2, max_lora_rank=16, dtype="float32", kv_cache_memory=4 << 20,
                check_integrity=True)
    return LLM(model_dir, block_size=16, **{**opts, **kw})


def test_prefix_cache_is_per_adapter(tiny_model_dir, tiny_adapters):
    llm = make_llm(tiny_model_dir)
    a0, a1 = (LoRARequest(f"a{i}", i + 1, tiny_adapters[i]) for i in range(2))

    def cached(lora) -> int:
        return llm.generate([LONG], GREEDY, use_tqdm=False, lora_request=lora)[0].num_cached_tokens

    assert cached(None) == 0
    assert cached(a0) == 0  # the base model's blocks of the same prompt are not this adapter's KV
    assert cached(a1) == 0
    # each hits its own: 3 full blocks and its tail up to the prompt's last token
    assert cached(a0) == 49 and cached(a1) == 49 and cached(None) == 49
    llm.engine.shutdown()


def test_paging_under_pressure_exact_and_leak_free(tiny_model_dir, tiny_hf, tiny_adapters):
    """8 adapters (57 pages in all) in a 30-block pool shared with the KV of 44-token prompts, 2 compute slots,
    3 host copies: adapters are evicted and read again, preemption may strike, every output equals HF + PEFT
    and the pool's invariants (adapter pages counted) hold at every step (check_integrity)."""
    llm = make_llm(tiny_model_dir, max_loras=2, max_cpu_loras=3, max_num_seqs=4, num_blocks=30)
    prompts = [[7 + i] + LONG[:43] for i in range(9)] * 2  # 44 tokens: a 4th block mid-decode
    loras = [None] + [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(tiny_adapters)]
    per_prompt = loras * 2
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=per_prompt)
    for p, lr, o in zip(prompts, per_prompt, outs):
        assert o.outputs[0].token_ids == peft_greedy(tiny_hf, lr and lr.lora_path, [p], 6)[0], lr
    pager = llm.engine.scheduler.adapters
    assert pager.num_evictions > 0 and pager.num_loads >= 8  # pages were evicted (host copies: timing decides)
    assert len(pager.host) <= 3
    kv = llm.engine.kv
    # what stays used is exactly the resident adapters' pages, one holder each
    assert kv.pool.num_used == kv.num_page_blocks == sum(pager.pages_for(r) for r in pager.resident.values()) > 0
    llm.engine.core.check_integrity()
    llm.engine.shutdown()


def test_adapter_weights_live_in_their_kv_pages(tiny_model_dir, tiny_adapters):
    from pagedllm.lora.adapter import load_adapter
    from pagedllm.lora.pages import pack, packed_bytes

    llm = make_llm(tiny_model_dir)
    lora = LoRARequest("a2", 3, tiny_adapters[2])  # rank 16: 16 pages of the tiny model's blocks
    llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=lora)
    kv, pager = llm.engine.kv, llm.engine.scheduler.adapters
    pages = kv.pages_of(("lora", 3))
    assert len(pages) == pager.pages_for(16) == 16 and kv.num_page_blocks == 16
    assert all(kv.pool.blocks[b].ref_count == 1 and kv.pool.blocks[b].block_hash is None for b in pages)
    shapes = LoRAShapes.of(llm.engine.forward_pass.model.config)
    stored = llm.engine.forward_pass.kv_cache.read_pages(pages, packed_bytes(shapes, 16)).view(torch.float32)
    assert torch.equal(stored.cpu(), pack(load_adapter(lora, shapes, 16), shapes))
    pager.remove(3)  # unloading gives the pages back
    assert kv.pool.num_used == 0
    llm.engine.core.check_integrity()
    llm.engine.shutdown()


def test_idle_adapters_give_their_pages_to_new_requests(tiny_model_dir, tiny_hf, tiny_adapters):
    """Two idle adapters hold 28 of 30 blocks; a base request needing 4 evicts them rather than waiting forever."""
    llm = make_llm(tiny_model_dir, num_blocks=30)
    for i in (2, 6):  # ranks 16 and 12: 16 + 12 pages
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=LoRARequest(f"a{i}", i + 1, tiny_adapters[i]))
    kv, pager = llm.engine.kv, llm.engine.scheduler.adapters
    assert kv.num_page_blocks == 28
    prompt = LONG[:44]
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert out == peft_greedy(tiny_hf, None, [prompt], 6)[0]
    assert pager.num_evictions >= 1 and kv.num_page_blocks < 28
    llm.engine.core.check_integrity()
    llm.engine.shutdown()


def test_adapter_load_does_not_stall_the_batch(tiny_model_dir, tiny_hf, tiny_adapters):
    """An adapter whose read is blocked (an Event-gated loader) keeps its request waiting while a base and a
    resident adapter's request step on; once the read ends the request runs, exactly."""
    llm = make_llm(tiny_model_dir)
    eng, pager = llm.engine, llm.engine.scheduler.adapters
    gate, entered = threading.Event(), threading.Event()
    read = pager.read

    def gated(lora):
        if lora.lora_int_id == 2:
            entered.set()
            assert gate.wait(60), "the test never opened the gate"
        return read(lora)

    pager.read = gated
    a0, a1 = LoRARequest("a0", 1, tiny_adapters[0]), LoRARequest("a1", 2, tiny_adapters[1])
    many = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=a0)  # a0 resident
    ids = [eng.add_request([9, 8, 7], many), eng.add_request([9, 8, 6], many, lora_request=a0),
           eng.add_request([9, 8, 5], many, lora_request=a1)]
    done: dict[str, list[int]] = {}
    for _ in range(6):  # the blocked load never holds a step: base and a0 produce a token each step
        for out in eng.step():
            done[out.request_id] = out.outputs[0].token_ids
    assert entered.is_set() and len(done.get(ids[0], [])) >= 5 and len(done.get(ids[1], [])) >= 5
    assert ids[2] not in done and any(r.request_id == ids[2] for r in eng.scheduler.waiting)
    gate.set()
    while eng.has_unfinished():
        for out in eng.step():
            done[out.request_id] = out.outputs[0].token_ids
    assert done[ids[2]] == peft_greedy(tiny_hf, tiny_adapters[1], [[9, 8, 5]], 12)[0]
    assert done[ids[1]] == peft_greedy(tiny_hf, tiny_adapters[0], [[9, 8, 6]], 12)[0]
    eng.core.check_integrity()
    eng.shutdown()


def test_adapter_broken_after_its_check_fails_only_its_request(tiny_model_dir, tiny_hf, tiny_adapters, tmp_path):
    """The file breaks between the front end's check and the pager's read: that request ends with the reason,
    the base request beside it finishes exactly, and nothing leaks."""
    import shutil

    path = tmp_path / "a0"
    shutil.copytree(tiny_adapters[0], path)
    llm = make_llm(tiny_model_dir)
    eng = llm.engine
    long = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    bad_id = eng.add_request([4, 5, 7], GREEDY, lora_request=LoRARequest("a0", 1, str(path)))
    base_id = eng.add_request([4, 5, 6], long)
    (path / "adapter_model.safetensors").write_bytes(b"broken")
    final = {}
    while eng.has_unfinished():
        for out in eng.step():
            final[out.request_id] = out
    assert "weights file is broken" in final[bad_id].error
    assert final[base_id].outputs[0].token_ids == peft_greedy(tiny_hf, None, [[4, 5, 6]], 8)[0]
    assert eng.kv.pool.num_used == 0
    eng.core.check_integrity()
    eng.shutdown()


def test_step_failing_before_the_pages_are_written_frees_them(tiny_model_dir, tiny_hf, tiny_adapters, monkeypatch):
    """The worker fails between the core's page allocation and its write: the request fails with the error, the
    adapter is not left counted resident over unwritten pages (its pages are free), and the next request for it
    sends the weights again and runs exactly."""
    from pagedllm.lora.manager import LoRAManager

    store = LoRAManager.store
    calls = []

    def fail_first(self, ap):
        calls.append(ap.lora_id)
        if len(calls) == 1:
            raise RuntimeError("injected: the worker died before writing the pages")
        store(self, ap)

    monkeypatch.setattr(LoRAManager, "store", fail_first)
    llm = make_llm(tiny_model_dir)
    eng, lora = llm.engine, LoRARequest("a0", 1, tiny_adapters[0])
    rid = eng.add_request([4, 5, 7], GREEDY, lora_request=lora)
    final = {}
    while eng.has_unfinished():
        for out in eng.step():
            final[out.request_id] = out
    assert "injected" in final[rid].error
    pager = eng.scheduler.adapters
    assert not pager.resident and eng.kv.num_page_blocks == 0 and eng.kv.pool.num_used == 0
    eng.core.check_integrity()
    out = llm.generate([[4, 5, 7]], GREEDY, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids
    assert out == peft_greedy(tiny_hf, tiny_adapters[0], [[4, 5, 7]], 6)[0] and calls == [1, 1]
    eng.core.check_integrity()
    eng.shutdown()


def test_adapter_pages_cross_to_a_worker_process(tiny_model_dir, tiny_hf, tiny_adapters):
    """With the worker in another process the packed weights travel in the step message and land in its pages."""
    llm = make_llm(tiny_model_dir, distributed_executor_backend="mp")
    loras = [LoRARequest(f"a{i}", i + 1, tiny_adapters[i]) for i in (0, 2)]
    outs = llm.generate([[3, 4, 5], [3, 4, 6]], GREEDY, use_tqdm=False, lora_request=loras)
    for o, lr, p in zip(outs, loras, ([3, 4, 5], [3, 4, 6])):
        assert o.outputs[0].token_ids == peft_greedy(tiny_hf, lr.lora_path, [p], 6)[0], lr
    llm.engine.core.check_integrity()
    llm.engine.shutdown()


def test_adapter_slots_come_out_of_the_kv_budget(tiny_model_dir):
    base = LLM(tiny_model_dir, dtype="float32", kv_cache_memory=4 << 20, block_size=16)
    lora = make_llm(tiny_model_dir, max_loras=4, max_lora_rank=16)
    cfg = base.engine.forward_pass.model.config
    slot_bytes = LoRASlots.bytes_for(LoRAShapes.of(cfg), 4, 16)
    assert slot_bytes == lora.engine.core.executor.worker.model_runner.lora.slots.num_bytes
    per_block = KVCache.bytes_per_block(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, "float32")
    assert base.engine.kv.pool.num_blocks - lora.engine.kv.pool.num_blocks == -(-slot_bytes // per_block)
    for e in (base, lora):
        e.engine.shutdown()


def test_lora_request_needs_enable_lora(tiny_model_dir, tiny_adapters):
    llm = LLM(tiny_model_dir, dtype="float32", kv_cache_memory=4 << 20, block_size=16)
    with pytest.raises(ValueError, match="without enable_lora"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, tiny_adapters[0]))
    assert llm.engine.kv.pool.num_used == 0 and not llm.engine.has_unfinished()
    llm.engine.shutdown()


def test_bad_adapter_refused_before_anything_runs(tiny_model_dir, tiny_adapters, bad_adapters):
    llm = make_llm(tiny_model_dir)
    good = LoRARequest("a0", 1, tiny_adapters[0])
    with pytest.raises(ValueError, match="weights file is broken"):
        llm.generate([[1, 2, 3], [4, 5, 6]], GREEDY, use_tqdm=False,
                     lora_request=[good, LoRARequest("bad", 9, bad_adapters["broken"])])
    assert not llm.engine.has_unfinished() and llm.engine.kv.pool.num_used == 0
    assert len(llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=good)[0].outputs[0].token_ids) == 6
    llm.engine.shutdown()
