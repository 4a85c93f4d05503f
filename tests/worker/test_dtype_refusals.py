"""A dtype, KV dtype or backend the device cannot run is refused at start, naming what to use instead
(``DeviceConfig.from_args`` / ``check_backend``, pagedllm/config/device.py), before any weight is loaded."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import device as device_mod
from pagedllm.config.args import EngineArgs
from pagedllm.config.device import DeviceConfig
from pagedllm.worker import worker as worker_mod

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


@pytest.fixture
def no_weights(monkeypatch):
    """A start that gets as far as loading weights fails the test: refusals must come first."""
    def load(*a, **k):
        raise AssertionError("weights loaded before the settings were checked")

    monkeypatch.setattr(worker_mod, "load_checkpoint", load)


@pytest.mark.parametrize("kw, names", [
    (dict(dtype="float16", attention_backend="cpu"), "use dtype bfloat16 or float32"),
    (dict(dtype="float16"), "use dtype bfloat16 or float32"),  # auto picks the C++ kernels on the CPU
    (dict(dtype="float32", kv_cache_dtype="float16", attention_backend="cpu"), "kv_cache_dtype bfloat16"),
    (dict(dtype="float16", kv_cache_dtype="int8", attention_backend="cpu"), "dtype float16: the CPU kernels take"),
    (dict(dtype="float16", kv_cache_dtype="bfloat16", attention_backend="cpu"), "or attention_backend 'reference'"),
    (dict(kv_cache_dtype="int8", attention_backend="flex"), "use attention_backend 'cpu' or 'triton'"),
    (dict(kv_cache_dtype="fp8_e5m2", attention_backend="flex"), "use attention_backend 'cpu' or 'triton'"),
])
def test_the_cpu_refuses_what_its_backends_cannot_run(tiny_model_dir, no_weights, kw, names):
    with pytest.raises(ValueError, match=names):
        LLM(tiny_model_dir, device="cpu", num_blocks=8, **kw)


def test_triton_on_the_cpu_needs_its_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="'triton' needs a CUDA device; on the CPU use 'cpu'"):
        DeviceConfig.from_args(EngineArgs(device="cpu", attention_backend="triton"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # how CI runs the Triton kernels
    DeviceConfig.from_args(EngineArgs(device="cpu", attention_backend="triton"))


@pytest.mark.parametrize("kw", [dict(dtype="float16", attention_backend="reference"),
                                dict(dtype="float16", kv_cache_dtype="int8", attention_backend="reference"),
                                dict(dtype="float16", attention_backend="flex"),
                                dict(dtype="bfloat16", kv_cache_dtype="fp8_e4m3", attention_backend="cpu"),
                                dict(dtype="float32", kv_cache_dtype="int8", attention_backend="cpu")])
def test_what_is_not_refused_runs(tiny_model_dir, kw):
    """Accepted at start means served: the first steps run (fp16 activations with an int8 pool on the C++ kernels
    were accepted here and failed at the first step)."""
    llm = LLM(tiny_model_dir, device="cpu", num_blocks=8, **kw)
    try:
        out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                           use_tqdm=False)[0]
        llm.engine.kv.check_integrity()
        assert llm.engine.kv.stats()["used"] == 0
    finally:
        llm.engine.shutdown()
    assert out.error is None and len(out.outputs[0].token_ids) == 3


def test_the_cpu_kernels_are_refused_on_cuda():
    with pytest.raises(ValueError, match="use 'triton' or 'flex'"):
        DeviceConfig(CUDA, torch.bfloat16, torch.bfloat16).check_backend("cpu")
    DeviceConfig(CUDA, torch.float16, torch.int8).check_backend("triton")


@pytest.fixture
def old_gpu(monkeypatch):
    """A stand-in CUDA device without bf16 (compute capability 7.5)."""
    monkeypatch.setattr(device_mod, "resolve_device", lambda name: CUDA)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")


def test_a_gpu_without_bf16_refuses_it_and_auto_picks_fp16(old_gpu):
    with pytest.raises(ValueError, match=r"Tesla T4.*use dtype float16 or float32"):
        DeviceConfig.from_args(EngineArgs(device="cuda", dtype="bfloat16"))
    with pytest.raises(ValueError, match="kv_cache_dtype auto, float16 or int8"):
        DeviceConfig.from_args(EngineArgs(device="cuda", dtype="float32", kv_cache_dtype="bfloat16"))
    cfg = DeviceConfig.from_args(EngineArgs(device="cuda"))
    assert (cfg.dtype, cfg.kv_dtype) == (torch.float16, torch.float16)


def test_an_ampere_or_later_gpu_defaults_to_bf16(monkeypatch):
    monkeypatch.setattr(device_mod, "resolve_device", lambda name: CUDA)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert DeviceConfig.from_args(EngineArgs(device="cuda")).dtype == torch.bfloat16


def test_more_tensor_parallel_ranks_than_gpus_is_refused_naming_the_field(monkeypatch):
    """NCCL cannot run two ranks on one GPU ("Duplicate GPU detected", seen on an H200): refused before any rank
    starts a collective, naming tensor_parallel_size and the CPU's gloo ranks as the way out."""
    monkeypatch.setattr(device_mod, "resolve_device", lambda name: CUDA)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 needs 2 GPUs.*has 1.*device 'cpu'"):
        DeviceConfig.from_args(EngineArgs(device="cuda", tensor_parallel_size=2))
    assert DeviceConfig.from_args(EngineArgs(device="cuda", tensor_parallel_size=1)).device == CUDA
