"""The tensor-parallel process group: init/destroy over torch.distributed, and the two collectives a
sharded model needs (sum of partial outputs, concatenation of vocab slices).

gloo on CPU, NCCL on CUDA. Every collective runs under the group's timeout, and a failure (a peer rank
died, the network dropped, the timeout passed) becomes a :class:`TPError` naming this rank and the
collective, so a dead worker stops the others with a clear error instead of a hang.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0


class TPError(RuntimeError):
    """A collective of the tensor-parallel group failed: a peer died, or it did not answer in time."""


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group and its collectives (``group`` None: the default
    group). A sharded model holds one; an unsharded model holds none and pays nothing."""

    rank: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    group: dist.ProcessGroup | None = None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place (row-parallel outputs, vocab-parallel embedding rows)."""
        try:
            dist.all_reduce(t, group=self.group)
        except Exception as e:  # gloo/NCCL raise RuntimeError or DistBackendError
            raise self._error("all_reduce", e) from e
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``t`` (same shape on each) concatenated along ``dim`` in rank order."""
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        try:
            dist.all_gather(parts, t.contiguous(), group=self.group)
        except Exception as e:
            raise self._error("all_gather", e) from e
        return torch.cat(parts, dim)

    def _error(self, op: str, e: BaseException) -> TPError:
        return TPError(f"tensor-parallel {op} failed on rank {self.rank} of {self.world_size} (a peer rank died "
                       f"or did not answer within {self.timeout_s:g} s): {type(e).__name__}: {e}")


def default_backend() -> str:
    """NCCL when CUDA is there, gloo otherwise (CPU)."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_tp_group(rank: int, world_size: int, master_addr: str = "127.0.0.1", master_port: int = 29500,
                  backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup:
    """Join a ``world_size``-rank group as ``rank`` (rendezvous over TCP at ``master_addr:master_port``, which
    rank 0 serves). ValueError names a bad rank or size."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    return _join(f"tcp://{master_addr}:{master_port}", rank, world_size, backend, timeout_s)


def init_tp_group_from_env(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup:
    """Join the group ``torchrun`` describes in the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
    and its agent's store): one node or many (``--nnodes``, ``--node-rank``, ``--master-addr``)."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(f"not launched by torchrun: {', '.join(missing)} unset")
    return _join("env://", int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), backend, timeout_s)


def _join(init_method: str, rank: int, world_size: int, backend: str | None, timeout_s: float) -> TPGroup:
    """``init_process_group`` with the collectives' timeout; on CUDA each rank takes device ``rank % count``."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    return TPGroup(rank, world_size, timeout_s)


def destroy_tp_group() -> None:
    """Leave the group (a no-op when none was joined)."""
    if dist.is_initialized():
        dist.destroy_process_group()
