"""The malloc settings keep a step's freed activations in the heap: re-allocating them faults in no new pages."""

import os
import statistics
import subprocess
import sys

import pytest

from pagedllm.config import host_memory

# allocate, touch and free 10 MB and 24 MB tensors, as an engine step's activations, and count the page faults of
# each repeat (the first round warms the heap)
PROBE = """
import resource, torch
import pagedllm
from pagedllm.config import host_memory
def step():
    a = torch.ones(10 << 20, dtype=torch.uint8)
    b = torch.ones(24 << 20, dtype=torch.uint8)
    del a, b
step()
for _ in range(20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

glibc_only = pytest.mark.skipif(not host_memory._glibc(), reason="mallopt is glibc's")


def _faults(**env: str) -> float:
    """The median round's page faults: a round the machine disturbs (the whole suite beside it, on a 2-core VM: 1,572
    faults over 20 kept rounds once, where a quiet run has none) does not decide it."""
    clean = {k: v for k, v in os.environ.items() if k not in host_memory.USER_SETTINGS + (host_memory.SWITCH,)}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                         check=True)
    return statistics.median(int(n) for n in out.stdout.split())


@glibc_only
def test_repeated_step_allocations_fault_in_no_pages():
    # glibc's defaults map a round's blocks afresh (~525 faults a round, 4 KB pages); kept, none in a quiet run
    kept, dropped = _faults(), _faults(**{host_memory.SWITCH: "0"})
    assert kept * 10 < dropped, (kept, dropped)


@glibc_only
def test_user_malloc_settings_win(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert host_memory.keep_freed_memory() is False
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv(host_memory.SWITCH, "0")
    assert host_memory.keep_freed_memory() is False
    monkeypatch.delenv(host_memory.SWITCH)
    assert host_memory.keep_freed_memory() is True
