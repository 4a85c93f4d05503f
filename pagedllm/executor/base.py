"""The executor interface the engine core drives."""

from __future__ import annotations

import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from pagedllm.protocol.step_io import DeferredOutput, ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.worker import KVCacheSpec


class Executor(ABC):
    """Runs one step on the worker(s) and returns what they sampled."""

    spec: KVCacheSpec  # the pool the worker built, for the core's KV manager
    defers = False  # may answer a step with ``SchedulerOutput.defer_output`` by a ``DeferredOutput``

    @abstractmethod
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput | DeferredOutput:
        """Run one step; a ``DeferredOutput`` only where ``defers`` and the step asked for it."""

    def shutdown(self) -> None:
        """Release the worker(s); idempotent."""

    def tier_blocks(self):
        """The pool's blocks as the KV tiers copy them (``kv.pool_blocks.PoolBlocks``), or None where this
        executor cannot copy them for the tiers (issue 31)."""


def build_in_child(conn, factory: Callable[[], Any]) -> Any | None:
    """In a child process: build its object and tell the parent ("ready", obj.spec), or ("failed",
    traceback) and return None, so the parent raises with the child's own error."""
    try:
        obj = factory()
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("failed", traceback.format_exc()))
        return None
    conn.send(("ready", obj.spec))
    return obj
