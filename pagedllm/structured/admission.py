"""The front end's gate for structured outputs: a spec is checked against its limits, compiled in a
worker thread under a deadline, and tried once (its grammar must allow some first token) before the
request is admitted, so nothing that can fail reaches the engine.

Refusals are cached by spec, so a client that repeats a spec that timed out is refused at once
instead of queueing another compile behind it; one worker thread bounds the CPU that compiles take.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from pagedllm.structured.compiler import GrammarCompiler
from pagedllm.structured.limits import StructuredLimits, check_limits
from pagedllm.structured.params import StructuredOutputsParams
from pagedllm.structured.state import GrammarState, allocate_bitmask

DEFAULT_COMPILE_TIMEOUT_S = 10.0
REFUSED_CACHE_ENTRIES = 1024


class GrammarAdmission:
    """``admit(params)``: the params to send to the engine (a JSON schema as its canonical text, which
    pickles flat), or ValueError naming what is wrong with the spec."""

    def __init__(self, compiler: GrammarCompiler, limits: StructuredLimits | None = None,
                 compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S):
        self.compiler = compiler
        self.limits = limits or StructuredLimits()
        self.compile_timeout_s = compile_timeout_s
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-grammar")
        self._refused: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._lock = threading.Lock()

    def admit(self, params: StructuredOutputsParams) -> StructuredOutputsParams:
        check_limits(params, self.limits)
        key = params.key()
        with self._lock:
            refused = self._refused.get(key)
        if refused is not None:
            raise ValueError(refused)
        try:
            self._worker.submit(self._try, params).result(timeout=self.compile_timeout_s)
        except FutureTimeout:
            self._refuse(key, f"structured_outputs.{key[0]} took longer than {self.compile_timeout_s:g} s to "
                              "compile; simplify it")
        except ValueError as e:
            self._refuse(key, str(e))
        return dataclasses.replace(params, json=key[1]) if key[0] == "json" else params

    def _try(self, params: StructuredOutputsParams) -> None:
        """Compile, then ask for the first step's mask: a grammar that allows no token at all (a schema
        whose references only go round in a circle) would fail on the engine's first sample."""
        bitmask = allocate_bitmask(1, self.compiler.vocab_size)
        GrammarState(self.compiler.compile(params)).fill_bitmask(bitmask, 0)
        if not bitmask.any():
            raise ValueError(f"structured_outputs.{params.kind} matches no output at all (unsatisfiable)")

    def _refuse(self, key: tuple[str, str], message: str) -> None:
        with self._lock:
            self._refused[key] = message
            while len(self._refused) > REFUSED_CACHE_ENTRIES:
                self._refused.popitem(last=False)
        raise ValueError(message)

    def shutdown(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
