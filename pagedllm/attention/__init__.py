"""Attention backends over the paged KV pool, chosen by name.

``BACKENDS`` lists the backends that can run on this machine (the model tests parametrize over
it): ``reference`` and ``flex`` always, ``cpu`` when a C++ compiler is present (the kernel is
built on first use) or its library was built ahead of time for this machine, ``triton`` only with CUDA and
triton installed.
"""

from __future__ import annotations

import importlib.util

import torch

from pagedllm import ops
from pagedllm.attention.base import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata, write_kv

ALL_BACKENDS = ("reference", "flex", "cpu", "triton")


def _available() -> tuple[str, ...]:
    names = ["reference", "flex"]
    if ops.buildable("paged_attention"):
        names.append("cpu")
    if torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
        names.append("triton")
    return tuple(names)


BACKENDS = _available()


def default_backend() -> str:
    """The fastest backend this machine runs (measured: pagedllm/bench/attention.py): triton on CUDA,
    else the C++ paged kernel, else compiled flex."""
    return next(b for b in ("triton", "cpu", "flex", "reference") if b in BACKENDS)


def get_backend(name: str, **kwargs) -> AttentionBackend:
    """Instantiate the backend called ``name``; ValueError lists the known ones."""
    if name == "reference":
        from pagedllm.attention.reference import ReferenceBackend

        return ReferenceBackend()
    if name == "flex":
        from pagedllm.attention.flex import FlexBackend

        return FlexBackend(**kwargs)
    if name == "cpu":
        from pagedllm.attention.cpu import CpuBackend

        return CpuBackend(**kwargs)
    if name == "triton":
        from pagedllm.attention.triton_decode import TritonBackend

        return TritonBackend(**kwargs)
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(ALL_BACKENDS)}")


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "get_backend",
    "write_kv",
    "BACKENDS",
    "ALL_BACKENDS",
    "default_backend",
]
