"""The process environment pagedllm sets before torch loads: OpenMP's spin count per CPU class, the user's values
kept."""

from __future__ import annotations

import os
import subprocess
import sys

from pagedllm import cpu_env

ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "THP_MEM_ALLOC_ENABLE", "MALLOC_ARENA_MAX")


def test_the_spin_count_is_long_on_amx_cpus_and_short_elsewhere():
    xeon = "fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8"
    assert cpu_env.spin_count(xeon) == "10000"
    assert cpu_env.spin_count("fpu avx2 avx512f avx512_bf16 avx512_vnni") == "1000"  # Zen 4 / 5
    assert cpu_env.spin_count("fpu avx2 fma") == "1000"  # Zen 3
    assert cpu_env.spin_count("") == "1000"  # no /proc/cpuinfo
    assert cpu_env.spin_count("amx_tilex") == "1000"  # a whole flag, not a prefix


def test_defaults_fill_what_the_user_did_not_set(monkeypatch):
    for k in ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(cpu_env, "cpu_flags", lambda: "avx512f amx_tile")
    cpu_env.set_defaults()
    assert [os.environ[k] for k in ENV] == ["PASSIVE", "10000", "1", "2"]
    monkeypatch.setattr(cpu_env, "cpu_flags", lambda: "avx512f avx512_bf16")
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    cpu_env.set_defaults()
    assert os.environ["GOMP_SPINCOUNT"] == "1000" and os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.setenv("GOMP_SPINCOUNT", "77")
    cpu_env.set_defaults()
    assert os.environ["GOMP_SPINCOUNT"] == "77"


# records GOMP_SPINCOUNT as torch's import starts, then imports pagedllm
_PROBE = """
import builtins, os, sys
seen, real = [], builtins.__import__
def probe(name, *a, **k):
    if name == "torch" and not seen:
        seen.append(os.environ.get("GOMP_SPINCOUNT"))
    return real(name, *a, **k)
builtins.__import__ = probe
import pagedllm
from pagedllm import cpu_env
print(seen[0], cpu_env.spin_count(cpu_env.cpu_flags()))
"""


def test_importing_pagedllm_sets_this_cpus_spin_count_before_torch_loads():
    env = {k: v for k, v in os.environ.items() if k not in ENV}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    at_torch, expected = out.stdout.split()
    assert at_torch == expected
    env["GOMP_SPINCOUNT"] = "123"
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == "123"
