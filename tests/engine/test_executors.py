"""The worker boundary: plain-data steps that survive pickling, and the worker in a child process
giving exactly the in-process worker's outputs; a dead worker is an error, never a hang."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config.args import EngineArgs
from pagedllm.config.device import resolve_device, resolve_dtype
from pagedllm.protocol.step_io import (Logprobs, ModelRunnerOutput, NewSeqData, ScheduledSeq, SchedulerOutput,
                                     SeqOutput, decode, encode)


def test_step_messages_round_trip():
    so = SchedulerOutput(forks=[(1, 2, 1)], finished_seq_ids=[7], new_seqs=[NewSeqData(3, [1, 2, 3], 3, SamplingParams(n=2))],
                         scheduled=[ScheduledSeq(3, 0, 3, [], 0, [5, 6], True, num_samples=2)],
                         swap_out=[(1, 2)], swap_in=[(2, 1)], copies=[(4, 5)])
    assert decode(encode(so)) == so
    lp = Logprobs(torch.tensor([[5, 1]]), torch.tensor([[-0.5, -1.0]]))
    ro = ModelRunnerOutput([SeqOutput(3, [5, 9], [-0.5, -2.0], top_logprobs=lp)])
    back = decode(encode(ro))
    assert back.outputs[0].token_ids == [5, 9] and torch.equal(back.outputs[0].top_logprobs.logprobs, lp.logprobs)
    with pytest.raises(TypeError):
        decode(encode({"not": "a step"}))  # type: ignore[arg-type]


def test_device_and_dtype_resolution(monkeypatch):
    from pagedllm.config import device as device_config

    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            resolve_device("cuda")
    for has_bf16, want in ((True, torch.bfloat16), (False, torch.float16)):  # a CUDA device never gets the CPU's choice
        monkeypatch.setattr(device_config, "cuda_has_bf16", lambda device, v=has_bf16: v)
        assert resolve_dtype("auto", "cuda") == want
    with pytest.raises(ValueError, match="device"):
        resolve_device("tpu")


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    uni = LLM(tiny_model_dir, kv_cache_memory=32 << 20, check_integrity=True)
    mp = LLM(tiny_model_dir, kv_cache_memory=32 << 20, check_integrity=True, distributed_executor_backend="mp")
    yield uni, mp
    mp.engine.shutdown()


def test_multiprocess_worker_equals_in_process(engines, wiki_texts):
    uni, mp = engines
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True, logprobs=2),
              SamplingParams(use_beam_search=True, beam_width=3, n=2, temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2, repetition_penalty=1.3)]
    prompts = wiki_texts[:4]
    a = uni.generate(prompts, params, use_tqdm=False)
    b = mp.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b):
        assert [o.token_ids for o in x.outputs] == [o.token_ids for o in y.outputs]
        assert [o.logprobs for o in x.outputs] == [o.logprobs for o in y.outputs]
        assert x.prompt_logprobs == y.prompt_logprobs
    assert len(a[3].prompt_logprobs) == len(a[3].prompt_token_ids) and a[3].prompt_logprobs[0] is None


def test_dead_worker_process_is_an_error(tiny_model_dir):
    from pagedllm.protocol.errors import WorkerError

    llm = LLM(tiny_model_dir, kv_cache_memory=16 << 20, distributed_executor_backend="mp")
    os.kill(llm.engine.core.executor.pid, signal.SIGKILL)
    with pytest.raises(WorkerError, match="died"):
        llm.generate(["hello"], SamplingParams(max_tokens=3), use_tqdm=False)
    llm.engine.shutdown()


def test_unknown_executor_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        LLM(tiny_model_dir, distributed_executor_backend="ray-someday")
    assert EngineArgs().device == "auto"
