"""The worker in the engine core's own process: a step is a function call."""

from __future__ import annotations

from pagedllm.config.args import EngineArgs
from pagedllm.protocol.step_io import DeferredOutput, ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.base import Executor
from pagedllm.worker.worker import Worker


class UniProcExecutor(Executor):
    defers = True  # same process: a step's outputs can stay on the device until the core folds them in

    def __init__(self, args: EngineArgs) -> None:
        self.worker = Worker(args)
        self.spec = self.worker.spec

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput | DeferredOutput:
        return self.worker.execute(so)

    def tier_blocks(self):
        return self.worker.kv_cache
