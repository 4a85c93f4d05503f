"""The engine's side of structured outputs: one grammar state per structured sequence, the step's
bitmask filled for exactly those rows and applied to the batch's logits in one call, and each
sampled token fed back. The engine core calls ``add`` on admission, ``fork`` for parallel samples,
``mask`` before sampling, ``accept`` after, and ``free`` when a sequence finishes. A grammar that waits for a
reasoning part to end (``params.reasoning``) is held in a ``ReasoningGate`` meanwhile: its rows are free.
A spec not compiled before compiles on a thread of its own (``prepare``), so a slow one does not stall the
steps of every other request while it compiles."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xgrammar as xgr

from pagedllm.structured.compiler import GrammarCompiler
from pagedllm.structured.params import StructuredOutputsParams
from pagedllm.structured.reasoning_gate import PROMPT_TAIL_TOKENS, ReasoningGate, reasoning_closed
from pagedllm.structured.state import GrammarState, allocate_bitmask, apply_bitmask


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self.compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids)
        self.tokenizer = tokenizer
        self.states: dict[Hashable, GrammarState] = {}
        self.gates: dict[Hashable, ReasoningGate] = {}  # grammars waiting for their reasoning to end
        self._bitmask = allocate_bitmask(1, vocab_size)
        self._compiles: ThreadPoolExecutor | None = None  # one thread, made with the first spec to compile
        self._pending: dict[tuple[str, str], Future[xgr.CompiledGrammar]] = {}  # compiles under way, by spec

    def prepare(self, params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar for ``params``: done already if the spec was compiled before, else compiling
        on the manager's thread. A spec that cannot even be parsed raises ValueError naming the field here,
        at once; one that fails later fails its future."""
        done: Future[xgr.CompiledGrammar] = Future()
        cached = self.compiler.cached(params)
        if cached is not None:
            done.set_result(cached)
            return done
        key = params.key()
        pending = self._pending.get(key)
        if pending is not None:  # requests with the same spec share one compile
            return pending
        grammar = self.compiler.parse(params)
        if self._compiles is None:
            self._compiles = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-grammar")
        compiling = self._pending[key] = self._compiles.submit(self.compiler.compile, params, grammar)
        compiling.add_done_callback(lambda _: self._pending.pop(key, None))  # in the cache now, or failed
        return compiling

    def add(self, seq_id: Hashable, params: StructuredOutputsParams, prompt_token_ids: Sequence[int] = (),
            compiled: xgr.CompiledGrammar | None = None) -> None:
        """Start ``seq_id`` at its grammar's beginning (``compiled``: from ``prepare``; else compiled here, once
        per distinct spec, now even when it waits for the reasoning to end, so no step stalls on it later)."""
        state = GrammarState(compiled if compiled is not None else self.compiler.compile(params))
        if params.reasoning is not None and not reasoning_closed(
                self.tokenizer.decode(list(prompt_token_ids[-PROMPT_TAIL_TOKENS:])), params.reasoning):
            self.gates[seq_id] = ReasoningGate(state, params.reasoning)
        else:
            self.states[seq_id] = state

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        if parent_id in self.states:
            self.states[child_id] = self.states[parent_id].fork()
        elif parent_id in self.gates:
            self.gates[child_id] = self.gates[parent_id].fork()

    def free(self, seq_id: Hashable) -> None:
        self.states.pop(seq_id, None)
        self.gates.pop(seq_id, None)

    def mask(self, logits: torch.Tensor, row_seq_ids: Sequence[Hashable]) -> None:
        """Mask ``logits`` (one row per entry of ``row_seq_ids``) in place where a row's sequence is
        structured; other rows are untouched."""
        rows = [i for i, sid in enumerate(row_seq_ids) if sid in self.states]
        if not rows:
            return
        if self._bitmask.shape[0] < logits.shape[0]:
            self._bitmask = allocate_bitmask(logits.shape[0], self.compiler.vocab_size)
        for i in rows:
            self.states[row_seq_ids[i]].fill_bitmask(self._bitmask, i)
        apply_bitmask(logits, self._bitmask[: logits.shape[0]], rows)

    def fill(self, row_seq_ids: Sequence[Hashable]) -> tuple[torch.Tensor, list[int]] | None:
        """The step's bitmask ``[rows, words]`` and the rows it constrains (None: no structured row), for a
        worker in another process to apply with ``apply_bitmask``."""
        rows = [i for i, sid in enumerate(row_seq_ids) if sid in self.states]
        if not rows:
            return None
        bitmask = allocate_bitmask(len(row_seq_ids), self.compiler.vocab_size)
        for i in rows:
            self.states[row_seq_ids[i]].fill_bitmask(bitmask, i)
        return bitmask, rows

    def accept(self, row_seq_ids: Sequence[Hashable], tokens: Sequence[int]) -> list[Hashable]:
        """Advance each structured row's state by its sampled token; returns the sequences whose
        token the grammar refused (only possible if the mask was not applied). A gated row's token goes to
        its gate; the one that ends the reasoning opens the grammar for the next."""
        refused = []
        for sid, tok in zip(row_seq_ids, tokens):
            if sid in self.states:
                if not self.states[sid].accept(tok):
                    refused.append(sid)
            elif sid in self.gates and self.gates[sid].feed(self.tokenizer.decode([tok])):
                self.states[sid] = self.gates.pop(sid).state
        return refused

    def shutdown(self) -> None:
        """Stop the compile thread; a compile under way is not waited for."""
        if self._compiles is not None:
            self._compiles.shutdown(wait=False, cancel_futures=True)
