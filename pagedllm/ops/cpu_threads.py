"""OpenMP threads that survive a shared machine: the CPU kernels' thread count is the one whose steps measure faster,
re-tried while the engine runs.

pagedllm's OpenMP threads spin at barriers for ``GOMP_SPINCOUNT`` iterations before sleeping
(``pagedllm/cpu_env.py``): on dedicated cores that is what makes batch-1 decode fast (a step has ~150 parallel
regions, waking a sleeping thread costs 25-45 us). When another busy process takes one of the cores, a team that
still counts on that core waits at every barrier for a thread the scheduler has parked, for whole time slices (batch
1 fell from 145 to 45 tok/s with spin 1000 on a 2-core Zen 5). libgomp reads its wait policy once, at start, so the
policy cannot change at run time; the team's size can. Whether one thread fewer pays depends on the neighbours (one
busy process on one core: it does; a machine oversubscribed many times over: more threads get more of the CPU), so
it is measured, not inferred: :class:`ThreadGovernor` times every forward pass per step size, and every ``period_s``
(the first time after ``first_trial_s``) runs ``trial_steps`` steps of one size on the other thread count and as
many again on the current one; the other count takes over only when its median beats both, and only for steps of
that size. A trial whose first few steps are all clearly slower ends there (on free cores one thread fewer runs
batch-1 ~1.6x slower, and 8 such steps cost a 128-token run ~2-3%). A trial of fewer threads is only worth its steps
when a neighbour takes our cores, and the kernel counts that: the time our threads spent runnable but waiting for a
core (``/proc/self/task/*/schedstat``). Where the teams on ``most`` threads waited less than ``quiet_wait`` of their
time since the last look, no trial runs (a quiet machine pays nothing); where the count is unknown, trials run as
before. Sizes choose apart because they answer apart: a decode step of a few rows is ~150 short parallel regions,
each a barrier a parked thread can hold up, where a prefill chunk's GEMMs are long enough to use every core they get.
One choice for all sizes made serving slow: a trial on single-row decode steps that hit its deadline ran every step
on one thread for 6 s, prefills included, and a verdict won on decode steps would have too (at 2 req/s, TTFT p99
~2x the fixed policy's; see bench/README.md, threads).
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

POLICIES = ("adaptive", "fixed")


def run_queue_wait_s(tasks: str = "/proc/self/task") -> float | None:
    """Seconds this process's threads have spent runnable but waiting for a CPU, summed over the threads alive now
    (the second field of each ``/proc/self/task/<tid>/schedstat``); None where the kernel does not say (no such
    file, or the "0 0 0" of a kernel that does not count: a thread that ran has a run time)."""
    ran = waited = 0
    try:
        for tid in os.listdir(tasks):
            try:
                with open(os.path.join(tasks, tid, "schedstat")) as f:
                    fields = f.read().split()
            except FileNotFoundError:  # the thread ended while we listed
                continue
            ran, waited = ran + int(fields[0]), waited + int(fields[1])
    except (OSError, ValueError, IndexError):
        return None
    return waited / 1e9 if ran else None


def bucket_of(num_tokens: int) -> int:
    """Steps of 1, 2-3, 4-7, ... tokens compare with each other and share a thread count."""
    return max(1, num_tokens).bit_length()


@dataclass
class Trial:
    """One A-B-A comparison on steps of one size: ``other`` must beat ``back`` measured before and after it."""

    back: int  # the thread count the size's steps ran on
    other: int  # the one tried
    bucket: int
    before: float  # median step seconds on ``back`` before the trial
    started: float
    deadline: float
    tried: float | None = None  # median on ``other``, once measured


class ThreadGovernor:
    """Chooses, per step size, between torch's thread count at start (``most``) and one thread fewer by measuring
    both. Call :meth:`begin` and :meth:`end` around each forward pass, in the thread that runs them (OpenMP's thread
    count is per calling thread). A trial runs ``trial_steps`` steps of one size on the other count, then as many
    back on its current one; the other count wins that size only if it beats both by ``margin`` (a shared machine's
    speed drifts). Steps of other sizes run on their own counts meanwhile. A size on ``most`` threads is tried only
    when our threads were kept waiting for a CPU since the last look (see the module's docstring)."""

    TRIAL_SHARE = 20  # the gap to the next trial is at least this many times the last trial's length
    # Steps of 64 tokens and more are never tried on fewer threads: their GEMMs split evenly, so a team with one
    # contended core should take about as long as one thread fewer (not measured), while a trial would run 8 of a
    # light serving load's few prefills on one thread, each ~2x slower.
    TRIAL_MAX_BUCKET = bucket_of(63)

    def __init__(self, period_s: float = 2.0, trial_steps: int = 8, margin: float = 0.05,
                 clock: Callable[[], float] = time.perf_counter, first_trial_s: float = 0.5, early_steps: int = 3,
                 early_loss: float = 0.25, waits: Callable[[], float | None] = run_queue_wait_s,
                 quiet_wait: float = 0.05):
        self.period_s, self.trial_steps, self.margin, self._clock = period_s, trial_steps, margin, clock
        # ``waits``: the process's cumulative run-queue wait in seconds (None: unknown, trials run as before);
        # trials of fewer threads are skipped while it grew by less than ``quiet_wait`` of ``most`` threads' time
        self._waits, self.quiet_wait = waits, quiet_wait
        self._waited: tuple[float, float | None] = (0.0, None)  # (clock, waits()) at the last look
        # the other count loses early when even the fastest of its first ``early_steps`` steps is ``early_loss``
        # slower than the current count's median: it could not win by ``margin`` over the rest of the trial
        self.early_steps, self.early_loss = early_steps, early_loss
        # The first trial comes sooner than ``period_s``: a team that waits on a contended core loses the most
        # before it (2 s is a whole 128-token batch-1 run; an AMX Xeon at spin 10000 ran 38 tok/s on two
        # contended threads, 60 on one)
        self.first_trial_s = min(first_trial_s, period_s)
        self.most: int | None = None
        self.chosen: dict[int, int] = {}  # step size (bucket) -> its thread count, where it is not ``most``
        self.threads: int | None = None  # what the last step ran on
        self.trial: Trial | None = None
        self.samples: dict[tuple[int, int], deque[float]] = {}  # (threads, bucket) -> recent step seconds
        self._next_trial = 0.0

    def threads_for(self, bucket: int) -> int:
        """The thread count steps of ``bucket`` run on now (the other one while a trial measures it)."""
        t = self.trial
        if t is not None and t.bucket == bucket:
            return t.other if t.tried is None else t.back
        return self.chosen.get(bucket, self.most)

    def begin(self, num_tokens: int) -> float:
        if self.most is None:
            self.most = self.threads = torch.get_num_threads()
            start = self._clock()
            self._next_trial, self._waited = start + self.first_trial_s, (start, self._waits())
        threads = self.threads_for(bucket_of(num_tokens))
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
        return self._clock()

    def end(self, num_tokens: int, started: float) -> None:
        now = self._clock()
        bucket = bucket_of(num_tokens)
        key = (self.threads, bucket)
        self.samples.setdefault(key, deque(maxlen=self.trial_steps)).append(now - started)
        full = len(self.samples[key]) >= self.trial_steps
        t = self.trial
        if t is not None:
            if bucket == t.bucket and t.tried is None and self._lost_early(key, t.before):
                self.samples.pop(key)
                self._finish(now)
            elif bucket == t.bucket and full and t.tried is None:  # measured the other count: back, measure again
                t.tried = statistics.median(self.samples.pop(key))
                self.samples.pop((t.back, bucket), None)
            elif bucket == t.bucket and full:
                if t.tried < (1 - self.margin) * min(t.before, statistics.median(self.samples[key])):
                    if t.other == self.most:
                        self.chosen.pop(bucket, None)
                    else:
                        self.chosen[bucket] = t.other
                self._finish(now)
            elif now >= t.deadline:  # steps of that size stopped coming: no verdict
                self._finish(now)
        elif now >= self._next_trial and full and bucket <= self.TRIAL_MAX_BUCKET:
            if self.threads == self.most and self._quiet(now):
                self._next_trial = now + self.period_s
                return
            other = self.most - 1 if self.threads == self.most else self.most
            self.samples.pop((other, bucket), None)  # a trial measures the machine as it is now
            self.trial = Trial(self.threads, other, bucket, statistics.median(self.samples[key]), now,
                               now + 3 * self.period_s)

    def _quiet(self, now: float) -> bool:
        """Whether our threads waited for a CPU less than ``quiet_wait`` of ``most`` threads' time since the last
        look (False when the wait is unknown); the look starts the next interval."""
        (then, before), waited = self._waited, self._waits()
        self._waited = (now, waited)
        if waited is None or before is None or now <= then:
            return False
        return waited - before < self.quiet_wait * self.most * (now - then)

    def _lost_early(self, key: tuple[int, int], before: float) -> bool:
        """Whether the trial's first ``early_steps`` steps on the other count are all slower than it can afford."""
        steps = self.samples[key]
        return len(steps) == self.early_steps and min(steps) > (1 + self.early_loss) * before

    def _finish(self, now: float) -> None:
        """The next trial after ``period_s``, or 20 times this trial's length when that is longer: a trial's steps
        on the slower count then cost at most a few % of the time (long W1 steps make long trials)."""
        spent = now - self.trial.started
        self.trial, self._next_trial = None, now + max(self.period_s, self.TRIAL_SHARE * spent)


def governor_for(policy: str, device: torch.device, sharded: bool) -> ThreadGovernor | None:
    """The governor of a worker: ``adaptive`` on a CPU device with more than one thread, unless tensor parallel
    ranks split the cores themselves; None otherwise (``fixed``: torch's threads as set). ValueError for an unknown
    policy."""
    if policy not in POLICIES:
        raise ValueError(f"cpu_thread_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    usable = policy == "adaptive" and device.type == "cpu" and not sharded
    return ThreadGovernor() if usable and torch.get_num_threads() > 1 else None
