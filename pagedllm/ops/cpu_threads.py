"""OpenMP threads that survive a shared machine: the CPU kernels' thread count follows the cores other processes
leave free.

pagedllm's OpenMP threads spin at barriers for ``GOMP_SPINCOUNT`` iterations before sleeping (``pagedllm/__init__``):
on dedicated cores that is what makes batch-1 decode fast (a step has ~150 parallel regions, waking a sleeping
thread costs 25-45 us). When another busy process takes one of the cores, a team that still counts on that core
waits at every barrier for a thread the scheduler has parked, for whole time slices (batch 1 fell from 145 to 45
tok/s with spin 1000 on a 2-core Zen 5). libgomp reads its wait policy once, at start, so the policy cannot change
at run time; the team's size can. :class:`ThreadGovernor` measures, every ``period_s`` of the forward thread's
steps, how much CPU time other processes (and a hypervisor's steal) took on this process's cores, from
``/proc/stat`` less this process's own ``/proc/self/stat`` time, and sets torch's threads (which every pagedllm
kernel and ATen op in that thread uses) to the cores left free: a team that never waits on a core it does not
have. When the neighbour goes, the next reading gives the threads back.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

POLICIES = ("adaptive", "fixed")
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # /proc/stat: user nice system irq softirq steal (not idle, iowait)


@dataclass(frozen=True)
class CpuTimes:
    """Cumulative clock ticks: busy and total over a set of CPUs (all processes), and this process's own."""

    busy: int
    total: int
    ours: int


def read_cpu_times(cpus: frozenset[int]) -> CpuTimes:
    """Ticks from ``/proc/stat``'s per-CPU lines of ``cpus`` and ``/proc/self/stat`` (utime + stime)."""
    busy = total = 0
    with open("/proc/stat", encoding="ascii") as f:
        for line in f:
            name, *fields = line.split()
            if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
                continue
            ticks = [int(v) for v in fields]
            busy += sum(ticks[i] for i in BUSY_FIELDS if i < len(ticks))
            total += sum(ticks[:8])
    with open("/proc/self/stat", encoding="ascii") as f:
        after_comm = f.read().rsplit(")", 1)[1].split()
    return CpuTimes(busy, total, int(after_comm[11]) + int(after_comm[12]))  # fields 14, 15 of the line


def others_cores(before: CpuTimes, after: CpuTimes, num_cpus: int) -> float:
    """How many of ``num_cpus`` cores other processes kept busy between two readings."""
    total = after.total - before.total
    if total <= 0:
        return 0.0
    others = (after.busy - before.busy) - (after.ours - before.ours)
    return max(0.0, others / total * num_cpus)


def threads_for(others: float, num_cpus: int, most: int) -> int:
    """Threads for the cores left free: a core counts as taken when a neighbour used more than half of it."""
    return max(1, min(most, num_cpus - int(others + 0.5)))


class ThreadGovernor:
    """Adapts torch's thread count to contention; call :meth:`adapt` in the thread that runs the forward passes
    (OpenMP's thread count is per calling thread), before each step. Between readings it costs a clock read."""

    def __init__(self, period_s: float = 0.5, read: Callable[[frozenset[int]], CpuTimes] = read_cpu_times,
                 clock: Callable[[], float] = time.monotonic):
        self.cpus = frozenset(os.sched_getaffinity(0))
        self.period_s, self._read, self._clock = period_s, read, clock
        self.most: int | None = None  # the thread count the engine started with: never exceeded
        self.threads: int | None = None
        self.others = 0.0  # the last reading: cores other processes took
        self._last: CpuTimes | None = None
        self._next = 0.0

    def adapt(self) -> None:
        now = self._clock()
        if now < self._next:
            return
        self._next = now + self.period_s
        if self.most is None:
            self.most = self.threads = torch.get_num_threads()
        reading = self._read(self.cpus)
        if self._last is not None:
            self.others = others_cores(self._last, reading, len(self.cpus))
            want = threads_for(self.others, len(self.cpus), self.most)
            if want != self.threads:
                torch.set_num_threads(want)
                self.threads = want
        self._last = reading


def governor_for(policy: str, device: torch.device, sharded: bool) -> ThreadGovernor | None:
    """The governor of a worker: ``adaptive`` on a CPU device with more than one thread, unless tensor parallel
    ranks split the cores themselves; None otherwise (``fixed``: torch's threads as set). ValueError for an unknown
    policy."""
    if policy not in POLICIES:
        raise ValueError(f"cpu_thread_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    usable = policy == "adaptive" and device.type == "cpu" and not sharded and os.path.exists("/proc/stat")
    return ThreadGovernor() if usable and torch.get_num_threads() > 1 else None
