"""The adaptive CPU thread policy: the thread count whose steps measure faster, re-tried as the machine changes, and
the engine running its steps on it with the same tokens."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from pagedllm.ops.cpu_threads import ThreadGovernor, governor_for, run_queue_wait_s


class FakeSteps:
    """A clock and forward passes whose duration depends on the thread count they run on, and a run-queue wait
    count: each step's threads wait ``wait_share`` of its time for a CPU (a neighbour's share of our cores;
    None: the kernel does not say)."""

    def __init__(self, seconds: dict[int, float], prefill_seconds: dict[int, float] | None = None,
                 wait_share: float | None = None):
        self.t, self.seconds, self.prefill_seconds, self.used = 0.0, seconds, prefill_seconds, []
        self.wait_share, self.waited = wait_share, 0.0

    def waits(self) -> float | None:
        return None if self.wait_share is None else self.waited

    def step(self, g: ThreadGovernor, num_tokens: int = 1) -> None:
        started = g.begin(num_tokens)
        self.used.append(torch.get_num_threads())
        costs = self.prefill_seconds if self.prefill_seconds is not None and num_tokens >= 64 else self.seconds
        self.t += costs[self.used[-1]]
        self.waited += (self.wait_share or 0.0) * costs[self.used[-1]] * self.used[-1]
        g.end(num_tokens, started)

    def run(self, g: ThreadGovernor, n: int, num_tokens: int = 1) -> None:
        for _ in range(n):
            self.step(g, num_tokens)


def governor(m: FakeSteps, **kwargs) -> ThreadGovernor:
    """A governor on ``m``'s clock and run-queue wait count."""
    return ThreadGovernor(clock=lambda: m.t, waits=m.waits, **kwargs)


def test_governor_keeps_the_faster_thread_count_and_retries(two_threads):
    quiet = {2: 0.010, 1: 0.018}  # two threads win on free cores
    contended = {2: 0.030, 1: 0.018}  # a neighbour holds a core: the team of two waits on it
    m = FakeSteps(quiet)  # the kernel does not count run-queue waits here: trials run on free cores too
    g = governor(m, period_s=0.5, trial_steps=4)
    m.run(g, 1000)  # 10 s of steps on free cores
    assert g.most == 2 and g.threads == 2 and torch.get_num_threads() == 2 and g.chosen == {}
    assert 3 <= m.used.count(1) <= 0.05 * len(m.used), "one thread was tried, in few of the steps"
    m.seconds = contended
    m.run(g, 200)
    assert g.chosen == {1: 1} and g.threads == 1 and torch.get_num_threads() == 1
    m.seconds = quiet  # the neighbour leaves: a later trial of two threads wins it back
    m.run(g, 400)
    assert g.chosen == {} and g.threads == 2 and torch.get_num_threads() == 2


def test_no_trial_while_our_threads_do_not_wait_for_a_cpu(two_threads):
    """Where the kernel counts our threads' run-queue waits, a machine on which they (almost) never wait runs every
    step on all threads: one thread fewer cannot win there, and its trial steps would only cost. Once a neighbour
    makes them wait, the next look starts a trial and one thread wins; back on one thread, trials of two run as
    before (no wait then says nothing about two threads)."""
    m = FakeSteps({2: 0.010, 1: 0.018}, wait_share=0.02)  # a helper thread's wake-ups: under quiet_wait
    g = governor(m, period_s=0.5, trial_steps=4)
    m.run(g, 1000)  # 10 s
    assert m.used.count(1) == 0 and g.chosen == {} and g.trial is None
    m.seconds, m.wait_share = {2: 0.030, 1: 0.018}, 0.25  # a neighbour takes half a core
    m.run(g, 40)  # 1.2 s: the next look comes within a period
    assert g.chosen == {1: 1} and g.threads == 1
    m.seconds, m.wait_share = {2: 0.010, 1: 0.018}, 0.0  # it leaves
    m.run(g, 400)
    assert g.chosen == {} and g.threads == 2


def test_first_trial_comes_before_the_period_on_a_contended_machine(two_threads):
    """The first trial comes ``first_trial_s`` after the first step, not a whole period later: a 2-s wait is a
    whole short run on a team stalled by a neighbour."""
    m = FakeSteps({2: 0.030, 1: 0.018}, wait_share=0.25)  # contended from the start
    g = governor(m, period_s=2.0, trial_steps=4, first_trial_s=0.25)
    m.run(g, 20)  # 0.6 s on two threads
    assert g.chosen == {1: 1} and g.threads == 1
    assert m.used.index(1) <= 10, "the first trial started after ~0.25 s of steps"
    late = FakeSteps({2: 0.030, 1: 0.018}, wait_share=0.25)
    torch.set_num_threads(2)  # the first governor left one
    g = governor(late, period_s=2.0, trial_steps=4, first_trial_s=5.0)  # capped at the period
    late.run(g, 80)
    assert 2.0 / 0.030 <= late.used.index(1) <= 2.0 / 0.030 + 2


def test_governor_compares_steps_of_one_size_only(two_threads):
    """A trial started on decode steps is judged on decode steps: a big prefill meanwhile runs on its own count."""
    m = FakeSteps({2: 0.010, 1: 0.011})  # one thread slower, but not clearly enough to end the trial early
    g = governor(m, period_s=0.095, trial_steps=4)
    m.run(g, 12)  # 10 steps on two threads, then the trial's first two on one
    assert (g.trial.back, g.trial.bucket, g.threads) == (2, 1, 1)
    m.seconds = {2: 0.001, 1: 0.001}
    m.step(g, num_tokens=512)  # a prefill, faster than any decode step, on its own count (two) during the trial
    assert m.used[-1] == 2 and g.trial.tried is None and (2, 10) in g.samples and (1, 10) not in g.samples
    m.seconds = {2: 0.010, 1: 0.011}
    m.run(g, 2)  # the trial's 4 decode steps on one thread: back to two, measured again
    assert g.trial.tried == pytest.approx(0.011) and g.threads_for(1) == 2  # the next decode step goes back
    m.run(g, 4)
    assert g.trial is None and g.threads == 2


def test_steps_of_each_size_keep_their_own_thread_count(two_threads):
    """A neighbour on one core: decode steps (barrier-bound) run faster on one thread, prefill chunks (GEMM-bound)
    still on two. The verdict won on decode steps leaves the prefills on two threads, and they are never tried on
    one (a trial would put a light serving load's prefills on one thread for a while)."""
    m = FakeSteps({2: 0.030, 1: 0.018}, prefill_seconds={2: 0.200, 1: 0.380})
    g = governor(m, period_s=0.5, trial_steps=4)
    for _ in range(150):  # a serving mix: a prefill chunk after every 9 decode steps
        m.run(g, 9)
        m.step(g, num_tokens=100)
    assert g.chosen == {1: 1}, "decode steps on one thread, prefills (bucket 7) on two"
    assert m.used[9::10] == [2] * 150, "every prefill ran on two threads"
    assert m.used[-2] == 1 and m.used[-1] == 2


def test_a_clearly_slower_count_loses_after_its_first_steps(two_threads):
    """On free cores one thread fewer is ~1.8x slower: the trial ends after ``early_steps`` steps on it, not
    ``trial_steps`` plus as many back; a count slower by less than ``early_loss`` runs the whole trial."""
    m = FakeSteps({2: 0.010, 1: 0.018})
    g = governor(m, period_s=0.05, trial_steps=8, early_steps=3)
    m.run(g, 8)  # 8 steps measure two threads, the trial starts
    assert g.trial is not None and m.used == [2] * 8
    m.run(g, 3)
    assert m.used[-3:] == [1, 1, 1] and g.trial is None and g.chosen == {}, "lost after 3 steps"
    m.run(g, 1)
    assert m.used[-1] == 2
    close = FakeSteps({2: 0.010, 1: 0.012})  # 20% slower: under early_loss, so measured in full
    torch.set_num_threads(2)
    g = governor(close, period_s=0.05, trial_steps=8, early_steps=3)
    close.run(g, 8 + 8)
    assert close.used[-8:] == [1] * 8 and g.trial is not None and g.trial.tried == pytest.approx(0.012)


def test_a_trial_whose_step_size_stops_coming_goes_back(two_threads):
    m = FakeSteps({2: 0.010, 1: 0.018})
    g = governor(m, period_s=0.05, trial_steps=4)
    m.run(g, 7)
    assert g.trial is not None and g.threads == 1
    deadline = g.trial.deadline
    while g.trial is not None and g.trial.bucket == 1:  # only prefills from now on
        assert m.t < deadline + 0.02, "the trial outlived its deadline"
        m.step(g, num_tokens=64)
    assert g.trial is None and g.threads == 2 and m.t >= deadline


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


def test_engine_steps_under_contention_on_fewer_threads_with_the_same_tokens(tiny_model_dir, two_threads):
    from pagedllm import LLM, SamplingParams

    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    fixed = LLM(tiny_model_dir, cpu_thread_policy="fixed", kv_cache_memory=16 << 20)
    assert fixed.engine.forward_pass.threads is None
    want = [o.outputs[0].token_ids for o in fixed.generate(["a b c", "hello there"], params)]
    llm = LLM(tiny_model_dir, kv_cache_memory=16 << 20)  # adaptive is the default
    g = llm.engine.forward_pass.threads
    assert isinstance(g, ThreadGovernor)
    contended = {2: 0.030, 1: 0.018}
    t = [0.0]

    def clock() -> float:  # each forward pass takes what its thread count costs on the contended machine
        t[0] += contended[torch.get_num_threads()]
        return t[0]

    # a trial after ~1 s of steps on two threads; the next would come ~1 s after it, past the run's end
    # our threads wait half their time for a CPU
    llm.engine.forward_pass.threads = g = ThreadGovernor(period_s=1.0, trial_steps=2, clock=clock,
                                                         waits=lambda: t[0])
    got = [o.outputs[0].token_ids for o in llm.generate(["a b c", "hello there"], params)]
    assert got == want
    assert g.chosen == {2: 1} and g.threads == 1 and torch.get_num_threads() == 1  # its 2-row decode steps


def test_run_queue_wait_counts_a_neighbour_on_our_core():
    """The count the governor reads grows by about the time a busy process on our core keeps our thread waiting."""
    cpu, mask = min(os.sched_getaffinity(0)), os.sched_getaffinity(0)
    busy = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    try:
        time.sleep(0.3)  # the neighbour is running
        os.sched_setaffinity(0, {cpu})  # this thread shares its core
        before, end = run_queue_wait_s(), time.perf_counter() + 0.6
        while time.perf_counter() < end:
            pass
        waited = run_queue_wait_s() - before
    finally:
        os.sched_setaffinity(0, mask)
        busy.kill()
        busy.wait()
    assert 0.1 < waited < 0.6, f"waited {waited:.3f} s of 0.6 s on a shared core"


def test_run_queue_wait_is_unknown_where_the_kernel_does_not_count(tmp_path):
    """A kernel without scheduler statistics prints "0 0 0" for every thread: unknown (trials run), not quiet."""
    def tasks(*lines: str) -> str:
        for i, line in enumerate(lines):
            (tmp_path / str(i)).mkdir(parents=True, exist_ok=True)
            (tmp_path / str(i) / "schedstat").write_text(line + "\n")
        return str(tmp_path)

    assert run_queue_wait_s(tasks("0 0 0", "0 0 0")) is None
    assert run_queue_wait_s(tasks("5000 700 3", "1000 300 1")) == pytest.approx(1e-6)
    assert run_queue_wait_s(str(tmp_path / "missing")) is None
