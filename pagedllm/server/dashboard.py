"""Live view of the KV block pool.

``GET /dashboard`` serves a static page; ``GET /v1/kv/snapshot`` returns the pool as JSON (the one
format the page, tests and other tools read); ``GET /v1/kv/stream`` pushes the same snapshot as
server-sent events a few times per second.

A snapshot's engine state is copied on the engine thread between steps (``AsyncEngine.call``) as
counters and flat per-block lists, so its counts, blocks and block tables describe one moment and
the engine pauses only for the copy; the JSON is built in a worker thread. Pools of up to
``MAX_CELLS`` blocks are sent block by block, larger ones as buckets of consecutive blocks with
per-state counts, so a 100k-block pool stays cheap. All stream clients share one snapshot per tick.

Nothing in a snapshot identifies a prompt or a client: no block hashes (not even a prefix), no
request ids (each request appears under an anonymous label, ``anonymous_label``), and finished
requests hold no blocks in it. With ``--api-key`` only key holders see it at all.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import time
from collections.abc import AsyncIterator
from importlib import resources
from itertools import islice
from operator import attrgetter
from typing import Any

import numpy as np
from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse

from pagedllm.frontend.async_engine import AsyncEngine
from pagedllm.core.engine_core import EngineCore

MAX_CELLS = 4096  # larger pools are aggregated into at most this many buckets
STREAM_INTERVAL_S = 0.25
TOK_S_WINDOW_S = 2.0  # tok/s is averaged over this trailing window of engine steps
MAX_LISTED = 64  # requests listed per queue (running / swapped / waiting); the totals are always exact
STATIC = resources.files("pagedllm.server") / "static"

_LABEL_KEY = secrets.token_bytes(16)  # per process: labels are stable while it runs and unlinkable to ids

router = APIRouter()


def anonymous_label(request_id: str) -> str:
    """A request's name in snapshots: stable across snapshots (the dashboard follows it), but a keyed
    digest of the id, so it reveals neither the id nor anything that could be matched against one."""
    return "req-" + hashlib.blake2b(request_id.encode(), digest_size=4, key=_LABEL_KEY).hexdigest()


def _tok_s(eng: EngineCore, now: float) -> float:
    """Generated tokens per second over the last ``TOK_S_WINDOW_S`` seconds of steps."""
    total = 0
    for t, n in reversed(eng.stats.history):
        if t < now - TOK_S_WINDOW_S:
            break
        total += n
    return total / TOK_S_WINDOW_S


def _requests(eng: EngineCore, tables: dict[int, list[int]]) -> list[dict[str, Any]]:
    """The listed requests of each queue with their live sequences' block tables."""
    sched = eng.scheduler
    out = []
    for status, queue in (("running", sched.running), ("swapped", sched.swapped), ("waiting", sched.waiting)):
        for req in islice(queue, MAX_LISTED):
            seqs = [{"seq_id": s.seq_id, "status": s.status.value, "num_tokens": s.num_tokens,
                     "num_computed": s.num_computed, "block_table": tables.get(s.seq_id, [])}
                    for s in req.seqs if not s.finished]
            out.append({"request_id": anonymous_label(req.request_id), "status": status,
                        "num_prompt_tokens": len(req.prompt_token_ids), "seqs": seqs})
    return out


def _read(eng: EngineCore) -> dict[str, Any]:
    """Counters and flat per-block lists, read on the engine thread; the per-block dicts or
    buckets are built from them elsewhere (``_build``), so the engine pauses only for the copy."""
    kv = eng.kv
    stats = eng.pool_stats()
    seq_request = {s.seq_id: anonymous_label(rid) for rid, req in eng.requests.items() for s in req.seqs
                   if not s.finished}
    tables = {sid: kv.block_table(sid) for sid in seq_request if kv.has_seq(sid)}
    snap = {
        "time": time.time(),
        "model": eng.model_name,
        "num_blocks": kv.num_blocks,
        "block_size": kv.block_size,
        "counts": {"total": kv.num_blocks, "free": stats["free"], "cached_free": stats["cached_free"],
                   "used": stats["used"]},
        "usage": stats["usage"],
        "hit_rate": stats["hit_rate"],
        "tok_s": _tok_s(eng, time.monotonic()),
        "stats": stats,
        "num_requests": {"running": len(eng.scheduler.running), "swapped": len(eng.scheduler.swapped),
                         "waiting": len(eng.scheduler.waiting)},
        "requests": _requests(eng, tables),
    }
    return {"snapshot": snap, "refs": list(map(attrgetter("ref_count"), kv.pool.blocks)),
            "hashed": [b.block_hash is not None for b in kv.pool.blocks], "tables": tables,
            "seq_request": seq_request}


def _blocks(refs: list[int], hashed: list[bool], tables: dict[int, list[int]],
            seq_request: dict[int, str]) -> list[dict[str, Any]]:
    """One dict per block: id, ref_count, state, owner seq ids and request labels."""
    owners: dict[int, list[int]] = {}
    for sid, table in tables.items():
        for b in table:
            owners.setdefault(b, []).append(sid)
    out = []
    for i, (ref, h) in enumerate(zip(refs, hashed)):
        own = owners.get(i, [])
        out.append({"id": i, "ref_count": ref, "state": "used" if ref else ("cached" if h else "free"),
                    "owners": own, "requests": sorted({seq_request[s] for s in own})})
    return out


def _buckets(refs: list[int], hashed: list[bool], tables: dict[int, list[int]],
             seq_request: dict[int, str], max_cells: int) -> dict[str, Any]:
    """Runs of ``size`` consecutive blocks: per-state counts, shared count, max refcount and the
    request holding most blocks of each run (None if no request holds any)."""
    n = len(refs)
    size = -(-n // max_cells)
    nb = -(-n // size)

    def rows(x: np.ndarray) -> np.ndarray:  # (nb, size), the last run padded with zeros / False
        return np.pad(x, (0, nb * size - n)).reshape(nb, size)

    ref = np.asarray(refs, dtype=np.int64)
    hashed = np.asarray(hashed, dtype=bool)
    used = ref > 0
    request: list[str | None] = [None] * nb
    if tables:
        rids = sorted(set(seq_request.values()))
        index = {r: i for i, r in enumerate(rids)}
        blocks = np.concatenate([np.asarray(t, dtype=np.int64) for t in tables.values()])
        owner = np.concatenate([np.full(len(t), index[seq_request[sid]]) for sid, t in tables.items()])
        keys, counts = np.unique(blocks // size * len(rids) + owner, return_counts=True)
        bucket, rank = keys // len(rids), keys % len(rids)
        order = np.lexsort((-counts, bucket))  # by bucket, most blocks first
        bucket, rank = bucket[order], rank[order]
        first = np.r_[True, bucket[1:] != bucket[:-1]]
        for b, r in zip(bucket[first].tolist(), rank[first].tolist()):
            request[b] = rids[r]
    return {
        "size": size,
        "free": rows(~used & ~hashed).sum(1).tolist(),
        "cached": rows(~used & hashed).sum(1).tolist(),
        "used": rows(used).sum(1).tolist(),
        "shared": rows(ref > 1).sum(1).tolist(),
        "max_ref": rows(ref).max(1).tolist(),
        "request": request,
    }


def _build(raw: dict[str, Any], max_cells: int) -> dict[str, Any]:
    """The snapshot from what ``_read`` copied: per-block dicts, or buckets for large pools."""
    snap = raw["snapshot"]
    args = raw["refs"], raw["hashed"], raw["tables"], raw["seq_request"]
    if len(raw["refs"]) <= max_cells:
        snap["blocks"], snap["buckets"] = _blocks(*args), None
    else:
        snap["blocks"], snap["buckets"] = None, _buckets(*args, max_cells)
    return snap


async def take_snapshot(engine: AsyncEngine, max_cells: int = MAX_CELLS) -> dict[str, Any]:
    """One consistent snapshot of the engine's pool, requests and rates.

    ``counts`` (total / free / cached_free / used) are the pool's own counters, the ones
    ``KVCacheManager.check_integrity`` verifies. ``blocks`` lists every block (id, ref_count,
    state free|cached|used, owner seq ids and request labels) when the pool has at most
    ``max_cells`` blocks; otherwise ``blocks`` is None and ``buckets`` aggregates runs of
    ``buckets.size`` consecutive blocks.
    """
    raw = await engine.call(_read)
    return await asyncio.to_thread(_build, raw, max_cells)


def _encode(snap: dict[str, Any]) -> str:
    return json.dumps(snap, separators=(",", ":"))


class SnapshotHub:
    """Shares one snapshot among all stream clients: at most one engine read per interval."""

    def __init__(self, engine: AsyncEngine, interval: float = STREAM_INTERVAL_S):
        self.engine = engine
        self.interval = interval
        self._lock = asyncio.Lock()
        self._taken = -float("inf")
        self._event = ""

    async def latest(self) -> str:
        """The newest snapshot as an SSE ``data:`` event, refreshed when older than the interval."""
        async with self._lock:
            if time.monotonic() - self._taken >= self.interval:
                snap = await take_snapshot(self.engine)
                self._event = f"data: {await asyncio.to_thread(_encode, snap)}\n\n"
                self._taken = time.monotonic()
            return self._event


def _hub(request: Request) -> SnapshotHub:
    state = request.app.state
    if getattr(state, "kv_hub", None) is None:
        state.kv_hub = SnapshotHub(state.engine)
    return state.kv_hub


@router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
async def dashboard() -> HTMLResponse:
    """The live block-pool page (static, no network beyond this server)."""
    return HTMLResponse((STATIC / "dashboard.html").read_text(encoding="utf-8"))


@router.get("/dashboard/{name}", include_in_schema=False)
async def dashboard_asset(name: str) -> Response:
    """The page's script and stylesheet."""
    types = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
    if name not in types:
        raise HTTPException(404)
    return Response((STATIC / name).read_text(encoding="utf-8"), media_type=types[name])


@router.get("/v1/kv/snapshot")
async def kv_snapshot(request: Request) -> Response:
    """The pool now: counts, blocks (or buckets), requests with block tables, hit rate, usage, tok/s."""
    snap = await take_snapshot(request.app.state.engine)
    return Response(await asyncio.to_thread(_encode, snap), media_type="application/json")


@router.get("/v1/kv/stream")
async def kv_stream(request: Request) -> StreamingResponse:
    """``/v1/kv/snapshot`` as server-sent events, every ``STREAM_INTERVAL_S`` seconds."""
    hub = _hub(request)

    async def events() -> AsyncIterator[str]:
        while True:  # ends when the client goes away (the response cancels this generator)
            yield await hub.latest()
            await asyncio.sleep(hub.interval)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
