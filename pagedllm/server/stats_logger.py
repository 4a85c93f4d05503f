"""A periodic stats line in the server log (as vLLM's ``LoggingStatLogger``): prompt and generation
throughput, running/waiting requests, KV usage and prefix-cache hit rate over the interval."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass

log = logging.getLogger("pagedllm.stats")

DEFAULT_INTERVAL_S = 10.0


@dataclass
class _Mark:
    prompt: int
    generation: int
    queries: int
    hits: int

    @classmethod
    def of(cls, s: dict) -> "_Mark":
        return cls(s["prompt_tokens_computed"] + s["prompt_tokens_cached"], s["generation_tokens"],
                   s["query_tokens"], s["hit_tokens"])


def stats_line(now: dict, before: _Mark, seconds: float) -> str:
    """One log line from a pool_stats() snapshot and the counters at the interval's start."""
    cur = _Mark.of(now)
    queries = cur.queries - before.queries
    hit_rate = 100.0 * (cur.hits - before.hits) / queries if queries else 0.0
    return (f"prompt throughput: {(cur.prompt - before.prompt) / seconds:.1f} tok/s, generation throughput: "
            f"{(cur.generation - before.generation) / seconds:.1f} tok/s, running: {now['running']} reqs, "
            f"waiting: {now['waiting']} reqs, KV cache usage: {100.0 * now['usage']:.1f}%, "
            f"prefix cache hit rate: {hit_rate:.1f}%"
            + (f", spec acceptance: {100.0 * now['spec_acceptance_rate']:.1f}% "
               f"(mean accepted length {now['spec_mean_accepted_length']:.2f})" if "spec_acceptance_rate" in now else ""))


async def log_stats(engine, interval_s: float) -> None:
    """Every ``interval_s``, log a stats line if the engine did anything since the last one."""
    before = _Mark.of(await engine.stats())
    while True:
        await asyncio.sleep(interval_s)
        now = await engine.stats()
        if _Mark.of(now) != before or now["running"] or now["waiting"]:
            log.info(stats_line(now, before, interval_s))
        before = _Mark.of(now)


def stats_lifespan(engine, interval_s: float | None):
    """A FastAPI lifespan running ``log_stats`` while the app serves (``interval_s`` None or 0: off)."""

    @asynccontextmanager
    async def lifespan(_app):
        task = asyncio.create_task(log_stats(engine, interval_s)) if interval_s else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()

    return lifespan
