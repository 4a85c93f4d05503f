"""The disk tier under faults: nothing wrong is ever served and the accounting stays exact."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys

import torch

from pagedllm.kv.disk_tier import DiskTier, directory_hash_key
from pagedllm.kv.tier_policy import make_policy
from tests.kv.tier_helpers import (
    FINGERPRINT,
    evict_all,
    fill,
    make_tiers,
    pool_kv,
    prompt,
)

TOKENS = (1, 2, 3, 4)


def _payload(h: int, size: int) -> bytes:
    return bytes([h % 251]) * size


def _files(path) -> list[str]:
    return sorted(f for f in os.listdir(path) if f.endswith(".kvb"))


def _saved_prompt(tmp_path) -> tuple[list[int], torch.Tensor]:
    m, kv, _ = make_tiers(num_blocks=8, disk_path=str(tmp_path))
    tokens = prompt(7, 3)
    data = fill(m, kv, 1, tokens)
    m.close()
    assert len(_files(tmp_path)) == 3
    return tokens, data


def _restart_and_fetch(tmp_path, tokens):
    m, kv, store = make_tiers(num_blocks=8, disk_path=str(tmp_path))
    m.prefetch(tokens, wait=True)
    m.check_integrity()
    return m, kv, store


def _damage(tmp_path, how) -> None:
    """Damage the file of the prompt's second block (files are named by hash: find it by its mtime order)."""
    victims = sorted((os.path.getmtime(tmp_path / f), f) for f in _files(tmp_path))
    path = tmp_path / victims[1][1]
    blob = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(blob[: len(blob) // 2])
    else:
        blob[len(blob) // 2] ^= 0x10
        path.write_bytes(bytes(blob))


def _check_damaged_run(tmp_path, how):
    tokens, data = _saved_prompt(tmp_path)
    _damage(tmp_path, how)
    m, kv, store = _restart_and_fetch(tmp_path, tokens)
    n, got = pool_kv(m, kv, tokens)
    # every block served is exact; the damaged one and those after it are not served
    assert n < 3 and (n == 0 or torch.equal(got, data[:, :, :, :n]))
    assert store.disk.num_corrupt == 1
    assert len(_files(tmp_path)) == 2  # the damaged file is deleted
    m.check_integrity()


def test_truncated_file_is_detected_and_never_served(tmp_path):
    _check_damaged_run(tmp_path, "truncate")


def test_bit_flipped_file_is_detected_and_never_served(tmp_path):
    _check_damaged_run(tmp_path, "flip")


def test_another_models_files_are_never_served(tmp_path):
    tokens, _ = _saved_prompt(tmp_path)
    m, kv, store = make_tiers(num_blocks=8, disk_path=str(tmp_path), fingerprint=b"g" * 32)
    assert m.prefetch(tokens, wait=True) is False
    assert pool_kv(m, kv, tokens)[0] == 0 and store.stats.promoted_blocks["disk"] == 0
    # even a foreign file renamed to the name this model would look up is refused (header fingerprint)
    d = DiskTier(str(tmp_path), 1 << 20, FINGERPRINT, make_policy("lru"))
    d.write(5, TOKENS, _payload(5, 100))
    other = DiskTier(str(tmp_path), 1 << 20, b"g" * 32, make_policy("lru"))
    os.replace(d._file(5), other._file(5))
    assert other.read(5, TOKENS) is None and other.num_corrupt == 1


def test_a_block_under_other_tokens_is_refused(tmp_path):
    d = DiskTier(str(tmp_path), 1 << 20, FINGERPRINT, make_policy("lru"))
    d.write(5, TOKENS, _payload(5, 100))
    assert d.read(5, (9, 9, 9, 9)) is None
    d.check_integrity()


def test_full_disk_stops_demotion_with_a_warning(tmp_path, monkeypatch, caplog):
    from pagedllm.kv import disk_tier

    real_replace = os.replace

    def no_space(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_tier.os, "replace", no_space)
    m, kv, store = make_tiers(num_blocks=8, host_slots=3, disk_path=str(tmp_path))
    fill(m, kv, 1, prompt(7, 3))
    evict_all(m)  # L2 holds these three blocks
    tokens = prompt(8, 3)
    data = fill(m, kv, 1, tokens)
    with caplog.at_level(logging.WARNING, logger="pagedllm.kv.disk_tier"):
        evict_all(m)  # ... which leave L2 for the disk (write-back) and find it full
        store.flush()
    assert store.disk.full and "is full" in caplog.text
    assert _files(tmp_path) == [] and not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]
    assert store.disk.used_bytes == 0
    m.check_integrity()
    # the host tier still serves; the engine goes on
    m.prefetch(tokens)
    n, got = pool_kv(m, kv, tokens)
    assert n == 3 and torch.equal(got, data)
    fill(m, kv, 2, prompt(9, 3))
    evict_all(m)
    store.flush()
    assert store.stats.demoted_blocks["disk"] == 0  # demotion to disk stopped
    monkeypatch.setattr(disk_tier.os, "replace", real_replace)
    m.check_integrity()


def test_disk_capacity_evicts_files_and_counts_bytes(tmp_path):
    d = DiskTier(str(tmp_path), 3 * 300, FINGERPRINT, make_policy("lru"))
    for h in range(6):
        assert d.write(h, TOKENS, _payload(h, 200))
    assert len(d) == len(_files(tmp_path)) <= 3 and d.used_bytes <= 900
    assert d.read(5, TOKENS) == _payload(5, 200) and d.read(0, TOKENS) is None
    d.check_integrity()


_WRITER = """
import sys
from pagedllm.kv.disk_tier import DiskTier, directory_hash_key
from pagedllm.kv.tier_policy import make_policy
path, first, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
print(directory_hash_key(path).hex(), flush=True)
d = DiskTier(path, 1 << 40, b"f" * 32, make_policy("lru"))
for h in range(first, first + n):
    d.write(h, (1, 2, 3, 4), bytes([h % 251]) * size)
print("done", flush=True)
"""


def _writer(path, first, n, size) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(first), str(n), str(size)],
                            stdout=subprocess.PIPE, text=True, env=env)


_HANGING_WRITER = """
import builtins, sys, threading
import pagedllm.kv.disk_tier as disk_tier
from pagedllm.kv.tier_policy import make_policy
path, hang_at = sys.argv[1], int(sys.argv[2])
d = disk_tier.DiskTier(path, 1 << 40, b"f" * 32, make_policy("lru"))
for h in range(hang_at + 1):
    if h == hang_at:  # the next file is written half-way, then the writer stalls until it is killed
        class Half:
            def __init__(self, f): self.f = f
            def __enter__(self): return self
            def __exit__(self, *a): return self.f.__exit__(*a)
            def write(self, b):
                self.f.write(b[: len(b) // 2]); self.f.flush()
                print("writing", flush=True)
                threading.Event().wait()
        disk_tier.open = lambda p, m: Half(builtins.open(p, m))
    d.write(h, (1, 2, 3, 4), bytes([h % 251]) * 4096)
"""


def test_kill_9_mid_write_leaves_no_partial_file(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen([sys.executable, "-c", _HANGING_WRITER, str(tmp_path), "3"], stdout=subprocess.PIPE,
                         text=True, env=env)
    assert p.stdout.readline().strip() == "writing"  # block 3 is half on disk, in its temp file
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]  # it died mid-write
    d = DiskTier(str(tmp_path), 1 << 40, FINGERPRINT, make_policy("lru"))
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]  # the dead writer's temp is gone
    assert [d.read(h, TOKENS) for h in range(4)] == [_payload(h, 4096) for h in range(3)] + [None]
    assert len(_files(tmp_path)) == 3 and d.num_corrupt == 0
    d.check_integrity()


def test_two_engines_share_one_directory(tmp_path):
    size = 1 << 16
    procs = [_writer(tmp_path, 0, 200, size), _writer(tmp_path, 100, 200, size)]  # 100 blocks written by both
    outs = [p.communicate(timeout=300)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0][0] == outs[1][0] == directory_hash_key(str(tmp_path)).hex()  # one shared hash key
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]
    d = DiskTier(str(tmp_path), 1 << 40, FINGERPRINT, make_policy("lru"))
    assert all(d.read(h, TOKENS) == _payload(h, size) for h in range(300))
    assert d.num_corrupt == 0 and len(_files(tmp_path)) == 300
    d.check_integrity()


def test_capacity_counts_files_left_by_earlier_runs(tmp_path):
    d = DiskTier(str(tmp_path), 1 << 20, FINGERPRINT, make_policy("lru"))
    for h in range(4):
        d.write(h, TOKENS, _payload(h, 200))
        os.utime(d._file(h), ns=((h + 1) * 10**9,) * 2)  # written in this order (mtime ticks can be coarse)
    size = d.used_bytes
    # a restart with room for two files: the oldest files of the earlier run make room
    d2 = DiskTier(str(tmp_path), size // 2 + 1, FINGERPRINT, make_policy("lru"))
    assert d2.used_bytes == size and len(d2) == 4
    assert d2.write(9, TOKENS, _payload(9, 200))
    assert d2.used_bytes <= size // 2 + 1 and len(_files(tmp_path)) == len(d2) == 2
    assert d2.read(9, TOKENS) == _payload(9, 200) and d2.read(3, TOKENS) == _payload(3, 200)
    d2.check_integrity()
