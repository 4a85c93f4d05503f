"""One engine replica on a Ray actor: an engine core (its worker in the same process) stepping in
a background thread, with the commands a multi-replica front end needs.

The actor is threaded (``max_concurrency``): ``poll`` blocks until outputs are ready while ``add``,
``abort`` and the KV transfers go through the core's command queue between steps. A request whose
abort arrives before its add (calls of a threaded actor are not ordered) is never started. A core
that fails kills the process, so Ray restarts the actor and the front end fails its requests.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

from pagedllm.config.args import EngineArgs
from pagedllm.core.engine_core import EngineCore
from pagedllm.frontend.core_client import ThreadCoreClient
from pagedllm.protocol.core_io import EngineCoreOutput, EngineCoreRequest
from pagedllm.protocol.lora_request import lora_id_of
from pagedllm.scaleout.kv_transfer import KVBlocks, TransferStats, export_prefix, import_prefix
from pagedllm.worker.worker import KVCacheSpec

log = logging.getLogger("pagedllm.replica")

MAX_TOMBSTONES = 1 << 14


class Replica:
    def __init__(self, args: EngineArgs, index: int) -> None:
        self.index = index
        self.core = EngineCore(dataclasses.replace(args, distributed_executor_backend="uni"))
        self.transfer = TransferStats()
        self._cv = threading.Condition()
        self._outputs: list[EngineCoreOutput] = []
        self._live: set[str] = set()  # added, not finished
        self._tombstones: OrderedDict[str, None] = OrderedDict()  # aborted before their add arrived
        self._prefills: dict[str, Future] = {}  # prefill-only requests: their final output
        self.client = ThreadCoreClient(self.core, self._on_outputs, self._on_error)

    def spec(self) -> KVCacheSpec:
        return self.core.spec

    def pid(self) -> int:
        return os.getpid()

    # ------------------------------------------------------------------ from the core thread
    def _on_outputs(self, outs: list[EngineCoreOutput]) -> None:
        done: list[tuple[Future, EngineCoreOutput]] = []
        with self._cv:
            for o in outs:
                if o.finished:
                    self._live.discard(o.request_id)
                fut = self._prefills.get(o.request_id)
                if fut is None:
                    self._outputs.append(o)
                elif o.finished:
                    done.append((self._prefills.pop(o.request_id), o))
            self._cv.notify_all()
        for fut, o in done:
            fut.set_result(o)

    def _on_error(self, e: BaseException) -> None:
        log.critical("replica %d: engine core failed (%s); exiting so that Ray restarts it", self.index, e)
        os._exit(1)

    # ------------------------------------------------------------------ commands
    def add(self, req: EngineCoreRequest, kv: KVBlocks | None = None) -> TransferStats | None:
        """Import ``kv`` (a peer's or a prefill replica's blocks of this prompt), then queue the request."""
        received = time.time()
        with self._cv:
            if req.request_id in self._tombstones:  # aborted already: never start it
                del self._tombstones[req.request_id]
                return None
            self._live.add(req.request_id)

        def run(core: EngineCore) -> TransferStats | None:
            stats = import_prefix(core, kv, received) if kv is not None else None
            core.add_request(req)
            return stats

        try:
            stats = self.client.call(run).result()
        except BaseException:
            with self._cv:
                self._live.discard(req.request_id)
            raise
        if stats is not None:
            self.transfer.add(stats)
        return stats

    def prefill(self, req: EngineCoreRequest) -> KVBlocks | None:
        """Compute the prompt's KV (``req`` asks for one token) and export its full blocks; None
        when the request was aborted meanwhile."""
        fut: Future = Future()
        with self._cv:
            self._prefills[req.request_id] = fut
        try:
            self.add(req)
        except BaseException:
            with self._cv:
                self._prefills.pop(req.request_id, None)
            raise
        out = fut.result()
        if out is None:
            return None
        if out.error is not None:
            raise RuntimeError(f"prefill on replica {self.index} failed: {out.error}")
        return self.export_prefix(req.prompt_token_ids, req.cache_salt, lora_id_of(req.lora_request))

    def export_prefix(self, token_ids: list[int], cache_salt: str | None = None, lora_id: int = 0) -> KVBlocks | None:
        return self.client.call(lambda core: export_prefix(core, token_ids, cache_salt, lora_id)).result()

    def abort(self, request_id: str) -> None:
        with self._cv:
            if request_id not in self._live:
                self._tombstones[request_id] = None
                if len(self._tombstones) > MAX_TOMBSTONES:
                    self._tombstones.popitem(last=False)
            self._live.discard(request_id)
            fut = self._prefills.pop(request_id, None)
        if fut is not None:
            fut.set_result(None)
        self.client.abort(request_id)

    def finish_seq(self, request_id: str, index: int, reason: str, stop_reason: str | int | None) -> None:
        self.client.finish_seq(request_id, index, reason, stop_reason)

    def poll(self, timeout: float) -> list[EngineCoreOutput]:
        """Outputs since the last poll, waiting up to ``timeout`` seconds for some."""
        with self._cv:
            if not self._outputs:
                self._cv.wait(timeout)
            outs, self._outputs = self._outputs, []
        return outs

    def call(self, fn) -> Any:
        """``fn(core)`` between steps."""
        return self.client.call(fn).result()

    def stats(self) -> dict:
        return {**self.client.call(lambda core: core.pool_stats()).result(), **self.transfer.as_dict()}
