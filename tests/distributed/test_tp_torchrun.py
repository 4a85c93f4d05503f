"""Two nodes on one machine: two ``torchrun`` invocations with different ``--node-rank`` over loopback form
one TP=2 group, and each rank's sharded forward equals TP=1 (tp_programs.main)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pagedllm.distributed.launcher import free_port

PROGRAM = Path(__file__).with_name("tp_programs.py")


def test_two_torchrun_nodes_run_one_tp_group():
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(PROGRAM.parents[2]), os.environ.get("PYTHONPATH")]))}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                               str(PROGRAM)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node in (0, 1)]
    try:
        outs = [p.communicate(timeout=240)[0] for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    for node, (p, out) in enumerate(zip(nodes, outs)):
        assert p.returncode == 0, f"node {node}:\n{out}"
        assert f"rank {node}/2: tokens equal True" in out, out
