"""The device check (``pagedllm/worker/device_check.py``): it fails a step that makes a tensor off the worker's
device, it would have caught the host tensors that broke the reference and flex backends and the int8 KV write
on CUDA (each bug put back in and caught, on the CPU), and the engine's main paths run clean under it on every
device present (every backend x KV dtype, prefix hits, both preemption modes, speculation, beam search, parallel
samples, structured outputs)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention import BACKENDS, flex, reference
from pagedllm.kv import kv_quant
from pagedllm.structured.params import StructuredOutputsParams
from pagedllm.worker import device_check
from pagedllm.worker.device_check import CheckedForwardPass, DeviceCheck, DeviceCheckError

PROMPTS = [[5, 17, 300, 42] * 9, [7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)  # 6 such requests outgrow an 8-block pool


@pytest.fixture
def checked(monkeypatch):
    """Workers made in the test run their forward passes under the check; the record starts empty."""
    monkeypatch.setenv(device_check.ENV, "1")
    device_check.RECORDED.clear()
    yield
    device_check.RECORDED.clear()


def _llm(model_dir: str, device: str, **kw) -> LLM:
    kw = {"dtype": "float32", "max_num_seqs": 8, **kw}  # 8: few decode graphs to capture on a GPU
    llm = LLM(model_dir, device=device, block_size=16, **kw)
    assert isinstance(llm.engine.forward_pass, CheckedForwardPass)  # the check is really on
    return llm


def _tokens(outs) -> list[list[int]]:
    return [list(c.token_ids) for o in outs for c in o.outputs]


# ---- the mode itself ------------------------------------------------------------------------------------------


def test_factories_need_the_step_device_and_derived_tensors_pass():
    x = torch.ones(3)
    with DeviceCheck("cpu"):
        torch.arange(3, device="cpu")
        torch.zeros(2, dtype=torch.int32, device=x.device)
        torch.empty_like(x), x.new_zeros(4), x + 1, torch.where(x > 0, x, 0.0)
        torch.as_tensor(x)  # a tensor already: stays where it is
        for make in (lambda: torch.arange(3), lambda: torch.zeros(()), lambda: torch.tensor([1, 2]),
                     lambda: torch.full((2,), 1.0), lambda: torch.empty(2, 2)):
            with pytest.raises(DeviceCheckError, match="without device=.*test_device_check.py"):
                make()
        with pytest.raises(DeviceCheckError, match="another device"):
            torch.zeros(2, device="meta")
        with pytest.raises(DeviceCheckError, match="moved a tensor off the device"):
            x.to("meta")
        with pytest.raises(DeviceCheckError, match="to the host"):
            x.cpu()
        x.to(torch.float64), x.to(x)  # a dtype change or the same device is fine
    torch.arange(3)  # outside a step nothing is checked
    assert len(device_check.RECORDED) >= 8
    device_check.RECORDED.clear()


def test_code_torch_generates_is_not_checked():
    """torch.compile's generated wrappers (filename ``<string>``) may pass a scalar as a host tensor (compiled flex
    on CUDA does); the same call from a file is still caught."""
    with DeviceCheck("cpu"):
        exec(compile("torch.arange(3)", "<string>", "exec"), {"torch": torch})
        with pytest.raises(DeviceCheckError, match="without device="):
            torch.arange(3)


def test_other_device_names_are_compared_by_type_and_index():
    with DeviceCheck("cuda:0") as mode:
        assert mode.device == torch.device("cuda:0")
        with pytest.raises(DeviceCheckError, match="on the default device"):
            torch.arange(2)
    device_check.RECORDED.clear()


# ---- the bugs it exists for, put back ---------------------------------------------------------------------------


def _old_sequence_slots(block_table, seq_len, block_size):  # main before issue 29: a host arange
    n_blocks = (seq_len + block_size - 1) // block_size
    return (block_table[:n_blocks].long()[:, None] * block_size + torch.arange(block_size)).flatten()[:seq_len]


def _with_old_flex_mask(real):
    def kv_blocks_for_rows(tables, n_logical, m, e):
        _valid = torch.arange(max(int(n_logical.max()), 1))[None, :] < n_logical[:, None]  # main's first line
        return real(tables, n_logical, m, e)

    return kv_blocks_for_rows


def _with_old_int8_write(real):
    def write_int8(x, cache, slot_mapping):
        torch.zeros(x.shape[1], 1).scatter_reduce_(1, torch.zeros(x.shape[1], 1, dtype=torch.int64),  # main's run_max
                                                   torch.ones(x.shape[1], 1), "amax")
        return real(x, cache, slot_mapping)

    return write_int8


@pytest.mark.parametrize("bug", ["reference", "flex", "int8"])
def test_the_host_tensors_that_broke_cuda_are_caught_on_the_cpu(tiny_model_dir, checked, monkeypatch, bug):
    backend, kv = {"reference": ("reference", "auto"), "flex": ("flex", "auto"), "int8": ("reference", "int8")}[bug]
    if bug == "reference":
        monkeypatch.setattr(reference, "sequence_slots", _old_sequence_slots)
    elif bug == "flex":
        monkeypatch.setattr(flex, "_kv_blocks_for_rows", _with_old_flex_mask(flex._kv_blocks_for_rows))
    else:
        monkeypatch.setattr(kv_quant, "write_int8", _with_old_int8_write(kv_quant.write_int8))
    llm = _llm(tiny_model_dir, "cpu", attention_backend=backend, kv_cache_dtype=kv, num_blocks=32)
    with pytest.raises(RuntimeError, match="DeviceCheckError"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert device_check.RECORDED and "test_device_check.py" in device_check.RECORDED[0]
    assert "without device=" in device_check.RECORDED[0]


# ---- the engine's main paths under the check ---------------------------------------------------------------------


def _backends(device: str) -> list[str]:
    names = [b for b in ("reference", "flex", "cpu", "triton") if b in BACKENDS]
    if device != "cpu":
        return [b for b in names if b != "cpu"]
    names = [b for b in names if b != "triton"]
    if importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1":
        names.append("triton")  # Triton's interpreter on the CPU (set where no GPU is: tests/conftest.py)
    return names


KV_DTYPES = ["float32", "bfloat16", "int8", "fp8_e4m3"]


# flex reads float pools only (a quantized one is refused at start: tests/worker/test_dtype_refusals.py)
COMBOS = [(b, kv) for b in ("reference", "flex", "cpu", "triton") for kv in KV_DTYPES
          if not (b == "flex" and kv in ("int8", "fp8_e4m3"))]


@pytest.mark.parametrize("backend, kv", COMBOS)
def test_every_backend_and_kv_dtype_runs_clean(tiny_model_dir, checked, device, backend, kv):
    if backend not in _backends(device):
        pytest.skip(f"the {backend!r} backend does not run on {device}")  # the C++ CPU kernels, on CUDA
    llm = _llm(tiny_model_dir, device, attention_backend=backend, kv_cache_dtype=kv, num_blocks=64,
               max_num_batched_tokens=16)  # chunked prefill: mixed decode + prefill steps
    outs = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert [len(t) for t in outs] == [5, 5, 5]
    assert device_check.RECORDED == []


MAIN_PATHS = {
    "prefix-hit": (dict(), [GREEDY, GREEDY]),
    "preempt-recompute": (dict(num_blocks=8, max_num_batched_tokens=64), LONG),
    "preempt-swap": (dict(num_blocks=8, max_num_batched_tokens=64, preemption_mode="swap", swap_space=8 << 20), LONG),
    "spec-ngram": (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}), None),
    "spec-draft": (dict(speculative_config={"method": "draft_model", "num_layers": 1, "num_speculative_tokens": 2}),
                   None),
    "beam": (dict(), SamplingParams(use_beam_search=True, beam_width=2, temperature=0, max_tokens=4, ignore_eos=True)),
    "parallel-seeded": (dict(), SamplingParams(n=2, temperature=0.8, top_p=0.9, seed=7, max_tokens=5, ignore_eos=True,
                                                logprobs=2, repetition_penalty=1.1)),
    "structured": (dict(), SamplingParams(temperature=0, max_tokens=8,
                                          structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))),
}


@pytest.mark.parametrize("path", list(MAIN_PATHS))
@pytest.mark.parametrize("backend", ["auto", "reference"])  # the device's own backend, and the Python oracle
def test_main_paths_run_clean(tiny_model_dir, checked, device, backend, path):
    extra, params = MAIN_PATHS[path]
    llm = _llm(tiny_model_dir, device, **{"num_blocks": 64, "attention_backend": backend, **extra})
    prompts = PROMPTS * 2 if path.startswith("preempt") else PROMPTS
    if path == "prefix-hit":  # the same long prompt again: its full blocks come from the prefix cache
        _tokens(llm.generate(prompts[:1], params[0], use_tqdm=False))
        _tokens(llm.generate(prompts[:1], params[1], use_tqdm=False))
        assert llm.engine.stats.prompt_tokens_cached > 0
    else:
        outs = _tokens(llm.generate(prompts, params or GREEDY, use_tqdm=False))
        assert outs and all(outs)
    if path.startswith("preempt"):
        assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    assert device_check.RECORDED == []
