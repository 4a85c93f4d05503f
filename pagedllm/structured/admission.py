"""The front end's gate for structured outputs: a spec is checked against its limits, then compiled
and tried once (its grammar must allow some first token) in a child process under a deadline, before
the request is admitted, so nothing that can fail reaches the engine.

Verdicts are cached by spec: a spec seen before is admitted or refused at once, without compiling,
so a client that repeats a spec that timed out costs nothing.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict

from pagedllm.structured.compile_worker import CompileWorker
from pagedllm.structured.limits import StructuredLimits, check_limits
from pagedllm.structured.params import StructuredOutputsParams

DEFAULT_COMPILE_TIMEOUT_S = 3.0  # the engine compiles an admitted spec again, on a thread beside its steps
VERDICT_CACHE_ENTRIES = 1024


class GrammarAdmission:
    """``admit(params)``: the params to send to the engine (a JSON schema as its canonical text, which
    pickles flat), or ValueError naming what is wrong with the spec."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], limits: StructuredLimits | None = None,
                 compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S):
        self.worker = CompileWorker(tokenizer, vocab_size, stop_token_ids)
        self.limits = limits or StructuredLimits()
        self.compile_timeout_s = compile_timeout_s
        self._verdicts: OrderedDict[tuple[str, str], str | None] = OrderedDict()  # None: admitted
        self._lock = threading.Lock()

    def admit(self, params: StructuredOutputsParams) -> StructuredOutputsParams:
        check_limits(params, self.limits)
        key = params.key()
        flat = dataclasses.replace(params, json=key[1]) if key[0] == "json" else params
        with self._lock:
            known = key in self._verdicts
            error = self._verdicts.get(key)
        if not known:
            try:
                error = self.worker.check(flat, self.compile_timeout_s)
            except TimeoutError:
                error = (f"structured_outputs.{key[0]} took longer than {self.compile_timeout_s:g} s to compile; "
                         "simplify it")
            with self._lock:
                self._verdicts[key] = error
                while len(self._verdicts) > VERDICT_CACHE_ENTRIES:
                    self._verdicts.popitem(last=False)
        if error is not None:
            raise ValueError(error)
        return flat

    def shutdown(self) -> None:
        self.worker.shutdown()
