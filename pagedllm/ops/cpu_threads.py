"""OpenMP threads that survive a shared machine: the CPU kernels' thread count is the one whose steps measure
faster, re-tried while the engine runs.

pagedllm's OpenMP threads spin at barriers for ``GOMP_SPINCOUNT`` iterations before sleeping (``pagedllm/__init__``):
on dedicated cores that is what makes batch-1 decode fast (a step has ~150 parallel regions, waking a sleeping
thread costs 25-45 us). When another busy process takes one of the cores, a team that still counts on that core
waits at every barrier for a thread the scheduler has parked, for whole time slices (batch 1 fell from 145 to 45
tok/s with spin 1000 on a 2-core Zen 5). libgomp reads its wait policy once, at start, so the policy cannot change
at run time; the team's size can. Whether one thread fewer pays depends on the neighbours (one busy process on one
core: it does; a machine oversubscribed many times over: more threads get more of the CPU), so it is measured, not
inferred: :class:`ThreadGovernor` times every forward pass per step size, and every ``period_s`` runs
``trial_steps`` steps of one size on the other thread count; the faster median keeps the steps.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable

import torch

POLICIES = ("adaptive", "fixed")


class ThreadGovernor:
    """Chooses between torch's thread count at start (``most``) and one thread fewer by measuring both. Call
    :meth:`begin` and :meth:`end` around each forward pass, in the thread that runs them (OpenMP's thread count is
    per calling thread)."""

    def __init__(self, period_s: float = 2.0, trial_steps: int = 8, margin: float = 0.05,
                 clock: Callable[[], float] = time.perf_counter):
        self.period_s, self.trial_steps, self.margin, self._clock = period_s, trial_steps, margin, clock
        self.most: int | None = None
        self.threads: int | None = None  # what the steps run on now
        self.trial: tuple[int, int] | None = None  # (thread count to go back to, step-size bucket) during a trial
        self.samples: dict[tuple[int, int], deque[float]] = {}  # (threads, bucket) -> recent step seconds
        self._next_trial = self._trial_deadline = 0.0

    def begin(self) -> float:
        if self.most is None:
            self.most = self.threads = torch.get_num_threads()
            self._next_trial = self._clock() + self.period_s
        return self._clock()

    def end(self, num_tokens: int, started: float) -> None:
        now = self._clock()
        bucket = max(1, num_tokens).bit_length()  # steps of 1, 2-3, 4-7, ... tokens compare with each other
        key = (self.threads, bucket)
        self.samples.setdefault(key, deque(maxlen=self.trial_steps)).append(now - started)
        if self.trial is not None:
            back, tb = self.trial
            if bucket == tb and len(self.samples[key]) >= self.trial_steps:
                self._decide(back, tb, now)
            elif now >= self._trial_deadline:  # steps of that size stopped coming: no verdict
                self._set(back)
                self.trial, self._next_trial = None, now + self.period_s
        elif now >= self._next_trial and len(self.samples[key]) >= self.trial_steps:
            other = self.most - 1 if self.threads == self.most else self.most
            self.samples.pop((other, bucket), None)  # a trial measures the machine as it is now
            self.trial, self._trial_deadline = (self.threads, bucket), now + 2 * self.period_s
            self._set(other)

    def _decide(self, back: int, bucket: int, now: float) -> None:
        tried = statistics.median(self.samples[(self.threads, bucket)])
        kept = statistics.median(self.samples[(back, bucket)])
        if tried >= kept * (1 - self.margin):
            self._set(back)
        self.trial, self._next_trial = None, now + self.period_s

    def _set(self, threads: int) -> None:
        torch.set_num_threads(threads)
        self.threads = threads


def governor_for(policy: str, device: torch.device, sharded: bool) -> ThreadGovernor | None:
    """The governor of a worker: ``adaptive`` on a CPU device with more than one thread, unless tensor parallel
    ranks split the cores themselves; None otherwise (``fixed``: torch's threads as set). ValueError for an unknown
    policy."""
    if policy not in POLICIES:
        raise ValueError(f"cpu_thread_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    usable = policy == "adaptive" and device.type == "cpu" and not sharded
    return ThreadGovernor() if usable and torch.get_num_threads() > 1 else None
