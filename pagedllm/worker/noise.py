"""Counter-based random noise for sampling: a hash of (row key, counter, token id), computed by tensor
ops on any device.

A per-request ``torch.Generator`` cannot be used inside one batched op (each seeded row would need
its own draw, a Python loop) nor inside a CUDA graph. A hash can: every value is a pure function of
its inputs, so a seeded request draws the same noise whatever its batch mates, batch order or device,
and the same op serves the whole batch. The mixer is the 32-bit integer hash with multiplier
``0x45d9f3b`` (xor-shift-multiply rounds) on int32 with wrapping multiplication.
"""

from __future__ import annotations

import torch

_MUL = 0x45D9F3B
_GOLDEN = 0x9E3779B1 - (1 << 32)  # 2**32 / phi as a signed 32-bit value


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of an int32 tensor, in place (multiplication wraps modulo 2**32; the shifts
    are masked so they act as logical shifts on negative values). int32, not int64: the CPU vectorises
    32-bit multiplies (about 100x faster than int64's here); in place, as fresh vocab-sized temporaries
    cost page faults on the CPU."""
    tmp = torch.empty_like(x)
    for mul in (_MUL, _MUL, None):
        torch.bitwise_right_shift(x, 16, out=tmp).bitwise_and_(0xFFFF)
        x.bitwise_xor_(tmp)
        if mul is not None:
            x.mul_(mul)
    return x


def _mix64_host(x: int) -> int:
    """splitmix64's finalizer on a Python int (host-side key derivation)."""
    x &= (1 << 64) - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return x ^ (x >> 31)


def noise_key(seed: int | None, sample_index: int) -> int:
    """A row's 32-bit noise key: fixed by (seed, sample index) for a seeded request, else drawn from torch's
    global generator (seeded by the engine; tensor-parallel ranks draw alike, so they sample alike)."""
    if seed is None:
        return int(torch.randint(0, 1 << 32, (1,)))
    return _mix64_host(seed * 1_000_003 + sample_index) >> 32


def exponential_noise(keys: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[R, vocab]`` float32 draws of Exp(1): row ``r`` is a function of ``keys[r]`` and ``counters[r]``
    only (the counter is the sequence's length, so each step of a sequence draws afresh)."""
    dev = keys.device
    keys32 = (keys.to(torch.int64) & 0xFFFFFFFF).to(torch.int32)  # wraps to the signed 32-bit value
    row = mix32(keys32 ^ mix32(counters.to(torch.int32) * _GOLDEN))
    col = mix32(torch.arange(vocab, device=dev, dtype=torch.int32).mul_(_GOLDEN))
    bits = mix32(row[:, None] ^ col[None, :]).bitwise_right_shift_(8).bitwise_and_(0xFFFFFF)  # 24 uniform bits
    # u in (0, 1): log never sees 0, and never 1 either: (2**24 - 1) + 0.5 rounds to 2**24 in float32, and an E of
    # -0.0 would turn every masked (zero-probability) token into 0 / -0 = NaN, which argmax picks
    return bits.to(torch.float32).add_(0.5).mul_(1.0 / (1 << 24)).clamp_(max=1.0 - 2.0**-24).log_().neg_()
