"""Streaming front end: one engine loop in a background thread shared by every caller.

Callers add requests and read cumulative ``RequestOutput``s from an asyncio queue; aborting
(or a client that goes away) removes the request and frees its blocks on the loop thread, so
the engine itself is only ever touched by that thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagedllm.engine.args import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.sampling_params import SamplingParams

log = logging.getLogger("pagedllm.async")


class AsyncEngine:
    def __init__(self, args: EngineArgs | None = None, engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(args or EngineArgs())
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pagedllm-engine", daemon=True)
        self._thread.start()
        self.error: BaseException | None = None

    # -------------------------------------------------------------- engine thread
    def _loop(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            try:
                block = not eng.has_unfinished()
                cmd = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
                cmd()
                continue  # drain every pending command before the next step
            except queue.Empty:
                pass
            if not eng.has_unfinished():
                continue
            try:
                progressed = eng.step()
            except Exception as e:  # a broken step must not hang every client
                log.exception("engine step failed")
                self.error = e
                for rid in list(self._streams):
                    self._push(rid, e)
                    eng.abort_request(rid)
                continue
            for req in progressed:
                if req.request_id in self._streams:
                    self._push(req.request_id, eng.output(req))

    def _push(self, request_id: str, item: Any) -> None:
        entry = self._streams.get(request_id)
        if entry is None:
            return
        loop, q = entry
        if isinstance(item, RequestOutput) and item.finished or isinstance(item, BaseException):
            self._streams.pop(request_id, None)
        loop.call_soon_threadsafe(q.put_nowait, item)

    def call(self, fn: Callable[[LLMEngine], Any]) -> "asyncio.Future[Any]":
        """Run ``fn(engine)`` on the engine thread (between steps) and await its result."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def run() -> None:
            try:
                res = fn(self.engine)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(fut.set_exception, e)
            else:
                loop.call_soon_threadsafe(fut.set_result, res)

        self._commands.put(run)
        return fut

    # -------------------------------------------------------------- public API
    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative output after every step it makes progress; the last is finished.

        Raises ValueError (before anything is scheduled) for a bad prompt or settings.
        """
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def add(eng: LLMEngine) -> None:
            self._streams[request_id] = (loop, q)
            try:
                eng.add_request(prompt, params, request_id=request_id, cache_salt=cache_salt)
            except BaseException:
                self._streams.pop(request_id, None)
                raise

        finished = False
        try:
            await self.call(add)  # inside try: a caller cancelled mid-add still aborts the request
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise RuntimeError(f"engine failed: {item}") from item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:  # the consumer went away: free the request's blocks
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        def run(eng: LLMEngine) -> None:
            self._streams.pop(request_id, None)
            eng.abort_request(request_id)

        await self.call(run)

    async def stats(self) -> dict:
        return await self.call(lambda eng: eng.pool_stats())

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
