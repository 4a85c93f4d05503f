"""Attention backends over the paged KV pool, chosen by name."""

from __future__ import annotations

from pagedllm.attention.base import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata, write_kv

BACKENDS = ("reference",)


def get_backend(name: str) -> AttentionBackend:
    """Instantiate the backend called ``name``; ValueError lists the known ones."""
    if name == "reference":
        from pagedllm.attention.reference import ReferenceBackend

        return ReferenceBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")


__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend", "write_kv", "BACKENDS"]
