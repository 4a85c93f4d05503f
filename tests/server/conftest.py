"""One real uvicorn server on loopback for the whole module, over the embedded model."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

API_KEY = "test-key"


@dataclass
class LiveServer:
    url: str
    api_key: str
    engine: "AsyncEngine"  # noqa: F821 - imported lazily with torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(engine_options: dict | None = None, **app_options):
    """A uvicorn server over a fresh engine on loopback: small pool of 16-token blocks and context (cheap over-limit
    cases), integrity check after every step, fp32, API key on; ``engine_options`` override the ``EngineArgs`` (e.g. a
    tiny model), ``app_options`` go to ``create_app``."""
    import uvicorn

    from pagedllm.config.args import EngineArgs
    from pagedllm.frontend.async_engine import AsyncEngine
    from pagedllm.server import create_app

    # fp32: the tests compare with HF fp32 token for token (auto would pick bf16 on a CPU with native bf16)
    options = dict(dtype="float32", kv_cache_memory=256 << 20, block_size=16, max_num_seqs=16, max_model_len=1024,
                   check_integrity=True)
    engine = AsyncEngine(EngineArgs(**{**options, **(engine_options or {})}))
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(engine, api_key=API_KEY, **app_options), host="127.0.0.1",
                                        port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", API_KEY, engine)
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        engine.shutdown()


@pytest.fixture(scope="module")
def server():
    with live_server() as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    """The official openai client on the module's server (a module may define its own)."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(server) -> str:
    return server.engine.model_name
