"""Tensor parallelism across nodes: ``torchrun`` starts one process per rank (``--nnodes``, ``--node-rank``,
``--master-addr``), as vLLM's ``external_launcher`` backend. Rank 0 runs the engine core (and the API server),
holds worker rank 0 in its process and broadcasts each step's plain data to the others over a gloo control
group; every other rank runs only :func:`serve_rank`, executing the steps it receives, so the block tables
agree everywhere and the ranks meet in the model's all-reduces (which keep the TP group's short timeout).
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedllm.config.args import EngineArgs
from pagedllm.protocol.step_io import ModelRunnerOutput, SchedulerOutput, decode, encode
from pagedllm.executor.base import Executor
from pagedllm.protocol.errors import WorkerError

log = logging.getLogger("pagedllm.executor")

# An idle server sends no step for as long as it likes; a dead rank 0 still ends the wait (its socket closes).
CONTROL_TIMEOUT = timedelta(days=7)


def _join(args: EngineArgs):
    """This rank's worker on the group torchrun describes, and the control group steps travel on."""
    from pagedllm.distributed.parallel_state import init_tp_group_from_env
    from pagedllm.worker.worker import Worker

    tp = init_tp_group_from_env()
    if tp.world_size != args.tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size {args.tensor_parallel_size} differs from torchrun's world size "
                         f"{tp.world_size} (nnodes x nproc-per-node)")
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return Worker(args, tp), tp, control


def _broadcast(data: bytes | None, control) -> bytes:
    """Rank 0's ``data`` on every rank (b"" tells the ranks to stop)."""
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, 0, group=control)
    n = int(size)
    if not n:
        return b""
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None else torch.empty(n, dtype=torch.uint8)
    dist.broadcast(buf, 0, group=control)
    return buf.numpy().tobytes()


class ExternalLauncherExecutor(Executor):
    """Rank 0's side: the step goes to every rank, then rank 0's worker runs it with them."""

    def __init__(self, args: EngineArgs) -> None:
        self._worker, tp, self._control = _join(args)
        if tp.rank != 0:
            raise ValueError(f"rank {tp.rank}: only rank 0 runs the engine core; the other ranks run serve_rank")
        self.spec = self._worker.spec
        self._closed = False

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        try:
            _broadcast(encode(so), self._control)
        except Exception as e:  # gloo: a peer's socket closed
            raise WorkerError(f"sending the step to the tensor-parallel ranks failed: {e}") from e
        return self._worker.execute(so)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            _broadcast(b"", self._control)
        except Exception:  # noqa: BLE001 - the ranks are gone already
            log.warning("the tensor-parallel ranks did not take the stop message")
        from pagedllm.distributed.parallel_state import destroy_tp_group

        destroy_tp_group()


def serve_rank(args: EngineArgs) -> None:
    """A rank other than 0: run every step rank 0 broadcasts, until it says stop."""
    from pagedllm.distributed.parallel_state import destroy_tp_group

    worker, tp, control = _join(args)
    log.info("tensor-parallel rank %d of %d: executing the steps of rank 0's engine", tp.rank, tp.world_size)
    try:
        while data := _broadcast(None, control):
            worker.execute(decode(data))
    finally:
        destroy_tp_group()
    log.info("tensor-parallel rank %d: rank 0 stopped the engine", tp.rank)
