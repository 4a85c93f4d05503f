"""The malloc settings keep a step's freed activations in the heap: re-allocating them faults in no new pages."""

import os
import subprocess
import sys

import pytest

from pagedllm.config import host_memory

# allocate, touch and free 10 MB and 24 MB tensors, as an engine step's activations, and count the page faults of
# the repeats (the first round warms the heap)
PROBE = """
import resource, torch
import pagedllm
from pagedllm.config import host_memory
def step():
    a = torch.ones(10 << 20, dtype=torch.uint8)
    b = torch.ones(24 << 20, dtype=torch.uint8)
    del a, b
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

glibc_only = pytest.mark.skipif(not host_memory._glibc(), reason="mallopt is glibc's")


def _faults(**env: str) -> int:
    clean = {k: v for k, v in os.environ.items() if k not in host_memory.USER_SETTINGS + (host_memory.SWITCH,)}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                         check=True)
    return int(out.stdout.split()[-1])


@glibc_only
def test_repeated_step_allocations_fault_in_no_pages():
    # glibc's defaults map a round's blocks afresh (here ~11,000 faults over the 20 rounds, 4 KB pages); kept, a
    # stray few hundred at most (0 in most runs)
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
