"""The embedded SmolLM2-135M with 8 PEFT adapters (random A and B, every target) and the base model in one mixed
batch: each greedy output is token-identical to HF transformers + PEFT with that adapter (fp32)."""

from __future__ import annotations

from pagedllm import LLM, SamplingParams
from pagedllm.protocol.lora_request import LoRARequest
from tests.lora.conftest import peft_greedy

N_NEW = 8
TEXTS = ["The capital of France is", "def fibonacci(n):\n    "]


def test_eight_adapters_mixed_match_peft(smollm2_dir, hf_with_adapters):
    smol_hf, smol_adapters = hf_with_adapters(smollm2_dir, 200)
    llm = LLM(smollm2_dir, enable_lora=True, max_loras=8, max_lora_rank=16, dtype="float32", kv_cache_memory=256 << 20,
              check_integrity=True)
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    loras = [None] + [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(smol_adapters)]
    per_prompt = [lr for lr in loras for _ in prompts]
    outs = llm.generate([p for _ in loras for p in prompts], SamplingParams(max_tokens=N_NEW, temperature=0,
                                                                            ignore_eos=True),
                        use_tqdm=False, lora_request=per_prompt)
    got = [o.outputs[0].token_ids for o in outs]
    runs = []
    for k, lr in enumerate(loras):
        mine = got[k * len(prompts):(k + 1) * len(prompts)]
        assert mine == peft_greedy(smol_hf, lr and lr.lora_path, prompts, N_NEW), lr
        runs.append(tuple(map(tuple, mine)))
    assert len(set(runs)) == len(loras)  # every adapter changes the output
    assert llm.engine.kv.pool.num_used == llm.engine.kv.num_page_blocks > 0  # only the resident adapters stay
    llm.engine.core.check_integrity()
    llm.engine.shutdown()
