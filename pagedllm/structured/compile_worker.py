"""A child process that tries structured-output specs: compile, then ask for the first step's token
mask. A compile can take seconds for a spec that is small on the wire (four 2,000-character enum
strings take ~8 s), and a thread cannot be stopped, so the compile runs here, where a deadline
kills it and the CPU it was burning comes back at once; the next spec starts a fresh child.
"""

from __future__ import annotations

import multiprocessing as mp
import threading

from pagedllm.structured.params import StructuredOutputsParams


def _child(conn, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
    from pagedllm.structured.compiler import GrammarCompiler
    from pagedllm.structured.state import GrammarState, allocate_bitmask

    compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids)
    conn.send("ready")
    while True:
        try:
            params: StructuredOutputsParams = conn.recv()
        except EOFError:
            return
        try:
            bitmask = allocate_bitmask(1, vocab_size)
            GrammarState(compiler.compile(params)).fill_bitmask(bitmask, 0)
            # a grammar that allows no first token (references that only go round in a circle) would
            # fail on the engine's first sample
            error = None if bitmask.any() else f"structured_outputs.{params.kind} matches no output at all " \
                                                "(unsatisfiable)"
        except ValueError as e:
            error = str(e)
        conn.send(error)


class CompileWorker:
    """``check(params, timeout_s)``: None if the spec compiles and allows a first token, else the
    error message; TimeoutError (the child killed) if it takes longer than ``timeout_s``. One spec at a
    time: callers queue on a lock, and only the compile itself is timed."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self._args = (tokenizer, vocab_size, list(stop_token_ids))
        self._lock = threading.Lock()
        self._proc = None
        self._conn = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child, args=(child, *self._args), name="pagedllm-grammar", daemon=True)
        self._proc.start()
        child.close()
        if self._conn.recv() != "ready":
            raise RuntimeError("the grammar compile worker failed to start")

    def check(self, params: StructuredOutputsParams, timeout_s: float) -> str | None:
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._start()
            self._conn.send(params)
            if self._conn.poll(timeout_s):
                return self._conn.recv()
            self._stop()
            raise TimeoutError(f"compile took longer than {timeout_s:g} s")

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(timeout=5)
            self._conn.close()
        self._proc = self._conn = None

    def shutdown(self) -> None:
        with self._lock:
            self._stop()
