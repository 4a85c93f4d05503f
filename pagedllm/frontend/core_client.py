"""How a streaming front end reaches the engine core: a thread in this process, or a process of
its own (vLLM's ``EngineCoreProc``), so that HTTP, tokenization and detokenization never wait on
the core's GIL.

Both run the same loop: apply every pending command (add, abort, finish a sample, call a
function on the core), then step while there is work, handing each step's ``EngineCoreOutput``s
to ``on_outputs`` (in the client's reader thread). A core that fails or dies calls ``on_error``
once: every caller hears of it, none hangs.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import queue
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from pagedllm.config.args import EngineArgs
from pagedllm.protocol.core_io import EngineCoreOutput, EngineCoreRequest
from pagedllm.frontend.heap import trim_heap
from pagedllm.executor.base import build_in_child

log = logging.getLogger("pagedllm.core_client")

OnOutputs = Callable[[list[EngineCoreOutput]], None]
OnError = Callable[[BaseException], None]
IDLE_WAIT_S = 0.05


class EngineCoreDied(RuntimeError):
    """The engine core failed or its process died: the request cannot complete (the server answers 503
    and, unless told not to, restarts the core)."""


def _apply(core, cmd: tuple) -> Any:
    kind = cmd[0]
    if kind == "add":
        return core.add_request(cmd[1])
    if kind == "abort":
        return core.abort_request(cmd[1])
    if kind == "finish":
        return core.finish_seq(*cmd[1:])
    if kind == "call":
        return cmd[1](core)
    raise ValueError(f"unknown core command {kind!r}")


def run_core_loop(core, get: Callable[[float | None], tuple | None], reply: Callable[[int, Any, bool], None],
                  emit: OnOutputs) -> None:
    """The core's loop: commands first (a failed one answers its caller only), then one step.
    ``get(timeout)`` returns the next command or None; ("stop",) ends the loop."""
    busy = False
    while True:
        if busy and not core.has_unfinished():
            trim_heap()  # idle: what the finished requests freed goes back to the system
        busy = core.has_unfinished()
        cmd = get(None if not busy else 0.0)
        if cmd is not None:
            if cmd[0] == "stop":
                return
            call_id, body = cmd[0], cmd[1:]
            try:
                result, ok = _apply(core, body), True
            except Exception as e:  # noqa: BLE001 - answered to the caller
                result, ok = e, False
            if call_id is not None:
                reply(call_id, result, ok)
            continue
        if core.has_unfinished():
            outs = core.step()
            if outs:
                emit(outs)


class CoreClient:
    """Commands to the core; results come back as futures, outputs through ``on_outputs``."""

    def __init__(self) -> None:
        self._calls: dict[int, Future] = {}
        self._next = 0
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self._on_error: OnError | None = None

    def _send(self, cmd: tuple) -> None:
        raise NotImplementedError

    def submit(self, *body: Any, wait: bool = True) -> Future | None:
        """Send a command; with ``wait`` a Future gets its result (or its exception)."""
        if self.error is not None:
            raise EngineCoreDied(f"engine core failed: {self.error}")
        fut = None
        with self._lock:
            call_id = None
            if wait:
                call_id, self._next = self._next, self._next + 1
                fut = self._calls[call_id] = Future()
        self._send((call_id, *body))
        return fut

    def _resolve(self, call_id: int, result: Any, ok: bool) -> None:
        fut = self._calls.pop(call_id, None)
        if fut is not None and not fut.done():  # a caller may have cancelled it meanwhile
            (fut.set_result if ok else fut.set_exception)(result)

    def _fail(self, e: BaseException) -> None:
        if self.error is not None:
            return
        self.error = e
        log.error("engine core failed: %s", e)
        for fut in list(self._calls.values()):
            if not fut.done():  # a caller may have cancelled it
                fut.set_exception(EngineCoreDied(f"engine core failed: {e}"))
        self._calls.clear()
        if self._on_error is not None:
            self._on_error(e)

    def add(self, req: EngineCoreRequest) -> Future:
        return self.submit("add", req)

    def abort(self, request_id: str) -> None:
        self.submit("abort", request_id, wait=False)

    def finish_seq(self, request_id: str, index: int, reason: str, stop_reason) -> None:
        self.submit("finish", request_id, index, reason, stop_reason, wait=False)

    def call(self, fn: Callable[[Any], Any]) -> Future:
        """Run ``fn(core)`` between steps (in a core process ``fn`` must be picklable: a module-level function)."""
        return self.submit("call", fn)

    def shutdown(self) -> None:
        raise NotImplementedError


class ThreadCoreClient(CoreClient):
    """The core in a background thread of this process (no copy of anything crosses a boundary)."""

    def __init__(self, core, on_outputs: OnOutputs, on_error: OnError) -> None:
        super().__init__()
        self.core = core
        self._on_error = on_error
        self._q: queue.Queue[tuple] = queue.Queue()
        self._thread = threading.Thread(target=self._run, args=(on_outputs,), name="pagedllm-core", daemon=True)
        self._thread.start()

    def _send(self, cmd: tuple) -> None:
        self._q.put(cmd)

    def _get(self, timeout: float | None) -> tuple | None:
        try:
            return self._q.get(timeout=IDLE_WAIT_S) if timeout is None else self._q.get_nowait()
        except queue.Empty:
            return None

    def _run(self, on_outputs: OnOutputs) -> None:
        try:
            run_core_loop(self.core, self._get, self._resolve, on_outputs)
        except Exception as e:  # noqa: BLE001 - a broken step must not hang every client
            log.exception("engine core step failed")
            self._fail(e)

    def shutdown(self) -> None:
        self._q.put(("stop",))
        self._thread.join(timeout=5)
        self.core.shutdown()


def _core_proc_main(args: EngineArgs, conn) -> None:
    """The child process: build the core, report its limits, then loop on the pipe."""
    from pagedllm.core.engine_core import EngineCore

    core = build_in_child(conn, lambda: EngineCore(args))
    if core is None:
        return

    def get(timeout: float | None) -> tuple | None:
        if not conn.poll(IDLE_WAIT_S if timeout is None else 0):
            return None
        try:
            return conn.recv()
        except EOFError:
            return ("stop",)

    def reply(call_id: int, result: Any, ok: bool) -> None:
        try:
            conn.send(("result", call_id, result, ok))
        except Exception as e:  # noqa: BLE001 - an unpicklable result
            conn.send(("result", call_id, RuntimeError(f"unpicklable result: {e}"), False))

    try:
        run_core_loop(core, get, reply, lambda outs: conn.send(("outputs", outs)))
    except BaseException:  # noqa: BLE001
        conn.send(("failed", traceback.format_exc()))
    finally:
        core.shutdown()


class ProcessCoreClient(CoreClient):
    """The core in a child process; a reader thread here receives its outputs and answers."""

    def __init__(self, args: EngineArgs, on_outputs: OnOutputs, on_error: OnError) -> None:
        super().__init__()
        self._on_error = on_error
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # Not daemonic: the core starts worker processes of its own (mp, tensor parallel), which a daemonic
        # process may not. It still ends with us: a closed pipe stops its loop, and exit shuts it down first.
        self._proc = ctx.Process(target=_core_proc_main, args=(args, child), name="pagedllm-core")
        self._proc.start()
        child.close()
        atexit.register(self.shutdown)
        self._send_lock = threading.Lock()
        kind, payload = self._recv_first()
        if kind != "ready":  # nothing to shut down at exit: no reader was started
            atexit.unregister(self.shutdown)
            self._proc.join(timeout=5)
            self._conn.close()
            raise RuntimeError(f"the engine core process failed to start:\n{payload}")
        self.spec = payload
        self._reader = threading.Thread(target=self._read, args=(on_outputs,), name="pagedllm-core-reader",
                                        daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def _recv_first(self) -> tuple:
        while not self._conn.poll(0.5):
            if not self._proc.is_alive():
                return ("failed", f"exit code {self._proc.exitcode}")
        try:
            return self._conn.recv()
        except EOFError:  # the child closed the pipe before a word: it died starting (e.g. while importing)
            self._proc.join(timeout=5)
            return ("failed", f"exit code {self._proc.exitcode}, before the core was ready")

    def _send(self, cmd: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(cmd)
        except (OSError, ValueError) as e:
            self._fail(RuntimeError(f"engine core process is gone: {e}"))
            raise EngineCoreDied(f"engine core failed: {self.error}") from e

    def _read(self, on_outputs: OnOutputs) -> None:
        while True:
            try:
                if not self._conn.poll(0.5):
                    if not self._proc.is_alive():
                        raise EOFError
                    continue
                msg = self._conn.recv()
            except (EOFError, OSError):
                if self.error is None and not getattr(self, "_closing", False):
                    self._fail(RuntimeError(f"engine core process died (exit code {self._proc.exitcode})"))
                return
            kind = msg[0]
            if kind == "outputs":
                try:
                    on_outputs(msg[1])
                except Exception:  # noqa: BLE001 - a front-end bug must not stop the reader
                    log.exception("processing engine outputs failed")
            elif kind == "result":
                self._resolve(msg[1], msg[2], msg[3])
            elif kind == "failed":
                self._fail(RuntimeError(msg[1]))
                return

    def shutdown(self) -> None:
        atexit.unregister(self.shutdown)
        self._closing = True
        if self._proc.is_alive():
            try:
                with self._send_lock:
                    self._conn.send(("stop",))
            except (OSError, ValueError):
                pass
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
        self._reader.join(timeout=2)
        self._conn.close()
