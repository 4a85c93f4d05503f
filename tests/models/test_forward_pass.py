"""ForwardPass: ordering, logits only where needed, copy-on-write copies applied first."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention import get_backend
from pagedllm.kv.kv_cache import KVCache
from pagedllm.models.forward_pass import ForwardPass, SeqChunk, greedy_generate
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.tiny import tiny_hf_model

BS = 16


@pytest.fixture(scope="module")
def model():
    hf, cfg = tiny_hf_model("qwen2", max_positions=512)
    m = LlamaForCausalLM(cfg)
    m.load_hf_state_dict(hf.state_dict())
    return m


def runner_for(model, num_blocks=64):
    cfg = model.config
    return ForwardPass(model, KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks, BS),
                       get_backend("reference"))


def toks(n, seed):
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_mixed_batch_in_input_order_equals_separate_runs(model):
    """Prefills and decodes given in any order come back in input order, one row per chunk
    needing logits, equal to running each chunk on its own."""
    a, b, c, d = toks(40, 1), toks(9, 2), toks(70, 3), toks(5, 4)
    tabs = {"a": [0, 1, 2], "b": [3], "c": [4, 5, 6, 7, 8], "d": [9]}
    # b and d already have all but their last token cached
    solo = runner_for(model)
    solo.execute([SeqChunk(b[:-1], 0, tabs["b"], False), SeqChunk(d[:-1], 0, tabs["d"], False)])
    exp_a = solo.execute([SeqChunk(a, 0, tabs["a"])])[0]
    exp_b = solo.execute([SeqChunk(b[-1:], 8, tabs["b"])])[0]
    exp_d = solo.execute([SeqChunk(d[-1:], 4, tabs["d"])])[0]

    r = runner_for(model)
    r.execute([SeqChunk(b[:-1], 0, tabs["b"], False), SeqChunk(d[:-1], 0, tabs["d"], False)])
    calls = []
    orig = model.compute_logits
    model.compute_logits = lambda h: calls.append(h.shape[0]) or orig(h)
    try:
        out = r.execute([
            SeqChunk(a, 0, tabs["a"]),
            SeqChunk(b[-1:], 8, tabs["b"]),
            SeqChunk(c[:30], 0, tabs["c"], needs_logits=False),  # a non-final prefill chunk
            SeqChunk(d[-1:], 4, tabs["d"]),
        ])
    finally:
        del model.compute_logits
    assert calls == [3]  # lm_head ran on 3 rows only, never the whole prefill
    assert out.dtype == torch.float32 and out.shape == (3, model.config.vocab_size)
    assert r.last_step.num_decodes == 2 and r.last_step.num_tokens == 40 + 1 + 30 + 1
    for got, exp in zip(out, (exp_a, exp_b, exp_d)):
        assert (got - exp).abs().max().item() < 1e-5


def test_copy_on_write_copies_are_applied_before_the_step(model):
    """A forked sequence shares the parent's full block and gets a copy of its partial block
    (the (src, dst) copy given to execute); its decode equals the parent's."""
    p = toks(20, 7)  # block 0 full, block 1 holds 4 tokens
    r = runner_for(model)
    r.execute([SeqChunk(p, 0, [0, 1], needs_logits=False)])
    nxt = 42
    parent = r.execute([SeqChunk([nxt], 20, [0, 1])])[0]
    # the child forked before the parent's decode: its partial block 1 must be copied to 5 first
    r2 = runner_for(model)
    r2.execute([SeqChunk(p, 0, [0, 1], needs_logits=False)])
    out = r2.execute([SeqChunk([nxt], 20, [0, 1]), SeqChunk([nxt], 20, [0, 5])], copies=[(1, 5)])
    assert (out[0] - parent).abs().max().item() < 1e-5
    assert (out[1] - parent).abs().max().item() < 1e-5
    # without the copy the child would attend to garbage in block 5
    r3 = runner_for(model)
    r3.execute([SeqChunk(p, 0, [0, 1], needs_logits=False)])
    bad = r3.execute([SeqChunk([nxt], 20, [0, 5])])[0]
    assert (bad - parent).abs().max().item() > 1e-3


def test_empty_and_no_logit_steps(model):
    r = runner_for(model)
    assert r.execute([]).shape == (0, model.config.vocab_size)
    assert r.execute([SeqChunk(toks(10, 8), 0, [0], needs_logits=False)]).shape == (0, model.config.vocab_size)
    with pytest.raises(ValueError):
        r.execute([SeqChunk([], 0, [0])])


def test_greedy_generate_batch_equals_one_by_one(model):
    prompts = [toks(n, 10 + n) for n in (1, 16, 33)]
    batch = greedy_generate(runner_for(model), prompts, 6)
    alone = [greedy_generate(runner_for(model), [p], 6)[0] for p in prompts]
    assert batch == alone
    with pytest.raises(ValueError, match="blocks"):
        greedy_generate(runner_for(model, num_blocks=2), prompts, 6)
