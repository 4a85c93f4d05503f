"""LoRA under tensor parallelism: each rank's adapter shard (``lora.sharding``) adds up to the whole adapter's
delta, and a TP=2 engine serving 3 adapters and the base model in one batch is greedy token-identical to TP=1
and to HF + PEFT (fp32), with the pool's invariants held on the way."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.lora.adapter import GROUPS, LoRAAdapter, LoRALoadError, LoRAShapes
from pagedllm.lora.pages import pack, unpack
from pagedllm.lora.sharding import AdapterShard
from pagedllm.models.config import ModelConfig
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.sharding import ShardPlan, shard_model
from pagedllm.protocol.lora_request import LoRARequest
from tests.lora.conftest import peft_greedy

N_NEW = 8
PROMPTS = [[1, 5, 9, 200, 17], list(range(30, 58)), [400, 12, 7, 7, 1000, 33, 2, 9]]


def group_delta(packed, x: torch.Tensor) -> torch.Tensor:
    """``x [T, in]`` through a packed group's A and each target's B (``lora.pages.unpack``): its fused output delta."""
    a, bs = packed
    return torch.cat([x @ a[t].double().t() @ b.double() for t, b in enumerate(bs)], dim=1)


def base_shard_index(cfg: ModelConfig, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """Which fused output rows (qkv, gate_up) and input columns (o, down) the base model's shard of ``rank`` keeps
    (``models.sharding.shard_model`` on weights holding their own row / column numbers): the adapter's oracle."""
    model = LlamaForCausalLM(cfg)
    layer = model.layers[0]
    with torch.no_grad():
        for name in ("qkv_weight", "gate_up_weight"):
            getattr(layer, name)[:, 0] = torch.arange(getattr(layer, name).shape[0])
        for name in ("o_weight", "down_weight"):
            getattr(layer, name)[0] = torch.arange(getattr(layer, name).shape[1])
    layer = shard_model(model, SimpleNamespace(rank=rank, world_size=world_size)).layers[0]
    return {"qkv": layer.qkv_weight[:, 0].long(), "gate_up": layer.gate_up_weight[:, 0].long(),
            "o": layer.o_weight[0].long(), "down": layer.down_weight[0].long()}


@pytest.mark.parametrize("world_size", [2, 4])  # 4 > the 2 KV heads: each rank holds one replicated KV head
def test_shards_add_up_to_the_whole_delta(world_size):
    """Column-parallel: a rank's delta is the whole delta's rows its base shard keeps; row-parallel: the ranks'
    partial deltas, each over the input columns its base shard keeps, sum to the whole (the all-reduce)."""
    cfg = ModelConfig("LlamaForCausalLM", vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16)
    full = LoRAShapes.of(cfg)
    torch.manual_seed(0)
    rank = 3  # divides nothing: the rank is never cut
    adapter = LoRAAdapter(1, "a", rank, 1.0, {(layer, t): (torch.randn(rank, i), torch.randn(o, rank))
                                             for layer in range(2) for t, (o, i) in full.shapes.items()})
    flat = pack(adapter, full)
    whole = unpack(flat, full, rank)
    shards = [AdapterShard.of(full, ShardPlan.of(cfg, r, world_size), cfg.head_dim) for r in range(world_size)]
    parts = [unpack(s.take(flat, rank), s.shapes, rank) for s in shards]
    base = [base_shard_index(cfg, r, world_size) for r in range(world_size)]
    x = torch.randn(5, 128, dtype=torch.float64)
    for layer in range(2):
        for g, targets in GROUPS.items():
            cols = full.shapes[targets[0]][1]
            want = group_delta(whole[layer][g], x[:, :cols])
            if g in ("qkv", "gate_up"):
                for b, p in zip(base, parts):
                    torch.testing.assert_close(group_delta(p[layer][g], x[:, :cols]), want[:, b[g]])
            else:
                torch.testing.assert_close(sum(group_delta(p[layer][g], x[:, b[g]]) for b, p in zip(base, parts)), want)
    assert all(s.shapes == shards[0].shapes for s in shards)  # the core counts one rank's pages for all
    half = shards[-1].take(pack(adapter, full, torch.bfloat16), rank)  # bf16 pages are cut the same way
    assert half.dtype == torch.bfloat16 and torch.equal(half, shards[-1].take(flat, rank).bfloat16())


def test_tp2_mixed_batch_equals_tp1_and_peft(tiny_model_dir, tiny_hf, tiny_adapters, bad_adapters):
    # adapters 0 (all targets, r=8), 2 (all targets, rsLoRA r=16), 3 (only the row-parallel o and down)
    loras = [None] + [LoRARequest(f"a{i}", i + 1, tiny_adapters[i]) for i in (0, 2, 3)]
    prompts = [p for _ in loras for p in PROMPTS]
    per_prompt = [lr for lr in loras for _ in PROMPTS]
    params = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True)
    kw = {"device": "cpu", "enable_lora": True, "max_loras": 3, "max_lora_rank": 16, "dtype": "float32", "kv_cache_memory": 4 << 20,
          "block_size": 16, "check_integrity": True}
    one = LLM(tiny_model_dir, **kw)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)]
    one.engine.shutdown()
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, **kw)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)]
    assert got == want
    for k, lr in enumerate(loras):
        peft = peft_greedy(tiny_hf, None if lr is None else lr.lora_path, PROMPTS, N_NEW)
        assert got[k * len(PROMPTS):(k + 1) * len(PROMPTS)] == peft, f"adapter {lr and lr.lora_name}"
    assert len({tuple(map(tuple, got[k * len(PROMPTS):(k + 1) * len(PROMPTS)])) for k in range(len(loras))}) == 4
    kv = llm.engine.kv
    assert kv.pool.num_used == kv.num_page_blocks > 0  # KV blocks back; the resident adapters' pages stay
    llm.engine.core.check_integrity()
    # an adapter made for another base model is refused by name; the TP engine goes on serving
    with pytest.raises(LoRALoadError, match="another base model"):
        llm.generate([[1, 2, 3]], params, use_tqdm=False, lora_request=LoRARequest("bad", 9, bad_adapters["shape"]))
    again = llm.generate(PROMPTS[:1], params, use_tqdm=False, lora_request=loras[1])
    assert again[0].outputs[0].token_ids == got[len(PROMPTS)]
    assert kv.pool.num_used == kv.num_page_blocks
    llm.engine.shutdown()
