"""Streaming front end: tokenizes, validates and detokenizes in the caller's process, while the
engine core steps in its own process (the default: HTTP never waits on the core's GIL) or in a
background thread (``core_process=False``).

Callers add requests and read cumulative ``RequestOutput``s from an asyncio queue; aborting (or
a client that goes away) removes the request in the core, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagedllm.config.args import EngineArgs
from pagedllm.frontend.core_client import CoreClient, EngineCoreDied, ProcessCoreClient, ThreadCoreClient
from pagedllm.lora.registry import LoRARegistry, check_lora
from pagedllm.protocol.core_io import EngineCoreOutput, EngineCoreRequest
from pagedllm.protocol.lora_request import LoRARequest
from pagedllm.frontend.heap import trim_heap
from pagedllm.protocol.limits import RequestLimits
from pagedllm.frontend.llm_engine import tokenize_prompt
from pagedllm.frontend.output_processor import OutputProcessor
from pagedllm.protocol.outputs import RequestOutput
from pagedllm.protocol.sampling_params import SamplingParams
from pagedllm.models.loader import load_tokenizer

log = logging.getLogger("pagedllm.async")


class AsyncEngine:
    loras: LoRARegistry | None = None  # issue 32: served adapters by name (None without enable_lora)

    def __init__(self, args: EngineArgs | None = None, core_process: bool = True):
        self.args = args = args or EngineArgs()
        self.tokenizer = load_tokenizer(args.model)
        self.processor = OutputProcessor(self.tokenizer)
        self._lock = threading.Lock()  # the processor is fed by the reader thread and by callers
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.client: CoreClient
        if core_process:
            self.client = ProcessCoreClient(args, self._on_outputs, self._on_error)
            spec = self.client.spec
        else:
            from pagedllm.core.engine_core import EngineCore

            core = EngineCore(args)
            spec = core.spec
            self.client = ThreadCoreClient(core, self._on_outputs, self._on_error)
        self.spec = spec
        self.limits = RequestLimits(spec.max_model_len, spec.num_blocks, spec.block_size, spec.vocab_size)
        self.model_name = spec.model_name
        self.max_model_len = spec.max_model_len
        self.loras = LoRARegistry.from_args(args)

    @property
    def error(self) -> BaseException | None:
        return self.client.error

    # -------------------------------------------------------------- from the core
    def _on_outputs(self, outs: list[EngineCoreOutput]) -> None:
        with self._lock:
            results, stops = self.processor.process(outs)
        for rid, index, stop in stops:
            self.client.finish_seq(rid, index, "stop", stop)
        self._push_all([(out.request_id, out) for out in results])
        if results and not self._streams:
            trim_heap()  # the last stream ended: its outputs' memory goes back to the system

    def _on_error(self, e: BaseException) -> None:
        self._push_all([(rid, EngineCoreDied(f"the engine core failed during this request: {e}"))
                        for rid in list(self._streams)])

    @property
    def can_restart_core(self) -> bool:
        return isinstance(self.client, ProcessCoreClient)

    def restart_core(self) -> None:
        """Start a fresh core process in place of one that died (the server's supervisor calls this; the
        requests it held have already failed). Raises whatever stops the new core from starting."""
        if not self.can_restart_core:
            raise RuntimeError("only an engine core in its own process can be restarted")
        old = self.client
        new = ProcessCoreClient(self.args, self._on_outputs, self._on_error)
        with self._lock:
            for rid in list(self.processor.requests):  # the dead core's requests: their streams have their error
                self.processor.abort(rid)
        self.client = new
        old.shutdown()

    def _push_all(self, items: list[tuple[str, Any]]) -> None:
        """Hand each ``(request id, output or error)`` to its stream's queue: one wake-up of each event loop per
        call, not one per stream (a serving step's ~40 outputs cost ~40 self-pipe writes and loop passes
        otherwise, on a CPU the engine core's threads need)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for request_id, item in items:
            entry = self._streams.get(request_id)
            if entry is None:
                continue
            loop, q = entry
            if isinstance(item, RequestOutput) and item.error is not None:
                item = RuntimeError(item.error)
            if isinstance(item, BaseException) or item.finished:
                self._streams.pop(request_id, None)
            by_loop.setdefault(loop, []).append((q, item))
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(_deliver, batch)

    # -------------------------------------------------------------- public API
    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt, self.limits.vocab_size)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.limits.check(prompt_ids, params)

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(core)`` on the engine core between steps and await its result (with the core in
        its own process, ``fn`` must be a module-level function)."""
        return await asyncio.wrap_future(self.client.call(fn))

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       cache_salt: str | None = None, priority: int = 0, lora_request: LoRARequest | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative output after every step it makes progress; the last is finished.

        Raises ValueError (before anything is scheduled) for a bad prompt, settings or adapter.
        """
        text, ids = self.tokenize(prompt)
        self.validate(ids, params)
        check_lora(self.loras, lora_request)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        now = time.monotonic()
        with self._lock:
            if request_id in self.processor.requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            self.processor.add_request(request_id, text, ids, params, now)
        self._streams[request_id] = (loop, q)
        finished = False
        try:
            await asyncio.wrap_future(self.client.add(EngineCoreRequest(
                request_id, ids, params, cache_salt, now, priority=priority, lora_request=lora_request)))
            while True:
                item = await q.get()
                if isinstance(item, EngineCoreDied):
                    raise item
                if isinstance(item, BaseException):
                    raise RuntimeError(f"engine failed: {item}") from item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:  # the consumer went away (or the add failed): free the request's blocks
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        with self._lock:
            self.processor.abort(request_id)
        if self.client.error is None:
            self.client.abort(request_id)

    async def stats(self) -> dict:
        return await self.call(pool_stats)

    async def check_integrity(self) -> None:
        await self.call(check_integrity)

    def shutdown(self) -> None:
        self.client.shutdown()


def _deliver(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in batch:
        q.put_nowait(item)


def pool_stats(core) -> dict:
    return core.pool_stats()


def check_integrity(core) -> None:
    core.check_integrity()
