"""Run a function on N tensor-parallel ranks of this machine: N spawned processes joined in one gloo (CPU) or
NCCL (CUDA) group over loopback, each with an explicit number of OMP threads.

``run_tensor_parallel(fn, 2, args)`` calls ``fn(tp, *args)`` on every rank (``tp`` its
:class:`~pagedllm.distributed.parallel_state.TPGroup`) and returns the ranks' results in rank order. When a
rank raises or dies, the others' collectives fail within the group's timeout, every rank exits, and
:class:`TPLaunchError` reports each rank's fate: never a hang.
"""

from __future__ import annotations

import io
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from pagedllm.distributed.parallel_state import DEFAULT_TIMEOUT_S, destroy_tp_group, init_tp_group

# spawn + import torch and the model per rank; the collectives' own timeout comes on top
STARTUP_S = 120.0


class TPLaunchError(RuntimeError):
    """At least one rank raised or died; the message gives every failed rank's error."""


def free_port() -> int:
    """A TCP port free on loopback now (for the group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, threads: int, timeout_s: float, backend: str | None,
               fn: Callable[..., Any], args: tuple, results: Any) -> None:
    """One rank: join the group, run ``fn``, post ``(rank, ok, payload)`` (the result saved by torch.save, so
    tensors travel as bytes and outlive this process; or the formatted traceback)."""
    torch.set_num_threads(threads)
    try:
        tp = init_tp_group(rank, world_size, "127.0.0.1", port, backend, timeout_s)
        buf = io.BytesIO()
        torch.save(fn(tp, *args), buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        results.put((rank, False, traceback.format_exc()))
    finally:
        destroy_tp_group()


def run_tensor_parallel(fn: Callable[..., Any], world_size: int, args: tuple = (), threads_per_rank: int = 1,
                        timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None) -> list[Any]:
    """``[fn(tp, *args) on rank r for r in range(world_size)]``, each rank in its own spawned process with
    ``threads_per_rank`` OMP threads. ``fn`` and ``args`` must be picklable (a module-level function).
    TPLaunchError if a rank fails, dies or the whole run outlives ``STARTUP_S + 2 * timeout_s``."""
    if world_size < 1 or threads_per_rank < 1:
        raise ValueError(f"world_size and threads_per_rank must be >= 1, got {world_size}, {threads_per_rank}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, world_size, port, threads_per_rank, timeout_s, backend, fn, args, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + STARTUP_S + 2 * timeout_s
    try:
        while len(got) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, payload = results.get(timeout=0.2)
                got[rank] = (ok, payload)
            except queue.Empty:
                if all(not p.is_alive() for r, p in enumerate(procs) if r not in got) and results.empty():
                    break  # every rank still owing a result has exited without one
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    failures = []
    for r, p in enumerate(procs):
        if r not in got:
            failures.append(f"rank {r} died (exit code {p.exitcode}) without a result")
        elif not got[r][0]:
            failures.append(f"rank {r} raised:\n{got[r][1]}")
    if failures:
        raise TPLaunchError(f"tensor-parallel run of {world_size} ranks failed:\n" + "\n".join(failures))
    return [torch.load(io.BytesIO(got[r][1]), weights_only=False) for r in range(world_size)]
