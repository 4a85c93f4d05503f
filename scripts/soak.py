#!/usr/bin/env python3
"""Soak: many mixed requests against one server, sampling the RSS of its API and engine-core
processes, ending with a verdict: each process grew less than 2% over the second half of the run
(after the first half has warmed every cache up to its bound).

The mix: chat, completions, n=2, logprobs, structured outputs (JSON schema and choice), streams that
are read to the end and streams abandoned after their first chunk (aborts). Any request that fails
(a non-200, a stream without [DONE]) fails the run.

    python scripts/soak.py                       # 20,000 requests, its own server on a tiny random model
    python scripts/soak.py --short               # 400 requests (CI)
    python scripts/soak.py --model PATH --requests 50000 --out soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx
import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from load_test import start_server, wait_healthy  # noqa: E402 - a sibling script

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
          "required": ["name", "n"]}
KINDS = {"chat": 25, "completion": 20, "n2": 10, "logprobs": 10, "json": 8, "choice": 7, "stream": 10, "abort": 10}
VERDICT_GROWTH = 0.02


@dataclass
class Soak:
    url: str
    headers: dict
    max_tokens: int
    rng: random.Random = field(default_factory=lambda: random.Random(34))
    counts: dict = field(default_factory=dict)

    def prompt(self) -> str:
        shared = "You are a helpful assistant. Answer briefly. " * self.rng.randint(0, 3)  # prefix-cache hits
        return shared + " ".join(self.rng.choices(WORDS, k=self.rng.randint(4, 60)))

    async def one(self, http: httpx.AsyncClient, kind: str) -> None:
        chat = {"messages": [{"role": "user", "content": self.prompt()}], "max_tokens": self.max_tokens}
        cmpl = {"prompt": self.prompt(), "max_tokens": self.max_tokens}
        path, body = {
            "chat": ("/v1/chat/completions", chat),
            "completion": ("/v1/completions", cmpl),
            "n2": ("/v1/completions", {**cmpl, "n": 2, "temperature": 0.8}),
            "logprobs": ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 5}),
            "json": ("/v1/chat/completions", {**chat, "max_tokens": 48, "response_format": {
                "type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}}),
            "choice": ("/v1/completions", {**cmpl, "structured_outputs": {"choice": ["yes", "no", "maybe"]}}),
            "stream": ("/v1/chat/completions", {**chat, "stream": True}),
            "abort": ("/v1/completions", {**cmpl, "max_tokens": 64, "stream": True, "ignore_eos": True}),
        }[kind]
        if not body.get("stream"):
            r = await http.post(path, json=body)
            if r.status_code != 200:
                raise RuntimeError(f"{kind}: {r.status_code} {r.text[:200]}")
        else:
            async with http.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"{kind}: {r.status_code}")
                last = None
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        last = line
                        if kind == "abort":  # leave after the first chunk: the server aborts the request
                            break
                if kind != "abort" and last != "data: [DONE]":
                    raise RuntimeError(f"{kind}: the stream ended without [DONE]")
        self.counts[kind] = self.counts.get(kind, 0) + 1


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def growth(samples: list[float]) -> float:
    """Growth over the second half: the median of its last fifth against the median of its first fifth
    (medians: one sample taken mid-step must not decide the verdict)."""
    half = samples[len(samples) // 2:]
    k = max(1, len(half) // 5)
    start, end = statistics.median(half[:k]), statistics.median(half[-k:])
    return (end - start) / start


async def drive(soak: Soak, n: int, concurrency: int, pids: dict[str, int], every: int) -> list[dict]:
    kinds = soak.rng.choices(list(KINDS), weights=list(KINDS.values()), k=n)
    samples: list[dict] = []
    done = 0
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=soak.url, headers=soak.headers, timeout=120) as http:
        queue = iter(kinds)

        async def worker() -> None:
            nonlocal done
            for kind in queue:
                await soak.one(http, kind)
                done += 1
                if done % every == 0:
                    samples.append({"requests": done, "s": round(time.monotonic() - t0, 1),
                                    **{name: round(rss_mb(pid), 1) for name, pid in pids.items()}})
                    print(json.dumps(samples[-1]), flush=True)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples


def core_pid(server_pid: int) -> int:
    cores = [c for c in psutil.Process(server_pid).children() if "spawn_main" in " ".join(c.cmdline())]
    if len(cores) != 1:
        raise SystemExit(f"expected one engine-core child of {server_pid}, found {cores}")
    return cores[0].pid


def tiny_model(path: str) -> str:
    """A 2-layer random Llama with the embedded model's tokenizer: the engine's bookkeeping at a tiny
    compute cost (what a soak exercises)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pagedllm.models import load_checkpoint

    tok = AutoTokenizer.from_pretrained(load_checkpoint(None).path)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                 tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                                 eos_token_id=tok.eos_token_id)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--short", action="store_true", help="400 requests: a check that the soak runs (CI)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--samples", type=int, default=100, help="RSS samples over the run")
    ap.add_argument("--model", default=None, help="model to serve (default: a tiny random model)")
    ap.add_argument("--serve-args", default="--kv-cache-memory 128MiB --max-num-seqs 32 --stats-interval 0")
    ap.add_argument("--out", default=None, help="write the samples and verdict here as JSON")
    args = ap.parse_args()
    n = 400 if args.short else args.requests
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = tempfile.mkdtemp(prefix="pagedllm-soak-")
    model = args.model or tiny_model(os.path.join(tmp, "tiny"))
    log = open(os.path.join(tmp, "serve.log"), "w+")
    proc = start_server(port, ["--model", model, *shlex.split(args.serve_args)], log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=600)
        pids = {"api_mb": proc.pid, "core_mb": core_pid(proc.pid)}
        soak = Soak(url, {}, args.max_tokens)
        t0 = time.monotonic()
        samples = asyncio.run(drive(soak, n, args.concurrency, pids, max(1, n // args.samples)))
        wall = time.monotonic() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    result = {"requests": n, "wall_s": round(wall, 1), "mix": soak.counts, "load": os.getloadavg(),
              "growth_second_half": {name: round(growth([s[name] for s in samples]), 4) for name in pids},
              "samples": samples}
    result["verdict"] = "pass" if all(g < VERDICT_GROWTH for g in result["growth_second_half"].values()) else "fail"
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}))
    return 0 if result["verdict"] == "pass" or args.short else 1


if __name__ == "__main__":
    sys.exit(main())
