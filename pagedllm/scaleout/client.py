"""The front end's view of N engine replicas on Ray: a core client (``add``, ``abort``,
``finish_seq``, ``call``, ``error``, ``shutdown``) that routes each request to a replica and merges
their outputs into one stream of ``EngineCoreOutput``s.

One reader thread per replica polls its outputs; it also watches the replica's life. When a
replica dies, every request it held gets a finished output with an error (never a hang), the
router stops sending it work and forgets its cache, and Ray restarts the actor; once it answers
again, it takes requests again. When every replica is gone for good, the client fails as a whole.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from pagedllm.config.args import EngineArgs
from pagedllm.frontend.core_client import OnError, OnOutputs
from pagedllm.protocol.core_io import EngineCoreOutput, EngineCoreRequest
from pagedllm.protocol.lora_request import lora_id_of
from pagedllm.scaleout import disagg
from pagedllm.scaleout.config import HASH_KEY_ENV, ScaleOutConfig
from pagedllm.scaleout.replica import Replica
from pagedllm.scaleout.router import PrefixRouter

log = logging.getLogger("pagedllm.scaleout")

POLL_S = 0.5  # a reader's longest wait for outputs (bounds how late shutdown is noticed)
RESTART_WAIT_S = 120.0  # a dead replica that does not answer within this is given up
STARTUP_TIMEOUT_S = 600.0  # replicas that cannot be placed (too few CPUs) fail the start, never hang it


class ReplicaSetClient:
    def __init__(self, args: EngineArgs, cfg: ScaleOutConfig, on_outputs: OnOutputs, on_error: OnError) -> None:
        self.cfg = cfg
        self.error: BaseException | None = None
        self._on_outputs, self._on_error = on_outputs, on_error
        self._own_ray = not ray.is_initialized()  # started here: shut down here
        if self._own_ray:
            ray.init(address=cfg.ray_address, include_dashboard=False, log_to_driver=False)
        # every replica hashes blocks with one key, so blocks move between them under their hashes
        self.hash_key = os.environ.get(HASH_KEY_ENV) or secrets.token_hex(16)
        actor = ray.remote(Replica).options(
            max_concurrency=1024, max_restarts=cfg.max_restarts, num_cpus=cfg.num_cpus_per_replica,
            runtime_env={"env_vars": {HASH_KEY_ENV: self.hash_key}})
        replica_args = dataclasses.replace(args, data_parallel_size=1, disaggregate=None, ray_address=None)
        self.replicas = [actor.remote(replica_args, i) for i in range(cfg.size)]
        try:
            specs = ray.get([r.spec.remote() for r in self.replicas], timeout=STARTUP_TIMEOUT_S)
        except GetTimeoutError:
            self._kill_all()
            have = ray.cluster_resources().get("CPU", 0)
            raise RuntimeError(f"{cfg.size} replicas did not start within {STARTUP_TIMEOUT_S:.0f} s: they ask for "
                               f"{cfg.num_cpus_per_replica} CPU each and the Ray cluster has {have}") from None
        except Exception:
            self._kill_all()
            raise
        self.spec = specs[0]
        self.prefill_ids = list(range(cfg.num_prefill))
        self.decode_ids = list(range(cfg.num_prefill, cfg.size))
        self.router = PrefixRouter(cfg.size, self.spec.block_size, cfg.routing,
                                   balance_threshold=cfg.balance_threshold, min_fetch_blocks=cfg.min_fetch_blocks)
        self.restarts = [0] * cfg.size
        self._lock = threading.Lock()
        self._inflight: dict[str, list[int]] = {}  # request -> replicas holding it (the last one streams)
        self._dead: set[int] = set()  # given up for good
        self._stop = threading.Event()
        self._readers = [threading.Thread(target=self._read, args=(i,), name=f"pagedllm-replica-{i}", daemon=True)
                         for i in range(cfg.size)]
        for t in self._readers:
            t.start()

    # ------------------------------------------------------------------ requests
    def add(self, req: EngineCoreRequest) -> Future:
        """Route ``req`` and start it; the Future fails with a clear error if its replica(s) fail."""
        if self.error is not None:
            raise RuntimeError(f"engine core failed: {self.error}")
        ids, salt = req.prompt_token_ids, req.cache_salt
        with self._lock:
            if self.cfg.disaggregated and disagg.needs_prefill(req, self.spec.block_size):
                p = self.router.route(ids, salt, self.prefill_ids).replica
                d = self.router.route(ids, salt, self.decode_ids).replica
                self._inflight[req.request_id] = [p, d]
                kv, ref = disagg.dispatch(self.replicas[p], self.replicas[d], req)
                kv.future().add_done_callback(lambda _f, rid=req.request_id: self._release(rid, p))
            else:
                route = self.router.route(ids, salt, self.decode_ids)
                d = route.replica
                self._inflight[req.request_id] = [d]
                kv = None
                if route.fetch_from is not None:
                    kv = self.replicas[route.fetch_from].export_prefix.remote(ids, salt, lora_id_of(req.lora_request))
                ref = self.replicas[d].add.remote(req, kv)
        out: Future = Future()

        def settle(f: Future) -> None:
            e = f.exception()
            if e is None:
                out.set_result(None)
                return
            self._release(req.request_id)
            why = f"replica {d} died" if isinstance(e, RayActorError) else f"starting it on replica {d} failed"
            out.set_exception(RuntimeError(f"request {req.request_id!r}: {why}: {e}"))

        ref.future().add_done_callback(settle)
        return out

    def abort(self, request_id: str) -> None:
        for r in self._release(request_id):
            self.replicas[r].abort.remote(request_id)

    def finish_seq(self, request_id: str, index: int, reason: str, stop_reason) -> None:
        with self._lock:
            held = self._inflight.get(request_id)
            r = held[-1] if held else None
        if r is not None:
            self.replicas[r].finish_seq.remote(request_id, index, reason, stop_reason)

    def call(self, fn: Callable[[Any], Any], replica: int | None = None) -> Future:
        """``fn(core)`` on one replica (default: the first that streams); a Future of its result."""
        r = self.decode_ids[0] if replica is None else replica
        return self.replicas[r].call.remote(fn).future()

    def stats(self) -> list[dict]:
        """Each replica's ``pool_stats`` plus its KV transfer sums (replicas that are down are left out)."""
        refs = [(i, r.stats.remote()) for i, r in enumerate(self.replicas) if i not in self.router.down]
        out = []
        for i, ref in refs:
            try:
                out.append({"replica": i, **ray.get(ref)})
            except RayActorError:  # died since: its reader reports it
                continue
        return out

    # ------------------------------------------------------------------ bookkeeping
    def _release(self, request_id: str, replica: int | None = None) -> list[int]:
        """Stop counting the request on ``replica`` (None: on every replica); returns those released."""
        with self._lock:
            held = self._inflight.get(request_id)
            if not held:
                return []
            gone = [r for r in held if replica is None or r == replica]
            if replica is None or len(gone) == len(held):
                del self._inflight[request_id]
            else:
                held[:] = [r for r in held if r != replica]
            for r in gone:
                self.router.done(r)
        return gone

    def _read(self, i: int) -> None:
        handle = self.replicas[i]
        while not self._stop.is_set():
            try:
                outs = ray.get(handle.poll.remote(POLL_S))
            except Exception as e:  # noqa: BLE001 - a replica we cannot read is restarted, never waited on
                if self._stop.is_set():
                    return
                if not isinstance(e, RayActorError):
                    log.error("reading replica %d failed (%s); restarting it", i, e)
                    ray.kill(handle, no_restart=False)
                self._replica_failed(i, e)
                if i in self._dead:
                    return
                continue
            if outs:
                for o in outs:
                    if o.finished:
                        self._release(o.request_id)
                self._on_outputs(outs)

    def _replica_failed(self, i: int, e: BaseException) -> None:
        """Fail what replica ``i`` held, then wait for Ray to restart it (or give it up)."""
        with self._lock:
            self.router.down.add(i)
            victims = [rid for rid, held in self._inflight.items() if i in held]
        for rid in victims:
            self._release(rid)
        log.error("replica %d died (%s); failing its %d request(s)", i, e, len(victims))
        if victims:
            self._on_outputs([EngineCoreOutput(rid, finished=True, error=f"replica {i} died: {e}") for rid in victims])
        deadline = time.monotonic() + RESTART_WAIT_S
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                ray.get(self.replicas[i].pid.remote(), timeout=POLL_S * 4)
            except (RayActorError, GetTimeoutError):
                time.sleep(POLL_S)
                continue
            with self._lock:
                self.router.forget(i)
                self.router.down.discard(i)
                self.restarts[i] += 1
            log.warning("replica %d is back (restart %d)", i, self.restarts[i])
            return
        self._dead.add(i)
        if set(self.decode_ids) <= self._dead or (self.prefill_ids and set(self.prefill_ids) <= self._dead):
            self._fail(RuntimeError(f"every replica of a role is gone (last: replica {i}: {e})"))

    def _fail(self, e: BaseException) -> None:
        if self.error is None:
            self.error = e
            self._on_error(e)

    # ------------------------------------------------------------------ lifetime
    def _kill_all(self) -> None:
        for r in self.replicas:
            ray.kill(r, no_restart=True)

    def shutdown(self) -> None:
        self._stop.set()
        self._kill_all()
        for t in self._readers:
            t.join(timeout=5)
        if self._own_ray:
            ray.shutdown()
