"""Async scheduling with decode graphs: a step's sampled ids stay on the device while the next step launches
(``DeferredOutput``), the next step's inputs take them there, and the host waits for them only afterwards.
No GPU here: the capture is the CPU stand-in of ``test_cuda_graphs`` (replay re-runs the step on the same
buffers), and ``HostCopy`` on the CPU clones at launch, as the device's queued copy would snapshot them."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from pagedllm import LLM, SamplingParams
from pagedllm.worker import cuda_graphs, model_runner
from pagedllm.worker.device_check import _target_of_to
from pagedllm.worker.host_copy import HostCopy
from tests.worker.test_cuda_graphs import RerunCapture


class LoggedCopy(HostCopy):
    """Records when each step's copy starts and when the host waits for it."""

    log: list[tuple[str, int]] = []

    def __init__(self, *tensors) -> None:
        super().__init__(*tensors)
        self.n = sum(1 for e in LoggedCopy.log if e[0] == "start")
        LoggedCopy.log.append(("start", self.n))

    def wait(self):
        LoggedCopy.log.append(("wait", self.n))
        return super().wait()


PROMPTS = [[5, 17, 300, 42] * 3, [7, 8, 9], [100, 200, 300, 400, 500], [9, 9, 9, 9]]
PARAMS = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=3, max_tokens=5, ignore_eos=True),
          SamplingParams(temperature=1.2, seed=4, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=7, stop_token_ids=[0], ignore_eos=False)]
KW = dict(device="cpu", attention_backend="cpu", kv_cache_memory=4 << 20, max_num_batched_tokens=16, max_num_seqs=4,
          check_integrity=True)


def _run(llm: LLM, prompts=PROMPTS, params=PARAMS):
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].cumulative_logprob)
            for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture()
def graphs_on(monkeypatch):
    monkeypatch.setattr(cuda_graphs, "graph_capture", lambda device: RerunCapture())
    monkeypatch.setattr(model_runner, "HostCopy", LoggedCopy)
    LoggedCopy.log = []


def test_deferred_decode_steps_equal_the_synchronous_engine_and_launch_before_the_wait(tiny_model_dir, graphs_on):
    eager = LLM(tiny_model_dir, enforce_eager=True, async_scheduling=False, block_size=16, **KW)
    want = _run(eager)
    llm = LLM(tiny_model_dir, async_scheduling=True, block_size=16, **KW)
    assert llm.engine.core.executor.defers
    got = _run(llm)
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert [g[2] for g in got] == pytest.approx([w[2] for w in want], abs=1e-4)
    log = LoggedCopy.log
    waits = {n: log.index(("wait", n)) for _, n in log if ("wait", n) in log}
    starts = {n: log.index(("start", n)) for _, n in log}
    assert set(waits) == set(starts)  # every step's ids were taken in the end
    # overlap: step n's ids were waited for only after step n+1 had been launched (its copy queued)
    overlapped = [n for n in starts if n + 1 in starts and waits[n] > starts[n + 1]]
    assert len(overlapped) >= 5, log
    assert llm.engine.kv.stats()["used"] == 0
    assert llm.engine.core.executor.worker.model_runner._deferred is None or \
        llm.engine.core.executor.worker.model_runner._deferred.settled


def test_sync_engine_never_defers(tiny_model_dir, graphs_on):
    """Without async scheduling a graph step's ids are waited for before the step returns."""
    llm = LLM(tiny_model_dir, async_scheduling=False, block_size=16, **KW)
    _run(llm)
    log = LoggedCopy.log
    assert log and all(log[i] == ("start", n) and log[i + 1] == ("wait", n)
                       for i, (kind, n) in enumerate(log) if kind == "start")


def test_rows_that_change_under_a_deferred_step_get_its_ids_first(tiny_model_dir, graphs_on):
    """Requests arriving and finishing while steps are deferred (rows dropped and reused), a preempting small
    pool, and a step that must sample on the host (top-k with logprobs) after deferred ones: all equal the
    synchronous engine, and no block leaks."""
    prompts = [[11 + i, 12, 13 + i] * (1 + i % 3) for i in range(10)]
    params = [SamplingParams(temperature=0.9 if i % 2 else 0, seed=i, max_tokens=3 + 4 * i, ignore_eos=True,
                             top_k=20 if i == 7 else -1, logprobs=2 if i == 7 else None) for i in range(10)]
    kw = dict(KW, num_blocks=8, kv_cache_memory=None)
    sync = LLM(tiny_model_dir, async_scheduling=False, block_size=16, **kw)
    want = _run(sync, prompts, params)
    llm = LLM(tiny_model_dir, async_scheduling=True, block_size=16, **kw)
    got = _run(llm, prompts, params)
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert llm.engine.kv.stats()["used"] == 0
    assert llm.engine.stats.num_preemptions or sync.engine.stats.num_preemptions


class BlockingUploadCheck(TorchFunctionMode):
    """Fails any upload that would make the host wait for the device queue (``Tensor.to(device)`` without
    ``non_blocking=True``, ``torch.tensor(data, device=...)``): inside a deferred step such a copy waits for the
    step in flight and undoes the overlap. On a CPU these calls are no-ops, so the check is of the call alone."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and _target_of_to(args, kwargs) is not None and not kwargs.get("non_blocking"):
            raise AssertionError(f"blocking Tensor.to({_target_of_to(args, kwargs)}) inside a deferred step")
        if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None:
            raise AssertionError(f"torch.{func.__name__}(..., device=) uploads blocking inside a deferred step")
        if func is torch.Tensor.cuda:
            raise AssertionError("Tensor.cuda() uploads blocking inside a deferred step")
        return func(*args, **kwargs)


def test_the_deferred_path_uploads_without_waiting(tiny_model_dir, graphs_on, monkeypatch):
    """The graph step and the hand-over of the last step's ids make no upload that waits for the device queue;
    the check itself fires on a blocking one."""
    checked = []
    for name in ("_graph_step", "_take_pending"):
        original = getattr(model_runner.ModelRunner, name)

        def under_check(self, *a, _original=original, _name=name, **kw):
            checked.append(_name)
            with BlockingUploadCheck():
                return _original(self, *a, **kw)

        monkeypatch.setattr(model_runner.ModelRunner, name, under_check)
    llm = LLM(tiny_model_dir, async_scheduling=True, block_size=16, **KW)
    _run(llm)  # a blocking upload fails its requests (the step's error reaches generate)
    assert {"_graph_step", "_take_pending"} <= set(checked)
    with pytest.raises(AssertionError, match="blocking"), BlockingUploadCheck():
        torch.zeros(2).to("cpu")


def test_a_batch_grown_inside_a_step_takes_deferred_ids_outside_it(tiny_model_dir, graphs_on, monkeypatch):
    """More running rows than the batch starts with: its row tensors grow inside a step (under inference mode),
    and the deferred ids are recorded later from the core, outside it. An H200's ``bench gpu`` (256 requests) failed
    there with "Inplace update to inference tensor outside InferenceMode"."""
    from pagedllm.worker import input_batch

    monkeypatch.setattr(input_batch.InputBatch.__init__, "__defaults__", (2,))  # initial_rows: grow at the 3rd row
    prompts = [[20 + i, 21, 22 + i] for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True) for i in range(6)]
    kw = dict(KW, max_num_seqs=6)
    want = _run(LLM(tiny_model_dir, async_scheduling=False, block_size=16, **kw), prompts, params)
    llm = LLM(tiny_model_dir, async_scheduling=True, block_size=16, **kw)
    assert [g[:2] for g in _run(llm, prompts, params)] == [w[:2] for w in want]
    assert llm.engine.core.executor.worker.model_runner.batch.token_ids.shape[0] >= 6
    assert llm.engine.kv.stats()["used"] == 0
