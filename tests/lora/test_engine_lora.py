"""The engine with adapters: the prefix cache never shares KV across adapters, adapters page through a few
device slots under pressure with exact outputs and no leaks, and their slots come out of the KV budget."""

from __future__ import annotations

import pytest

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
    return LLM(model_dir, **{**opts, **kw})


def test_prefix_cache_is_per_adapter(tiny_model_dir, tiny_adapters):
    llm = make_llm(tiny_model_dir)
    a0, a1 = (LoRARequest(f"a{i}", i + 1, tiny_adapters[i]) for i in range(2))

    def cached(lora) -> int:
        return llm.generate([LONG], GREEDY, use_tqdm=False, lora_request=lora)[0].num_cached_tokens

    assert cached(None) == 0
    assert cached(a0) == 0  # the base model's blocks of the same prompt are not this adapter's KV
    assert cached(a1) == 0
    assert cached(a0) == 48 and cached(a1) == 48 and cached(None) == 48  # each hits its own
    llm.engine.shutdown()


def test_paging_under_pressure_exact_and_leak_free(tiny_model_dir, tiny_hf, tiny_adapters):
    """8 adapters through 2 device slots and 3 host copies: every output still equals HF + PEFT."""
    llm = make_llm(tiny_model_dir, max_loras=2, max_cpu_loras=3, max_num_seqs=4)
    prompts = [[7, 8, 9, 10 + i] for i in range(9)] * 2
    loras = [None] + [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(tiny_adapters)]
    per_prompt = loras * 2
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=per_prompt)
    for p, lr, o in zip(prompts, per_prompt, outs):
        assert o.outputs[0].token_ids == peft_greedy(tiny_hf, lr and lr.lora_path, [p], 6)[0], lr
    manager = llm.engine.core.executor.worker.model_runner.lora
    assert manager.num_loads > 8  # host copies were evicted and read again
    assert len(manager.slot_of) <= 2 and len(manager.host) <= 3
    assert llm.engine.kv.pool.num_used == 0
    llm.engine.core.check_integrity()
    llm.engine.shutdown()


def test_adapter_slots_come_out_of_the_kv_budget(tiny_model_dir):
    base = LLM(tiny_model_dir, dtype="float32", kv_cache_memory=4 << 20)
    lora = make_llm(tiny_model_dir, max_loras=4, max_lora_rank=16)
    cfg = base.engine.forward_pass.model.config
    slot_bytes = LoRASlots.bytes_for(LoRAShapes.of(cfg), 4, 16)
    assert slot_bytes == lora.engine.core.executor.worker.model_runner.lora.slots.num_bytes
    per_block = KVCache.bytes_per_block(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, "float32")
    assert base.engine.kv.pool.num_blocks - lora.engine.kv.pool.num_blocks == -(-slot_bytes // per_block)
    for e in (base, lora):
        e.engine.shutdown()


def test_lora_request_needs_enable_lora(tiny_model_dir, tiny_adapters):
    llm = LLM(tiny_model_dir, dtype="float32", kv_cache_memory=4 << 20)
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
