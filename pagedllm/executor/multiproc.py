"""The worker in a child process: each step crosses a pipe as bytes (``step_io.encode``), so the
core and the worker share nothing but plain data: the shape tensor parallelism and other
devices need. A worker that dies or raises stops the engine with a clear error, never a hang.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import pickle
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from pagedllm.config.args import EngineArgs
from pagedllm.protocol.step_io import ModelRunnerOutput, SchedulerOutput, decode, encode
from pagedllm.protocol.errors import WorkerError
from pagedllm.executor.base import Executor, build_in_child
from pagedllm.worker.tier_copy import BlockCopy

log = logging.getLogger("pagedllm.executor")

POLL_S = 0.5  # how often a waiting core checks that the worker process is still alive


def serve_steps(worker, conn: Connection) -> None:
    """A worker process's loop: a step's bytes in, its output's bytes (or its traceback) out; empty
    bytes or a closed pipe end it."""
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:
            return
        if not data:  # shutdown
            return
        try:
            msg = pickle.loads(data)
            if isinstance(msg, BlockCopy):  # issue 31: a KV tier's copy between steps
                conn.send_bytes(pickle.dumps(("ok", msg.apply(worker.kv_cache)), protocol=pickle.HIGHEST_PROTOCOL))
            elif isinstance(msg, SchedulerOutput):
                conn.send_bytes(encode(worker.execute(msg)))
            else:
                raise TypeError(f"not a step message: {type(msg).__name__}")
        except BaseException:  # noqa: BLE001 - reported to the core, which raises it
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))


def wait_for(proc: mp.Process, conn: Connection, read: Callable[[], Any]) -> Any:
    """``read()`` once the pipe has data; WorkerError if the process dies first."""
    while True:
        try:
            if conn.poll(POLL_S):
                break
        except (EOFError, OSError):
            break  # the read below raises WorkerError
        if not proc.is_alive():
            raise WorkerError(f"the worker process {proc.name} died (exit code {proc.exitcode})")
    try:
        return read()
    except (EOFError, OSError) as e:
        proc.join(timeout=1)
        raise WorkerError(f"the worker process {proc.name} died (exit code {proc.exitcode})") from e


def step_result(data: bytes) -> ModelRunnerOutput:
    """A worker's answer: its output, or WorkerError with the traceback it sent."""
    try:
        return decode(data)
    except TypeError:
        _, tb = pickle.loads(data)
        raise WorkerError(f"the worker failed a step:\n{tb}") from None


def copy_result(data: bytes):
    """A worker's answer to a ``BlockCopy``: its value, or WorkerError with the traceback it sent."""
    kind, value = pickle.loads(data)
    if kind != "ok":
        raise WorkerError(f"the worker failed a KV tier block copy:\n{value}")
    return value


def ask_all(procs: list[mp.Process], conns: list[Connection], payloads: list[bytes]) -> list[bytes]:
    """Send each process its payload, then wait for every answer (WorkerError if one dies)."""
    for p, c, data in zip(procs, conns, payloads):
        try:
            c.send_bytes(data)
        except OSError as e:
            p.join(timeout=1)
            raise WorkerError(f"the worker process {p.name} died (exit code {p.exitcode})") from e
    return [wait_for(p, c, c.recv_bytes) for p, c in zip(procs, conns)]


def _worker_main(args: EngineArgs, conn: Connection) -> None:
    from pagedllm.worker.worker import Worker

    worker = build_in_child(conn, lambda: Worker(args))
    if worker is not None:
        serve_steps(worker, conn)


class MultiprocExecutor(Executor):
    def __init__(self, args: EngineArgs) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker_main, args=(args, child), name="pagedllm-worker", daemon=True)
        self._proc.start()
        child.close()
        kind, payload = wait_for(self._proc, self._conn, self._conn.recv)
        if kind != "ready":
            self.shutdown()
            raise WorkerError(f"the worker process failed to start:\n{payload}")
        self.spec = payload

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return step_result(ask_all([self._proc], [self._conn], [encode(so)])[0])

    def copy_blocks(self, msgs: list[BlockCopy]) -> list:
        return [copy_result(d) for d in ask_all([self._proc], [self._conn], [pickle.dumps(m) for m in msgs])]

    def tier_blocks(self):
        from pagedllm.executor.tier_copies import RankBlocks

        return RankBlocks(self, 1)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def shutdown(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send_bytes(b"")
            except OSError:
                pass
            self._proc.join(timeout=5)
            if self._proc.is_alive():
                self._proc.kill()
        self._conn.close()
