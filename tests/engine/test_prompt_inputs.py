"""``LLM.generate`` takes vLLM's prompt forms: text, token ids, and dicts of either, alone or in lists."""

from __future__ import annotations

import pytest

from pagedllm.frontend.prompt_inputs import normalize_prompts
from pagedllm.protocol.sampling_params import SamplingParams


def test_forms_normalize():
    assert normalize_prompts("hi") == ["hi"]
    assert normalize_prompts([1, 2]) == [[1, 2]]
    assert normalize_prompts({"prompt_token_ids": [1, 2]}) == [[1, 2]]
    assert normalize_prompts([{"prompt": "a"}, {"prompt_token_ids": [3]}, "b", [4]]) == ["a", [3], "b", [4]]


@pytest.mark.parametrize("bad, match", [
    ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one"), ({}, "exactly one"),
    ({"prompt": [1]}, "'prompt' must be a string"), ({"prompt_token_ids": "12"}, "list of integers"),
    ({"prompt": "a", "multi_modal_data": {}}, "unsupported keys"),
])
def test_bad_dicts_name_the_problem(bad, match):
    with pytest.raises(ValueError, match=match):
        normalize_prompts([bad])


def test_generate_dict_prompts_match_plain_ones(tiny_model_dir):
    from pagedllm import LLM

    llm = LLM(tiny_model_dir, num_blocks=64, max_num_seqs=4)
    ids = llm.tokenizer.encode("The capital of France is")
    params = SamplingParams(temperature=0, max_tokens=4)
    plain = llm.generate(["The capital of France is", ids], params, use_tqdm=False)
    dicts = llm.generate([{"prompt": "The capital of France is"}, {"prompt_token_ids": ids}], params, use_tqdm=False)
    one = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in dicts] == [ids, ids] == [o.prompt_token_ids for o in plain]
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert one[0].outputs[0].token_ids == plain[1].outputs[0].token_ids
