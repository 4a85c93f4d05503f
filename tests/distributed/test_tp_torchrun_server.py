"""`pagedllm serve` across two torchrun "nodes" on loopback (``--distributed-executor-backend
external_launcher``): node 0 runs the engine and the only API server, node 1 executes its steps; the served
tokens equal TP=1's, and stopping node 0 ends node 1 cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.launcher import free_port


def _node(node: int, master_port: int, model: str, http_port: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank",
         str(node), "--master-addr", "127.0.0.1", "--master-port", str(master_port), "-m", "pagedllm.entrypoints.cli", "serve",
         model, "--tensor-parallel-size", "2", "--distributed-executor-backend", "external_launcher",
         "--kv-cache-memory", str(16 << 20), "--port", str(http_port)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def test_two_torchrun_nodes_serve_one_engine(tiny_model_dir, wiki_texts):
    prompt = wiki_texts[3][:200]
    want = LLM(tiny_model_dir, kv_cache_memory=16 << 20).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    master, port = free_port(), free_port()
    nodes = [_node(n, master, tiny_model_dir, port) for n in (0, 1)]
    try:
        deadline = time.monotonic() + 240
        while True:
            assert all(p.poll() is None for p in nodes), "a node exited early:\n" + "\n".join(
                p.communicate()[0] for p in nodes if p.poll() is not None)
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "node 0's server did not come up"
            time.sleep(0.5)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                       json={"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        os.killpg(nodes[0].pid, signal.SIGINT)  # Ctrl-C on node 0: its server stops, its engine tells node 1
        outs = [p.communicate(timeout=60)[0] for p in nodes]
    finally:  # SIGTERM first: torchrun passes it on to its workers, which run in sessions of their own
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in nodes:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
    assert nodes[1].returncode == 0, outs[1]
    assert "tensor-parallel rank 1 of 2: executing the steps of rank 0's engine" in outs[1]
    assert "rank 0 stopped the engine" in outs[1]
    assert "Uvicorn running" not in outs[1] and "Uvicorn running" in outs[0]
