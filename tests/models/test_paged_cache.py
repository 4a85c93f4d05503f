"""PagedCache: an unmodified HF ``generate`` with its K/V in our block pool equals DynamicCache."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from pagedllm.kv.kv_cache import KVCache
from pagedllm.models.paged_cache import PagedCache, hf_cache_kwargs
from pagedllm.models.tiny import tiny_hf_model


def left_padded(prompts: list[list[int]], pad: int = 0):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def generate(hf, ids, mask, cache, **kw):
    return hf.generate(input_ids=ids, attention_mask=mask, **hf_cache_kwargs(hf, cache), do_sample=False,
                       eos_token_id=None, pad_token_id=0, **kw)


@pytest.fixture(scope="module")
def tiny():
    hf, _ = tiny_hf_model("llama3", max_positions=512)
    return hf


def prompts_of(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lens]


def test_tiny_batch_left_padding_equals_dynamic_cache(tiny):
    ids, mask = left_padded(prompts_of([1, 5, 16, 17, 40]))
    ref = generate(tiny, ids, mask, DynamicCache(), max_new_tokens=20)
    cache = PagedCache(tiny.config, num_blocks=80, block_size=4)
    out = generate(tiny, ids, mask, cache, max_new_tokens=20)
    assert torch.equal(out, ref)
    assert cache.get_seq_length() == ids.shape[1] + 19  # the last token is never fed back
    tables = cache.block_tables
    assert len(tables) == 5 and all(len(t) == -(-cache.get_seq_length() // 4) for t in tables)
    assert len({b for t in tables for b in t}) == sum(len(t) for t in tables)  # no block shared
    # the K/V really live in the pool: row 0's first token, layer 0, read through its block table
    k_pool = cache.kv_cache.layer(0)[0]
    assert torch.equal(k_pool[:, tables[0][0] * 4], cache.layers[0].keys[0, :, 0])


def test_tiny_logits_equal_dynamic_cache(tiny):
    ids, mask = left_padded(prompts_of([3, 30], seed=1))
    kw = dict(max_new_tokens=6, output_logits=True, return_dict_in_generate=True)
    ref = generate(tiny, ids, mask, DynamicCache(), **kw)
    out = generate(tiny, ids, mask, PagedCache(tiny.config, num_blocks=32, block_size=16), **kw)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        assert (a - b).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e5m2])
def test_a_quantized_pool_keeps_each_row_to_itself(tiny, dtype):
    """A batch in an int8 / fp8 pool: each row's logits are what it gets alone in that pool (its blocks and int8's
    per-block scales are its own), and the pool's rounding shows against DynamicCache."""
    prompts = prompts_of([20, 20], seed=3)
    kw = dict(max_new_tokens=6, output_logits=True, return_dict_in_generate=True)
    batch = generate(tiny, *left_padded(prompts), PagedCache(tiny.config, num_blocks=32, block_size=16, dtype=dtype),
                     **kw)
    for i, p in enumerate(prompts):
        alone = generate(tiny, *left_padded([p]), PagedCache(tiny.config, num_blocks=32, block_size=16, dtype=dtype),
                         **kw)
        assert torch.equal(batch.sequences[i], alone.sequences[0])
        for a, b in zip(batch.logits, alone.logits):
            assert (a[i] - b[0]).abs().max().item() < 1e-5
    ref = generate(tiny, *left_padded(prompts), DynamicCache(), **kw)
    assert max((a - b).abs().max().item() for a, b in zip(batch.logits, ref.logits)) > 1e-4


def test_beam_search_reorders_rows(tiny):
    """Beam search expands the batch and reorders rows every step (block copies in the pool)."""
    ids, mask = left_padded(prompts_of([7, 12], seed=2))
    ref = generate(tiny, ids, mask, DynamicCache(), max_new_tokens=8, num_beams=3)
    out = generate(tiny, ids, mask, PagedCache(tiny.config, num_blocks=128, block_size=4), max_new_tokens=8,
                   num_beams=3)
    assert torch.equal(out, ref)


def test_shared_pool_reset_and_out_of_blocks(tiny):
    kv = KVCache(2, 2, 16, 4, 4)
    cache = PagedCache(kv_cache=kv)
    ids, mask = left_padded(prompts_of([6]))
    generate(tiny, ids, mask, cache, max_new_tokens=3)
    assert cache.get_seq_length() == 8 and cache.block_tables == [[0, 1]]
    cache.reset()
    assert cache.get_seq_length() == 0 and len(cache.free_blocks) == 4
    with pytest.raises(RuntimeError, match="out of blocks"):
        generate(tiny, ids, mask, cache, max_new_tokens=20)


@pytest.mark.slow
def test_smollm2_generate_equals_dynamic_cache(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.padding_side = "left"
    texts = ["The capital of France is", "Once upon a time, in a small village near the mountains, there lived",
             "def fibonacci(n):"]
    enc = tok(texts, return_tensors="pt", padding=True)
    ref = hf.generate(**enc, max_new_tokens=12, do_sample=False, **hf_cache_kwargs(hf, DynamicCache()))
    cache = PagedCache(hf.config, num_blocks=64, block_size=16)
    out = hf.generate(**enc, max_new_tokens=12, do_sample=False, **hf_cache_kwargs(hf, cache))
    assert torch.equal(out, ref), (tok.batch_decode(out), tok.batch_decode(ref))
