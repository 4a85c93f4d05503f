"""Tensor parallelism: N worker processes, rank r holding shard r of the model and its kv heads of
every block. The core sends each step to every rank over its pipe (the same plain data, so block
tables agree everywhere); the ranks run the forward together, their all-reduces inside the model
(torch.distributed: gloo on CPU, NCCL on CUDA, with timeouts), and rank 0's outputs are the step's.
A rank that dies or stalls ends the engine with a WorkerError, never a hang.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle

from pagedllm.config.args import EngineArgs
from pagedllm.protocol.step_io import ModelRunnerOutput, SchedulerOutput, encode
from pagedllm.executor.base import Executor, build_in_child
from pagedllm.protocol.errors import WorkerError
from pagedllm.executor.multiproc import ask_all, copy_result, serve_steps, step_result, wait_for
from pagedllm.worker.tier_copy import BlockCopy


def _rank_main(args: EngineArgs, rank: int, port: int, threads: int, conn) -> None:
    import torch

    from pagedllm.config.device import resolve_device
    from pagedllm.distributed.parallel_state import destroy_tp_group, init_tp_group
    from pagedllm.worker.worker import Worker

    torch.set_num_threads(threads)
    # the worker's device picks the collectives: CPU ranks on a machine with a GPU join over gloo, not NCCL
    backend = "nccl" if resolve_device(args.device).type == "cuda" else "gloo"
    try:
        worker = build_in_child(conn, lambda: Worker(args, init_tp_group(rank, args.tensor_parallel_size,
                                                                          "127.0.0.1", port, backend)))
        if worker is not None:
            serve_steps(worker, conn)
    finally:
        destroy_tp_group()


class TensorParallelExecutor(Executor):
    def __init__(self, args: EngineArgs) -> None:
        from pagedllm.distributed.launcher import free_port

        n = args.tensor_parallel_size
        threads = max(1, (os.cpu_count() or 1) // n)
        ctx = mp.get_context("spawn")
        port = free_port()
        self._procs, self._conns = [], []
        for rank in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(args, rank, port, threads, child), name=f"pagedllm-tp{rank}",
                            daemon=True)
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        specs = [wait_for(p, c, c.recv) for p, c in zip(self._procs, self._conns)]
        bad = [payload for kind, payload in specs if kind != "ready"]
        if bad:
            self.shutdown()
            raise WorkerError("a tensor-parallel rank failed to start:\n" + bad[0])
        self.spec = specs[0][1]

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        data = encode(so)
        outs = ask_all(self._procs, self._conns, [data] * len(self._procs))
        return [step_result(o) for o in outs][0]

    def copy_blocks(self, msgs: list[BlockCopy]) -> list:
        """Rank r's answer to ``msgs[r]`` (issue 31: each rank copies its own heads of the blocks)."""
        return [copy_result(d) for d in ask_all(self._procs, self._conns, [pickle.dumps(m) for m in msgs])]

    def tier_blocks(self):
        from pagedllm.executor.tier_copies import RankBlocks

        return RankBlocks(self, len(self._procs))

    def shutdown(self) -> None:
        for c in self._conns:
            try:
                c.send_bytes(b"")
            except OSError:
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        for c in self._conns:
            c.close()
