"""Server subprocesses for the serving benches: start one on a free local port, wait for its ``/health``,
stop it. Our ``pagedllm serve`` and vLLM's ``vllm serve`` go through the same ``launch`` so that both are
measured from the same starting line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pagedllm_serve_command(args, port: int, extra: tuple[str, ...] = (), dtype: str | None = None) -> list[str]:
    """``pagedllm serve`` on 127.0.0.1:``port`` with the bench's seed, ``--engine`` overrides and dtype (or
    ``dtype``)."""
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "--log-level", "warning", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--dtype", dtype or args.dtype, "--seed", str(args.seed), *extra]
    for k, v in args.engine_args.items():
        flag = "--" + k.replace("_", "-")
        cmd += [flag] if v is True else [f"--no-{k.replace('_', '-')}"] if v is False else [flag, str(v)]
    return cmd


def launch(cmd: list[str], port: int, log_path: str | None, env: dict[str, str] | None = None,
           timeout: float = 240.0) -> tuple[subprocess.Popen | None, str]:
    """Start ``cmd`` (its output into ``log_path``) and poll ``/health`` until 200: (process, "ok"), or
    (None, why) when it exits or stays unhealthy past ``timeout`` (then it is stopped)."""
    import httpx

    log = open(log_path, "w") if log_path and os.path.isdir(os.path.dirname(log_path) or ".") else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    name = os.path.basename(log_path) if log_path else "no log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return None, f"server exited with code {proc.returncode} (see {name})"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, "ok"
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    stop_server(proc)
    return None, f"server not healthy after {timeout:.0f} s (see {name})"


def stop_server(proc: subprocess.Popen | None) -> None:
    """SIGTERM the server's process group, SIGKILL it if it is still up after 20 s."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def cpu_seconds(proc: subprocess.Popen) -> dict[int, float] | None:
    """CPU seconds (user + system) so far of the server process and each of its descendants (its engine core, its
    workers), by pid; None without psutil (the CPU columns are then left out, and the report says so)."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        root = psutil.Process(proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.NoSuchProcess:  # ended while we looked
            continue
    return out


def cpu_split(root_pid: int, before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
    """CPU seconds between two :func:`cpu_seconds` looks: the server process itself (the HTTP front end) and its
    descendants (the engine); a process that started in between counts from zero."""
    used = {pid: t - before.get(pid, 0.0) for pid, t in after.items()}
    return {"front_end": used.pop(root_pid, 0.0), "engine": sum(used.values())}
