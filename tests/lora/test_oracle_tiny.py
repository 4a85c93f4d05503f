"""8 adapters and the base model in one mixed batch: each adapter's greedy output is token-identical to
HF transformers + PEFT with that adapter (fp32), on a tiny random Llama."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.protocol.lora_request import LoRARequest
from tests.lora.conftest import peft_greedy

N_NEW = 12
PROMPTS = [[1, 5, 9, 200, 17], list(range(30, 70)), [3] * 17, [400, 12, 7, 7, 1000, 33, 2, 9]]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    llm = LLM(tiny_model_dir, enable_lora=True, max_loras=8, max_lora_rank=16, dtype="float32",
              kv_cache_memory=4 << 20, block_size=16, check_integrity=True)
    yield llm
    llm.engine.shutdown()


def test_mixed_batch_matches_peft(llm, tiny_hf, tiny_adapters):
    loras = [None] + [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(tiny_adapters)]
    prompts = [p for _ in loras for p in PROMPTS]
    per_prompt = [lr for lr in loras for _ in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True),
                        use_tqdm=False, lora_request=per_prompt)
    got = [o.outputs[0].token_ids for o in outs]
    for k, lr in enumerate(loras):
        want = peft_greedy(tiny_hf, None if lr is None else lr.lora_path, PROMPTS, N_NEW)
        mine = got[k * len(PROMPTS):(k + 1) * len(PROMPTS)]
        assert mine == want, f"adapter {lr and lr.lora_name}: {mine} != HF+PEFT {want}"
    # the adapters really change the output: the 9 runs of the 4 prompts are all different
    assert len({tuple(map(tuple, got[k * len(PROMPTS):(k + 1) * len(PROMPTS)])) for k in range(len(loras))}) == 9
    assert llm.engine.kv.pool.num_used == llm.engine.kv.num_page_blocks > 0  # KV blocks back; adapter pages stay
    llm.engine.core.check_integrity()
