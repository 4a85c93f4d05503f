"""The HTTP side of ``pagedllm bench serve --baselines vllm``: streaming ``/v1/completions`` requests sent at
their Poisson arrival times to any OpenAI-compatible server, timed at the client.

Per request: TTFT (send -> first chunk with text), the gaps between text chunks, the output tokens the server
counted (``usage`` of the last chunk, asked for with ``stream_options.include_usage``), and an error string
when the request did not finish. The records feed ``serve_stats.summarize``.
"""

from __future__ import annotations

import asyncio
import json
import time

from pagedllm.bench.workloads import GREEDY, BenchRequest


async def stream_one(client, url: str, model: str, r: BenchRequest, sampling: dict | None = None) -> dict:
    """One streamed completion of ``r`` (ignore_eos: every request makes ``r.max_tokens`` tokens), greedy unless
    ``sampling`` gives the body's sampling fields."""
    body = {"model": model, "prompt": r.prompt_ids, "max_tokens": r.max_tokens, **(sampling or GREEDY),
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    res = {"label": r.label, "ttft": None, "itl": [], "tokens": 0, "error": None}
    t0 = last = time.monotonic()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                res["error"] = f"HTTP {resp.status_code}: {(await resp.aread())[:160]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                now = time.monotonic()
                if any(c.get("text") for c in chunk.get("choices") or ()):
                    if res["ttft"] is None:
                        res["ttft"] = now - t0
                    else:
                        res["itl"].append(now - last)
                    last = now
                if chunk.get("usage"):
                    res["tokens"] = chunk["usage"]["completion_tokens"]
    except Exception as e:  # noqa: BLE001 - any transport failure is this request's error, not the run's
        res["error"] = f"{type(e).__name__}: {e}"[:160]
    if res["error"] is None and res["tokens"] != r.max_tokens:
        res["error"] = f"{res['tokens']} of {r.max_tokens} tokens"
    return res


async def drive(base_url: str, model: str, reqs: list[BenchRequest], arrivals: list[float],
                timeout_s: float = 1800.0, sampling: dict | None = None) -> tuple[list[dict], float]:
    """Send ``reqs[i]`` at ``arrivals[i]`` s after the start (with ``sampling``'s fields, default greedy); (records,
    wall seconds until the last one ended)."""
    import httpx

    limits = httpx.Limits(max_connections=len(reqs) + 1, max_keepalive_connections=len(reqs) + 1)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.monotonic()

        async def at(i: int, r: BenchRequest) -> dict:
            await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.monotonic()))
            return await stream_one(client, f"{base_url}/v1/completions", model, r, sampling)

        results = await asyncio.gather(*(at(i, r) for i, r in enumerate(reqs)))
        return list(results), time.monotonic() - t0
