"""GPU memory sizing (``pagedllm/worker/memory_profile.py``) and the GPU defaults, on the CPU: the device's memory
functions are stand-ins, the profiled forward is real."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedllm import LLM
from pagedllm.config.args import EngineArgs
from pagedllm.kv.kv_cache import KVCache
from pagedllm.models.forward_pass import ForwardPass
from pagedllm.worker import memory_profile
from pagedllm.worker.memory_profile import MemoryProbe, profile_batch, profile_kv_budget

GIB = 2**30


class FakeDevice:
    """A device of ``total`` bytes with ``other`` bytes used outside torch; the allocator's peak is ``peak``."""

    def __init__(self, total: int, other: int, peak: int, reserved: int) -> None:
        self.total, self.other, self.peak, self.reserved_bytes = total, other, peak, reserved
        self.calls: list[str] = []

    def probe(self) -> MemoryProbe:
        def call(name, value=None):
            def f():
                self.calls.append(name)
                return value() if callable(value) else value
            return f

        return MemoryProbe(
            mem_get_info=call("mem_get_info", lambda: (self.total - self.other - self.reserved_bytes, self.total)),
            reset_peak=call("reset_peak"), max_allocated=call("max_allocated", lambda: self.peak),
            reserved=call("reserved", lambda: self.reserved_bytes), empty_cache=call("empty_cache"))


def test_the_pool_gets_utilization_less_the_peak_and_what_torch_does_not_hold():
    dev = FakeDevice(total=80 * GIB, other=2 * GIB, peak=10 * GIB, reserved=11 * GIB)
    budget = profile_kv_budget(dev.probe(), 0.9, lambda: dev.calls.append("forward"), scratch_bytes=1 * GIB)
    assert dev.calls.index("reset_peak") < dev.calls.index("forward") < dev.calls.index("max_allocated")
    assert (budget.total, budget.peak, budget.non_torch) == (80 * GIB, 9 * GIB, 2 * GIB)
    assert budget.kv_bytes == int(0.9 * 80 * GIB) - 9 * GIB - 2 * GIB
    assert "for the KV pool" in budget.describe(0.9)


def test_no_room_left_is_a_clear_error():
    dev = FakeDevice(total=8 * GIB, other=1 * GIB, peak=7 * GIB, reserved=7 * GIB)
    with pytest.raises(ValueError, match="gpu_memory_utilization 0.5 leaves no memory for the KV cache"):
        profile_kv_budget(dev.probe(), 0.5, lambda: None)


def test_the_profiled_step_is_the_largest_the_scheduler_makes():
    prompts, blocks = profile_batch(8192, 256, 4096, 16)
    assert len(prompts) == 256 and sum(map(len, prompts)) == 8192 and blocks == 256 * 2
    prompts, blocks = profile_batch(100, 3, 20, 16)  # three sequences of at most 20 tokens
    assert [len(p) for p in prompts] == [20, 20, 20] and blocks == 6
    prompts, _ = profile_batch(10, 4, 4096, 16)
    assert [len(p) for p in prompts] == [3, 3, 2, 2]


def test_the_worker_sizes_its_pool_from_the_profile(tiny_model_dir, monkeypatch, caplog):
    """The worker's CUDA path, on the CPU: a stand-in probe, a real forward at max_num_batched_tokens."""
    dev = FakeDevice(total=1 * GIB, other=64 << 20, peak=100 << 20, reserved=128 << 20)
    monkeypatch.setattr(memory_profile, "probe_for", lambda device: dev.probe())
    steps = []
    real_forward = ForwardPass.forward

    def spy(self, input_ids, meta):
        steps.append((meta.num_tokens, meta.num_seqs, self.kv_cache.num_blocks))
        return real_forward(self, input_ids, meta)

    monkeypatch.setattr(ForwardPass, "forward", spy)
    with caplog.at_level(logging.INFO, logger="pagedllm.worker"):
        llm = LLM(tiny_model_dir, device="cpu", dtype="float32", max_num_batched_tokens=96, max_num_seqs=4,
                  gpu_memory_utilization=0.5, block_size=16)
    assert steps == [(96, 4, 8)]  # 4 prompts of 24 tokens on an 8-block scratch pool
    kv = llm.engine.forward_pass.kv_cache
    per_block = KVCache.bytes_per_block(kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.block_size, kv.dtype)
    want = (int(0.5 * GIB) - (100 << 20) + 8 * per_block - (64 << 20)) // per_block
    assert kv.num_blocks == want
    assert f"{want} KV blocks, {want * 16} tokens" in caplog.text


def test_explicit_pool_sizes_skip_the_profile(tiny_model_dir, monkeypatch):
    def refuse(device):
        raise AssertionError("profiled although the pool size was given")

    monkeypatch.setattr(memory_profile, "probe_for", refuse)
    assert LLM(tiny_model_dir, device="cpu", num_blocks=16).engine.forward_pass.kv_cache.num_blocks == 16


def test_the_cpu_keeps_its_fixed_share():
    assert memory_profile.probe_for(torch.device("cpu")) is None


@pytest.mark.parametrize("value", [0.0, 1.5, -0.1])
def test_utilization_out_of_range_is_refused(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineArgs(gpu_memory_utilization=value)


def test_gpu_defaults_serve_and_the_cpu_keeps_its_own(monkeypatch):
    gpu, cpu = EngineArgs(device="cuda:0"), EngineArgs(device="cpu")
    assert (gpu.max_num_seqs, gpu.max_num_batched_tokens, gpu.block_size) == (256, 8192, 16)
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens, cpu.block_size) == (64, 2048, 128)  # vLLM's CPU block
    assert EngineArgs(device="cuda", max_num_seqs=8).max_num_seqs == 8
    assert EngineArgs(device="cpu", block_size=32).block_size == 32
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        EngineArgs(device="cpu", block_size=48)
    # the offline LLM class takes vLLM's longer CPU steps unless told; the server's defaults stay
    assert EngineArgs.offline(device="cpu").max_num_batched_tokens == 4096
    assert EngineArgs.offline(device="cpu", max_num_batched_tokens=512).max_num_batched_tokens == 512
    assert EngineArgs.offline(device="cuda").max_num_batched_tokens == 8192
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert EngineArgs.offline().max_num_batched_tokens == 8192  # auto picks the GPU
    assert (EngineArgs().max_num_seqs, EngineArgs().block_size) == (256, 16)  # auto picks the GPU


def test_the_llm_class_takes_the_offline_step_size(tiny_model_dir):
    """LLM builds its engine from EngineArgs.offline: vLLM's 4096-token CPU steps, where the server keeps 2048."""
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", num_blocks=8, block_size=16)
    assert llm.engine.args.max_num_batched_tokens == 4096
    assert llm.engine.scheduler.config.max_num_batched_tokens == 4096
