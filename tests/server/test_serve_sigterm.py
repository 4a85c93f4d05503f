"""`pagedllm serve` sent SIGTERM from the shell that started it: uvicorn shuts down gracefully and the process
ends by that signal (143 to the shell, as `vllm serve` does), the shell carries on, and the engine core's
process goes too."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import psutil
import pytest

from tests.server.conftest import _free_port

pytestmark = pytest.mark.slow


def test_sigterm_ends_the_server_not_its_shell(tiny_model_dir):
    port = _free_port()
    serve = (f"{sys.executable} -m pagedllm.entrypoints.cli serve --model {tiny_model_dir} --port {port} "
             "--kv-cache-memory 64MiB --stats-interval 0")
    # the server runs in the shell's own process group, as `pagedllm serve &` in a script does
    shell = subprocess.Popen(["bash", "-c", f'{serve} >/dev/null 2>&1 & echo "$!"; wait "$!"; echo "rc=$?"'],
                             stdout=subprocess.PIPE, text=True)
    try:
        server = psutil.Process(int(shell.stdout.readline()))
        deadline = time.monotonic() + 180
        while True:
            assert server.is_running() and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        children = server.children(recursive=True)
        assert children, "the engine core runs in a process of its own"
        server.terminate()
        out, _ = shell.communicate(timeout=120)
        assert out.strip() == "rc=143" and shell.returncode == 0  # the shell saw the signal's code and went on
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
    finally:
        if shell.poll() is None:
            shell.kill()
