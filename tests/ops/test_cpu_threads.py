"""The adaptive CPU thread policy: readings of other processes' CPU time, the thread count they give, and the
engine running its steps on it with the same tokens."""

from __future__ import annotations

import os
import time

import pytest
import torch

from pagedllm.ops import cpu_threads
from pagedllm.ops.cpu_threads import (
    CpuTimes,
    ThreadGovernor,
    governor_for,
    others_cores,
    threads_for,
)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_others_cores_is_the_busy_time_this_process_did_not_use():
    before = CpuTimes(busy=1000, total=2000, ours=100)
    # 200 ticks over 2 CPUs = 1 s of wall time; 150 busy, 50 of them ours: others took 100 ticks = 1 core
    assert others_cores(before, CpuTimes(1150, 2200, 150), 2) == pytest.approx(1.0)
    assert others_cores(before, CpuTimes(1100, 2200, 200), 2) == 0.0  # only we ran
    assert others_cores(before, before, 2) == 0.0  # no time passed


@pytest.mark.parametrize(("others", "cpus", "most", "want"), [
    (0.0, 2, 2, 2), (0.4, 2, 2, 2), (0.6, 2, 2, 1), (1.0, 2, 2, 1), (2.0, 2, 2, 1),  # never below one thread
    (1.0, 8, 8, 7), (0.0, 8, 4, 4),  # never above the engine's own count
])
def test_threads_for_the_cores_left(others, cpus, most, want):
    assert threads_for(others, cpus, most) == want


class FakeMachine:
    """A clock and /proc readings where a neighbour takes ``neighbour`` cores and we take what's left."""

    def __init__(self, cpus: int):
        self.t, self.cpus, self.neighbour = 0.0, cpus, 0.0
        self.times = CpuTimes(0, 0, 0)
        self.reads = 0

    def advance(self, seconds: float) -> None:
        ticks = int(seconds * 100)
        ours = int(ticks * min(torch.get_num_threads(), self.cpus - self.neighbour))
        others = int(ticks * self.neighbour)
        self.times = CpuTimes(self.times.busy + ours + others, self.times.total + ticks * self.cpus,
                              self.times.ours + ours)
        self.t += seconds

    def read(self, cpus):
        self.reads += 1
        return self.times


def test_governor_gives_a_taken_core_up_and_takes_it_back(two_threads, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    m = FakeMachine(2)
    g = ThreadGovernor(period_s=0.5, read=m.read, clock=lambda: m.t)
    g.adapt()  # the first reading: nothing to compare yet
    assert g.most == 2 and torch.get_num_threads() == 2
    m.neighbour = 1.0
    m.advance(0.1)
    g.adapt()
    assert m.reads == 1, "no reading within the period"
    m.advance(0.5)
    g.adapt()
    assert g.others == pytest.approx(1.0, abs=0.05) and torch.get_num_threads() == 1
    m.neighbour = 0.0
    m.advance(0.6)
    g.adapt()
    assert torch.get_num_threads() == 2 and g.threads == 2


def test_governor_for_which_workers(two_threads):
    cpu = torch.device("cpu")
    assert isinstance(governor_for("adaptive", cpu, sharded=False), ThreadGovernor)
    assert governor_for("fixed", cpu, sharded=False) is None
    assert governor_for("adaptive", cpu, sharded=True) is None  # tensor-parallel ranks split the cores themselves
    assert governor_for("adaptive", torch.device("cuda"), sharded=False) is None
    torch.set_num_threads(1)
    assert governor_for("adaptive", cpu, sharded=False) is None  # one thread: nothing to adapt
    with pytest.raises(ValueError, match="cpu_thread_policy must be one of adaptive, fixed"):
        governor_for("spin", cpu, sharded=False)


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux /proc")
def test_real_readings_count_our_own_cpu_time():
    cpus = frozenset(os.sched_getaffinity(0))
    before = cpu_threads.read_cpu_times(cpus)
    deadline = time.monotonic() + 30
    while cpu_threads.read_cpu_times(cpus).ours < before.ours + 20:  # busy until the kernel charges us 20 ticks
        assert time.monotonic() < deadline, "this process's CPU time never grew"
    after = cpu_threads.read_cpu_times(cpus)
    # our ticks are in the CPUs' busy totals (the per-CPU counters may lag a few ticks behind the process's)
    assert after.busy - before.busy >= (after.ours - before.ours) - 5
    assert after.total > before.total and after.busy <= after.total


def test_engine_steps_under_contention_on_fewer_threads_with_the_same_tokens(tiny_model_dir, two_threads,
                                                                                 monkeypatch):
    from pagedllm import LLM, SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    fixed = LLM(tiny_model_dir, cpu_thread_policy="fixed", kv_cache_memory=16 << 20)
    assert fixed.engine.forward_pass.threads is None
    want = [o.outputs[0].token_ids for o in fixed.generate(["a b c", "hello there"], params)]
    llm = LLM(tiny_model_dir, kv_cache_memory=16 << 20)  # adaptive is the default
    g = llm.engine.forward_pass.threads
    assert isinstance(g, ThreadGovernor)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    m = FakeMachine(2)
    m.neighbour = 1.0
    g.cpus, g.period_s, g._read, g._clock = frozenset({0, 1}), 0.0, m.read, lambda: m.t
    real_adapt = g.adapt

    def adapt():  # each step: the fake machine moves on by a period
        m.advance(0.5)
        real_adapt()

    g.adapt = adapt
    got = [o.outputs[0].token_ids for o in llm.generate(["a b c", "hello there"], params)]
    assert got == want
    assert g.threads == 1 and torch.get_num_threads() == 1
