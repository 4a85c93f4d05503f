"""A supervised engine core: when the core process dies, its in-flight requests have already failed
(``AsyncEngine._on_error``); every route that needs the engine answers 503 until a new core is up,
and the supervisor starts one, with exponential backoff and a bounded number of tries, each logged
on one line. Without restarts (``--no-restart-core``), or once the tries are spent, ``on_give_up``
runs: the CLI stops the server and exits non-zero, for an orchestrator that restarts pods.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.frontend.core_client import EngineCoreDied
from pagedllm.server.guards import OPEN_ROUTES, error_response
from pagedllm.server.protocol import ErrorInfo

log = logging.getLogger("pagedllm.supervisor")

POLL_S = 0.1
RETRY_AFTER_S = 2
# Routes that work without the core: the tokenizer lives in this process.
CORELESS_ROUTES = OPEN_ROUTES - {"/health"} | {"/tokenize", "/detokenize"}


def one_line(e: BaseException) -> str:
    """The last line of an error's text (a core's traceback ends with its exception)."""
    text = str(e).strip()
    return text.splitlines()[-1] if text else type(e).__name__


def core_down_info() -> ErrorInfo:
    return ErrorInfo(message="the engine core is not running; retry later",
                     type="server_error", code="engine_unavailable")


class CoreSupervisor:
    """Watches ``engine.error``; restarts the core ``max_tries`` times at most per failure (waiting
    ``backoff_s``, doubled each time, up to ``max_backoff_s``), and at most ``max_restarts`` times in
    ``window_s`` (a core that keeps dying is not restarted forever)."""

    def __init__(self, engine, restart: bool = True, on_give_up: Callable[[], None] | None = None,
                 max_tries: int = 5, backoff_s: float = 0.5, max_backoff_s: float = 8.0,
                 max_restarts: int = 5, window_s: float = 300.0):
        self.engine = engine
        self.restart = restart
        self.on_give_up = on_give_up
        self.max_tries, self.backoff_s, self.max_backoff_s = max_tries, backoff_s, max_backoff_s
        self.max_restarts, self.window_s = max_restarts, window_s
        self.restarts: deque[float] = deque()
        self.gave_up = False

    async def run(self) -> None:
        while True:
            while self.engine.error is None:
                await asyncio.sleep(POLL_S)
            if not await self._recover(self.engine.error):
                self.gave_up = True
                if self.on_give_up is not None:
                    self.on_give_up()
                return

    async def _recover(self, error: BaseException) -> bool:
        first_line = one_line(error)
        if not self.restart or not getattr(self.engine, "can_restart_core", False):
            log.error("engine core failed (%s); not restarting it", first_line)
            return False
        now = time.monotonic()
        while self.restarts and now - self.restarts[0] > self.window_s:
            self.restarts.popleft()
        if len(self.restarts) >= self.max_restarts:
            log.error("engine core failed (%s) after %d restarts in %.0f s; giving up", first_line,
                      len(self.restarts), self.window_s)
            return False
        delay = self.backoff_s
        for attempt in range(1, self.max_tries + 1):
            log.warning("engine core failed (%s); restarting it in %.1f s (try %d of %d)", first_line, delay,
                        attempt, self.max_tries)
            await asyncio.sleep(delay)
            start = time.monotonic()
            try:
                await asyncio.to_thread(self.engine.restart_core)
            except Exception as e:  # noqa: BLE001 - logged in one line, then tried again
                first_line = one_line(e)
                delay = min(delay * 2, self.max_backoff_s)
                continue
            self.restarts.append(time.monotonic())
            log.warning("engine core restarted in %.1f s", time.monotonic() - start)
            return True
        log.error("engine core could not be restarted in %d tries (%s); giving up", self.max_tries, first_line)
        return False


def supervised_lifespan(lifespan, supervisor: CoreSupervisor):
    """``lifespan`` (a FastAPI lifespan factory) with the supervisor running beside it."""

    @asynccontextmanager
    async def wrapped(app):
        task = asyncio.create_task(supervisor.run())
        try:
            async with lifespan(app):
                yield
        finally:
            task.cancel()

    return wrapped


class CoreDownMiddleware:
    """503 (with Retry-After) on every route that needs the engine while its core is down."""

    def __init__(self, app: ASGIApp, engine):
        self.app = app
        self.engine = engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.engine.error is not None and scope["path"] not in CORELESS_ROUTES:
            response = error_response(503, core_down_info())
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def core_died_info(e: EngineCoreDied) -> ErrorInfo:
    """What a client whose request the core's death cut short hears; the log gets one line, no traceback."""
    log.warning("request failed: %s", one_line(e))
    return ErrorInfo(message="the engine core failed while serving this request; retry it", type="server_error",
                     code="engine_unavailable")


async def core_died_error(_: Request, e: EngineCoreDied) -> JSONResponse:
    return error_response(503, core_died_info(e))
