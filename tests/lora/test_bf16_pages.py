"""A bf16 model pages its adapters in bf16 (``lora.pages.page_dtype``: half the pages of float32 ones, as vLLM keeps
adapters in the model's dtype), and serves them as exactly as its own bf16 weights: token for token what HF + PEFT
compute on the same bf16-rounded weights and adapters."""

from __future__ import annotations

import copy

import torch
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from pagedllm.lora.adapter import LoRAShapes, load_adapter
from pagedllm.lora.pages import pack, packed_bytes
from pagedllm.protocol.lora_request import LoRARequest
from tests.lora.conftest import peft_greedy

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [[1, 5, 9, 200, 17, 42], [3, 4, 5], [77, 12, 9, 9, 300, 8, 2]]


def bf16_llm(model_dir: str) -> LLM:
    # float32 K/V: the model's matrices and adapters are what is rounded to bf16, nothing else
    return LLM(model_dir, enable_lora=True, max_loras=2, max_lora_rank=16, dtype="bfloat16",
               kv_cache_dtype="float32", kv_cache_memory=4 << 20, check_integrity=True)


def rounded(path: str, root) -> str:
    """A copy of the adapter at ``path`` with its A and B rounded to bf16 (stored as float32)."""
    import shutil

    out = root / ("bf16-" + path.rstrip("/").split("/")[-1])
    shutil.copytree(path, out)
    f = out / "adapter_model.safetensors"
    save_file({k: v.bfloat16().float() for k, v in load_file(str(f)).items()}, str(f))
    return str(out)


def test_bf16_model_pages_adapters_in_bf16(tiny_model_dir, tiny_adapters):
    llm = bf16_llm(tiny_model_dir)
    lora = LoRARequest("a2", 3, tiny_adapters[2])  # rank 16 on every target
    llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=lora)
    kv, cache = llm.engine.kv, llm.engine.forward_pass.kv_cache
    shapes = LoRAShapes.of(llm.engine.forward_pass.model.config)
    pages = kv.pages_of(("lora", 3))
    nbytes = packed_bytes(shapes, 16, torch.bfloat16)
    assert 2 * nbytes == packed_bytes(shapes, 16)
    assert len(pages) == -(-nbytes // cache.page_bytes) < -(-2 * nbytes // cache.page_bytes)
    stored = cache.read_pages(pages, nbytes).view(torch.bfloat16)
    assert torch.equal(stored.cpu(), pack(load_adapter(lora, shapes, 16), shapes).bfloat16())
    llm.engine.core.check_integrity()
    llm.engine.shutdown()


def test_bf16_adapters_match_hf_peft_on_the_same_rounded_weights(tiny_model_dir, tiny_hf, tiny_adapters, tmp_path,
                                                                  monkeypatch):
    """The model upcasts its bf16 matrices to compute in fp32 (as on every CPU without native bf16; forced here so
    the check is the same on any CPU). Adapters 0 and 2 scale by 2 (alpha / r, rsLoRA alpha / sqrt r): rounding B
    and then scaling is exact, so the reference is HF + PEFT in float32 on bf16-rounded matrices and adapters."""
    monkeypatch.setattr("pagedllm.models.llama.cpu_has_native_bf16", lambda: False)
    llm = bf16_llm(tiny_model_dir)
    assert llm.engine.forward_pass.model.upcast_matmuls
    hf = copy.deepcopy(tiny_hf)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:  # the matrices; norms stay float32 as the model keeps them when it upcasts
                p.copy_(p.bfloat16().float())
    loras = [LoRARequest(f"a{i}", i + 1, tiny_adapters[i]) for i in (0, 2)]
    per_prompt = [loras[0], loras[1], None]
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=per_prompt)
    for p, lr, o in zip(PROMPTS, per_prompt, outs):
        ref = None if lr is None else rounded(lr.lora_path, tmp_path)
        assert o.outputs[0].token_ids == peft_greedy(hf, ref, [p], 6)[0], lr
    llm.engine.core.check_integrity()
    llm.engine.shutdown()
