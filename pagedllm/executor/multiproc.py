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
            conn.send_bytes(encode(worker.execute(decode(data))))
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
        try:
            self._conn.send_bytes(encode(so))
        except OSError as e:
            self._proc.join(timeout=1)
            raise WorkerError(f"the worker process died (exit code {self._proc.exitcode})") from e
        return step_result(wait_for(self._proc, self._conn, self._conn.recv_bytes))

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
