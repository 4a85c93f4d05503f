"""Executors run the worker(s) for the engine core: in this process, in a child process, as spawned
tensor-parallel ranks, or as ranks ``torchrun`` launched (``external_launcher``)."""

from __future__ import annotations

from pagedllm.config.args import EngineArgs
from pagedllm.executor.base import Executor

EXECUTORS = ("uni", "mp", "external_launcher")


def make_executor(args: EngineArgs) -> Executor:
    """The executor ``args.distributed_executor_backend`` names (ValueError for an unknown one)."""
    if args.distributed_executor_backend == "external_launcher":
        from pagedllm.executor.external_launcher import ExternalLauncherExecutor

        return ExternalLauncherExecutor(args)
    if args.tensor_parallel_size > 1:
        from pagedllm.executor.tensor_parallel import TensorParallelExecutor

        return TensorParallelExecutor(args)
    if args.tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {args.tensor_parallel_size}")
    if args.distributed_executor_backend == "uni":
        from pagedllm.executor.uniproc import UniProcExecutor

        return UniProcExecutor(args)
    if args.distributed_executor_backend == "mp":
        from pagedllm.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(args)
    raise ValueError(f"distributed_executor_backend must be one of {', '.join(EXECUTORS)}, "
                     f"got {args.distributed_executor_backend!r}")


__all__ = ["EXECUTORS", "Executor", "make_executor"]
