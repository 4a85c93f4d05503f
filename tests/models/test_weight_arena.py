"""``models/weight_arena.py``: a CPU model's streamed matrices moved into one buffer (for 2 MB pages) keep their
values, formats and sharing, so every step computes the same bits; the engine's model is gathered at load."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention import AttentionMetadata, get_backend
from pagedllm.kv.kv_cache import KVCache
from pagedllm.models import weight_arena
from pagedllm.models.forward_pass import ForwardPass
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.quant import MATRICES, kernel_available


def _base(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_gather_copies_each_tensor_into_one_aligned_buffer():
    gen = torch.Generator().manual_seed(0)
    ts = [torch.randn(3, 5, generator=gen), torch.randint(0, 255, (7,), dtype=torch.uint8, generator=gen),
          torch.randn(2, 9, generator=gen).bfloat16(), torch.randn(4, generator=gen).double()]
    out = weight_arena.gather(ts)
    assert len({_base(t) for t in out}) == 1  # one buffer
    for src, dst in zip(ts, out):
        assert dst.dtype == src.dtype and dst.shape == src.shape and torch.equal(dst, src)
        assert dst.data_ptr() % weight_arena.ALIGN == 0 and dst.data_ptr() != src.data_ptr()
    ends = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in out)
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))  # no overlap
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        weight_arena.gather([torch.randn(4, 4).t()])


def _streamed(model: LlamaForCausalLM) -> list[torch.Tensor]:
    """Every streamed tensor of the model's embedding, LM head and layer matrices, slot by slot."""
    slots = [model.embed, model.lm_head, *(getattr(layer, a) for layer in model.layers for a in MATRICES)]
    return [t for w in slots for t in weight_arena.streamed_tensors(w)]


def _greedy_logits(model: LlamaForCausalLM, prompt: list[int], steps: int) -> torch.Tensor:
    """A prefill, then one-token decode steps (the fused batch-1 layers where they apply): their logits."""
    cfg = model.config
    runner = ForwardPass(model, KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4, 16), get_backend("cpu"))
    ids, out = list(prompt), []
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [[0, 1]], 16)
    logits = model.compute_logits(model(torch.tensor(ids), meta.positions, runner.kv_cache, meta, runner.backend))
    for _ in range(steps):
        out.append(logits[-1:])
        ids.append(int(logits[-1].argmax()))
        meta = AttentionMetadata.build([1], [len(ids)], [[0, 1]], 16)
        h = model(torch.tensor(ids[-1:]), meta.positions, runner.kv_cache, meta, runner.backend)
        logits = model.compute_logits(h)
    return torch.cat(out)


@pytest.mark.skipif(not kernel_available(), reason="needs the GGUF block kernel")
@pytest.mark.parametrize("quantization", ["gguf", "gguf-bf16", "gguf-bf16 unpacked", "gguf-a8"])
def test_a_gathered_model_computes_the_same_bits(quantization, monkeypatch):
    """``gguf-bf16 unpacked``: bf16 copies without our kernel's packing, as on a CPU without native bf16 (Zen 3),
    where the copy is a plain bf16 matrix that stays where it is."""
    from pagedllm.models import bf16_gemm
    from pagedllm.models.loader import load_checkpoint

    if quantization == "gguf-a8" and not kernel_available(int8_activations=True):
        pytest.skip("needs the int8 kernel")
    if quantization == "gguf-bf16 unpacked":
        monkeypatch.setattr(bf16_gemm, "packed_copy_available", lambda: False)
        quantization = "gguf-bf16"
    ckpt = load_checkpoint(None)
    loaded = LlamaForCausalLM.from_checkpoint(ckpt, torch.float32, quantization)
    gathered = LlamaForCausalLM.from_checkpoint(ckpt, torch.float32, quantization)
    before = _streamed(gathered)
    moved = gathered.gather_weights()
    after = _streamed(gathered)
    assert moved == sum(t.numel() * t.element_size() for t in {id(t): t for t in after}.values())
    assert len({_base(t) for t in after}) == 1 and len(after) == len(before)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(after, before))
    shared = [[a is b for b in before] for a in before]  # a tied head reads the embedding's blocks: still shared
    assert [[a is b for b in after] for a in after] == shared
    assert (gathered.lm_head is gathered.embed) == (loaded.lm_head is loaded.embed)
    base = _base(after[0])
    for layer in (gathered.layers[0], gathered.layers[-1]):  # blocks (or a8's packing) and a packed bf16 copy
        assert _base(layer.qkv_weight.data) == _base(layer.down_weight.data) == base
        copy = layer.gate_up_weight.bf16
        assert (copy is None) == (quantization != "gguf-bf16")
        assert copy is None or copy.amx is None or _base(copy.amx) == base
    prompt = ckpt.tokenizer("The capital of France is")["input_ids"]
    assert torch.equal(_greedy_logits(gathered, prompt, 6), _greedy_logits(loaded, prompt, 6))


@pytest.mark.skipif(not kernel_available(), reason="needs the GGUF block kernel")
def test_the_heap_is_trimmed_once_the_old_copies_are_freed(monkeypatch):
    """The old copies' memory can only go back to the OS once nothing holds them: by the time the heap is trimmed,
    every one of them is gone."""
    import weakref

    from pagedllm.models.loader import load_checkpoint

    model = LlamaForCausalLM.from_checkpoint(load_checkpoint(None), torch.float32, "gguf-bf16")
    old = [weakref.ref(t) for t in _streamed(model)]
    alive_at_trim = []
    monkeypatch.setattr(weight_arena, "trim_heap", lambda: alive_at_trim.append(sum(r() is not None for r in old)))
    assert model.gather_weights() > 0
    assert alive_at_trim == [0]


@pytest.mark.skipif(not kernel_available(), reason="needs the GGUF block kernel")
def test_turned_off_it_moves_nothing(monkeypatch):
    from pagedllm.models.loader import load_checkpoint

    monkeypatch.setattr(weight_arena, "ENABLED", False)
    model = LlamaForCausalLM.from_checkpoint(load_checkpoint(None), torch.float32, "gguf")
    before = [t.data_ptr() for t in _streamed(model)]
    assert model.gather_weights() == 0 and [t.data_ptr() for t in _streamed(model)] == before


@pytest.mark.skipif(not kernel_available(), reason="needs the GGUF block kernel")
def test_the_engines_cpu_model_is_gathered_at_load_and_generates_what_it_did_before(monkeypatch):
    """An engine's model is gathered by its worker; its batch of greedy outputs (batch-1 steps at the end, as the
    requests finish) are those of an engine whose matrices stay as loaded, and the pool is whole and empty after."""
    from pagedllm import LLM, SamplingParams

    prompts = [[5, 6, 7, 8, 9], [100, 200, 300], list(range(40, 70))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 5, 8)]
    outs = {}
    for on in (True, False):
        monkeypatch.setattr(weight_arena, "ENABLED", on)
        llm = LLM(dtype="float32", seed=0, num_blocks=16)
        try:
            assert (len({_base(t) for t in _streamed(llm.engine.forward_pass.model)}) == 1) == on
            outs[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            llm.engine.kv.check_integrity()
            assert llm.engine.kv.stats()["used"] == 0
        finally:
            llm.engine.shutdown()
    assert outs[True] == outs[False] and [len(o) for o in outs[True]] == [12, 5, 8]


@pytest.mark.skipif(not kernel_available(), reason="needs the GGUF block kernel")
def test_a_separate_draft_model_is_gathered_too():
    from pagedllm.models.loader import load_checkpoint, resolve_model_dir
    from pagedllm.spec_decode.draft_model import load_draft

    target = LlamaForCausalLM.from_checkpoint(load_checkpoint(None), torch.float32, "gguf")
    draft = load_draft(resolve_model_dir(None), target)
    assert draft.quantization == "gguf" and len({_base(t) for t in _streamed(draft)}) == 1
