"""Scale-out fixtures: tiny engines and a greedy driver for an engine core."""

from __future__ import annotations

import pytest

from pagedllm.engine.args import EngineArgs
from pagedllm.engine.core_io import EngineCoreRequest
from pagedllm.engine.sampling_params import SamplingParams

MAX_TOKENS = 8


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="session")
def tiny_args(tiny_model_dir) -> EngineArgs:
    return EngineArgs(model=tiny_model_dir, num_blocks=48, dtype="float32", seed=0)


def run_core(core, request_id: str, prompt: list[int], salt: str | None = None) -> list[int]:
    """Greedy tokens of one request run alone on an engine core."""
    core.add_request(EngineCoreRequest(request_id, prompt, greedy(), salt))
    tokens: list[int] = []
    while core.has_unfinished():
        for out in core.step():
            for d in out.seqs:
                tokens += d.new_token_ids
    return tokens


def prompts(num: int, prefix_len: int = 40, seed: int = 0) -> list[list[int]]:
    """``num`` prompts sharing one ``prefix_len``-token prefix, each with its own tail."""
    prefix = [(seed * 7919 + 31 * i) % 5000 + 100 for i in range(prefix_len)]
    return [prefix + [6000 + 13 * j + k for k in range(3 + j % 4)] for j in range(num)]
