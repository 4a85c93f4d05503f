#!/usr/bin/env python3
"""Load test: N concurrent streaming chat clients against a pagedllm server on loopback.

Some clients disconnect mid-stream; afterwards the server must be idle with 0 KV blocks in use
(read from /metrics) and healthy (/health runs the pool integrity check when the server was
started with --check-integrity, as this script does for its own server). Bounded in client
count and wall time; exits 1 on any error or leak.

    python scripts/load_test.py                      # starts its own server (embedded model)
    python scripts/load_test.py --url http://127.0.0.1:8000 --api-key K
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from urllib.parse import urlparse

import httpx
from prometheus_client.parser import text_string_to_metric_families

MAX_CLIENTS = 1000
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass
class Result:
    disconnect: bool
    ttft: float | None = None
    tokens: int = 0
    error: str | None = None


async def chat_client(http: httpx.AsyncClient, i: int, max_tokens: int, disconnect: bool) -> Result:
    """One streaming chat; a disconnecting client runs long (ignore_eos) and hangs up after 2 content chunks."""
    res = Result(disconnect)
    body = {"messages": [{"role": "user", "content": f"Request {i}: name a fruit and a color."}],
            "max_tokens": 64 if disconnect else max_tokens, "ignore_eos": disconnect, "temperature": 0.7,
            "seed": i, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    res.error = data["error"]["message"]
                    return res
                if data.get("usage"):
                    res.tokens = data["usage"]["completion_tokens"]
                if any(c["delta"].get("content") for c in data["choices"]):
                    chunks += 1
                    res.ttft = res.ttft or time.monotonic() - t0
                    if disconnect and chunks == 2:
                        res.tokens = chunks
                        return res  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def scrape(http: httpx.Client) -> dict[str, float]:
    text = http.get("/metrics").text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


def wait_idle(http: httpx.Client, timeout: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(http)
        busy = m["pagedllm_num_requests_running"] + m["pagedllm_num_requests_waiting"] + m["pagedllm_kv_blocks_used"]
        if busy == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def start_server(port: int, serve_args: list[str], log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *serve_args]
    print("starting:", shlex.join(cmd), flush=True)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"server at {url} not healthy after {timeout:.0f} s")


def pct(xs: list[float], q: int) -> float:
    if len(xs) < 2:
        return xs[0] if xs else float("nan")
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1]


async def poll_health(http: httpx.AsyncClient, stop: asyncio.Event, every: float = 0.1) -> list[float]:
    """/health latency (seconds) every ``every`` s while the clients run: is the API process free while the engine is busy?"""
    lat = []
    while not stop.is_set():
        t0 = time.monotonic()
        await http.get("/health")
        lat.append(time.monotonic() - t0)
        await asyncio.sleep(every)
    return lat


async def run_clients(url: str, headers: dict, n: int, disconnects: int,
                      max_tokens: int) -> tuple[list[Result], float, list[float]]:
    step = max(1, n // max(disconnects, 1))
    hangers = set(range(0, n, step)[:disconnects])
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=httpx.Timeout(600)) as http:
        stop = asyncio.Event()
        health = asyncio.create_task(poll_health(http, stop))
        t0 = time.monotonic()
        results = await asyncio.gather(*(chat_client(http, i, max_tokens, i in hangers) for i in range(n)))
        wall = time.monotonic() - t0
        stop.set()
        return list(results), wall, await health


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="an already running server (loopback only); default: start one")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--disconnects", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=900, help="wall-clock bound on the client phase (s)")
    ap.add_argument("--serve-args", default="--check-integrity --kv-cache-memory 268435456 --max-num-seqs 64",
                    help="extra `pagedllm serve` arguments for the server this script starts")
    args = ap.parse_args()
    if not 1 <= args.clients <= MAX_CLIENTS or not 0 <= args.disconnects <= args.clients:
        ap.error(f"need 1 <= clients <= {MAX_CLIENTS} and 0 <= disconnects <= clients")

    proc, log = None, None
    if args.url:
        if urlparse(args.url).hostname not in LOOPBACK:
            ap.error("--url must be a loopback address")
        url = args.url.rstrip("/")
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        log = tempfile.NamedTemporaryFile("w+", prefix="pagedllm-serve-", suffix=".log", delete=False)
        proc = start_server(port, shlex.split(args.serve_args), log)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        wait_healthy(url, proc, timeout=300)
        http = httpx.Client(base_url=url, headers=headers, timeout=60)
        before = scrape(http)
        results, wall, health_lat = asyncio.run(asyncio.wait_for(
            run_clients(url, headers, args.clients, args.disconnects, args.max_tokens), args.timeout))
        after = wait_idle(http, timeout=60)
        health = http.get("/health")
        metrics_text = http.get("/metrics").text
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)

    errors = [r for r in results if r.error]
    ttfts = [r.ttft for r in results if r.ttft is not None]
    gen = after["pagedllm_generation_tokens_total"] - before["pagedllm_generation_tokens_total"]
    done = sum(not r.disconnect and not r.error for r in results)
    print(metrics_text)
    print(f"clients {len(results)} ({args.disconnects} disconnecting mid-stream), wall {wall:.1f} s")
    print(f"requests/s {len(results) / wall:.2f} (completed {done}, {done / wall:.2f}/s)")
    print(f"TTFT p50 {pct(ttfts, 50) * 1e3:.0f} ms, p99 {pct(ttfts, 99) * 1e3:.0f} ms (n={len(ttfts)})")
    print(f"/health under load p50 {pct(health_lat, 50) * 1e3:.0f} ms, p99 {pct(health_lat, 99) * 1e3:.0f} ms "
          f"(n={len(health_lat)})")
    print(f"tokens/s {gen / wall:.1f} (server generated {gen:.0f}; clients received "
          f"{sum(r.tokens for r in results)})")
    print(f"errors {len(errors)}" + "".join(f"\n  client error: {r.error}" for r in errors[:10]))
    print(f"after: running {after['pagedllm_num_requests_running']:.0f}, waiting "
          f"{after['pagedllm_num_requests_waiting']:.0f}, KV blocks used {after['pagedllm_kv_blocks_used']:.0f}, "
          f"aborted {after['pagedllm_request_aborted_total'] - before['pagedllm_request_aborted_total']:.0f}, "
          f"/health {health.status_code}")
    ok = not errors and after["pagedllm_kv_blocks_used"] == 0 and health.status_code == 200
    if not ok and log is not None:
        log.seek(0)
        print("server log tail:\n" + "".join(log.readlines()[-30:]), file=sys.stderr)
    print("PASS" if ok else "FAIL")
    if log is not None:
        os.unlink(log.name)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
