"""Continuous batching with one token budget per step.

Each step: running requests first (one decode token, or the next prefill chunk), then
swapped requests come back, then waiting requests are admitted while the budget, the
running-sequence cap and free blocks allow. Prefill chunks and decodes share a step.
When the pool runs dry the most recently admitted request (under the priority policy: the least
urgent one) is preempted: by recompute (its blocks are freed but stay findable in the prefix
cache, so it re-hits its own prefix) or by swap to the host tier.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from pagedllm.core.sequence import Request, Sequence, SequenceStatus
from pagedllm.kv.kv_cache_manager import KVCacheManager
from pagedllm.lora.adapter import LoRALoadError

log = logging.getLogger("pagedllm.scheduler")

LPM_MAX_QUEUE = 128  # longer queues fall back to FCFS: matching every prompt each step gets too dear


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"  # or "swap"
    policy: str = "fcfs"  # or "lpm", or "priority" (lowest Request.priority first, then arrival: vLLM's)
    lpm_lambda: float = 10.0  # tokens of matched prefix worth one second of waiting
    batching: str = "continuous"  # or "static": admit a new batch only when the last has finished
    max_loras: int = 0  # issue 32: LoRA adapters the running requests may use at once (the worker's slots)

    def __post_init__(self) -> None:
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.policy not in ("fcfs", "lpm", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs', 'lpm' or 'priority', got {self.policy!r}")
        if self.batching not in ("continuous", "static"):
            raise ValueError(f"batching must be 'continuous' or 'static', got {self.batching!r}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # draft tokens included
    num_spec: int = 0  # the last ``num_spec`` tokens are drafts to verify (speculative decoding)

    @property
    def completes(self) -> bool:
        """The chunk reaches the sequence's last token, so the step yields a next-token distribution."""
        return self.seq.num_computed + self.num_tokens - self.num_spec == self.seq.num_tokens


@dataclass
class Schedule:
    """The scheduler's decision for one step, over live sequences (the core turns it into the
    plain-data ``step_io.SchedulerOutput`` for the worker)."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host), applied first
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    preempted: list[Request] = field(default_factory=list)
    num_prefix_hit_tokens: int = 0
    tier_hit_tokens: dict[str, int] = field(default_factory=dict)  # of those, from blocks a tier below promoted
    lora_pages: list = field(default_factory=list)  # issue 32: adapters the worker stores in their pages first

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, kv: KVCacheManager, config: SchedulerConfig):
        self.kv = kv
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.num_preemptions = 0
        self.adapters = None  # issue 32: the LoRA adapters' pages in the pool (lora.pager.AdapterPager), if any
        self.failed: list[tuple[Request, str]] = []  # requests whose adapter cannot be served: the core fails them

    # ----------------------------------------------------------------- queues
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Drop a finished or aborted request and release every block its sequences hold."""
        for queue in (self.running, self.waiting, self.swapped):
            if req in queue:
                queue.remove(req)
        for seq in req.seqs:
            if self.kv.has_seq(seq.seq_id):
                self.kv.free(seq.seq_id)

    def requeue(self, req: Request) -> None:
        """Send a request back to the front of the queue to recompute from scratch (its blocks are
        released; full blocks stay findable in the prefix cache): how the core recovers the requests
        of a step that failed."""
        for queue in (self.running, self.swapped, self.waiting):
            if req in queue:
                queue.remove(req)
        for s in req.seqs:
            if s.finished:
                continue
            if self.kv.has_seq(s.seq_id):
                self.kv.free(s.seq_id)
            s.num_computed = 0
            s.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(req)

    def num_running_seqs(self) -> int:
        return sum(1 for r in self.running for s in r.seqs if not s.finished)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ----------------------------------------------------------------- step
    def schedule(self) -> Schedule:
        out = Schedule()
        budget = [self.config.max_num_batched_tokens]
        scheduled: set[int] = set()
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if self._schedule_seqs(req, budget, out, scheduled, partial_ok=True):
                i += 1
                continue
            if self.adapters is not None and self.adapters.evict_one(self._lora_busy()):
                continue  # an idle adapter's pages went back to the pool: try again before preempting
            victim = self._preemption_victim()
            before_req = self.running.index(victim) < i
            self._preempt(victim, out, budget, scheduled)
            if victim is req:
                break
            if before_req:  # the list shifted left under the request being scheduled
                i -= 1
        if not out.preempted:
            self._swap_in(budget, out, scheduled)
        if not out.preempted and not self.swapped:
            self._admit(budget, out, scheduled)
            if not out.chunks and not self.running and self.adapters is not None and self.adapters.wait_for_load():
                self._admit(budget, out, scheduled)  # nothing else to run: the queue waited on an adapter's read
        out.copies = self.kv.take_pending_copies()
        if self.adapters is not None:
            out.lora_pages = self.adapters.take_pending()
        return out

    def _schedule_seqs(self, req: Request, budget: list[int], out: Schedule, scheduled: set[int],
                       partial_ok: bool, prefix_first: bool = False) -> bool:
        """Give each unfinished sequence of ``req`` its next chunk; False if blocks ran out."""
        beam = req.params.use_beam_search and len(req.seqs) > 1
        if beam and sum(s.num_uncomputed for s in req.seqs if not s.finished and s.seq_id not in scheduled) > budget[0]:
            return True  # beams advance together: wait for a step with room for all of them
        for seq in req.seqs:
            if seq.finished or seq.seq_id in scheduled or seq.num_uncomputed == 0:
                continue
            if seq.num_pending and seq.num_output_tokens >= req.params.max_tokens:
                continue  # its last token is being sampled by the step in flight (async scheduling)
            prefix = None
            if (prefix_first and seq.num_computed == 0 and self.config.enable_prefix_caching
                    and req.params.prompt_logprobs is None):  # prompt logprobs need every position computed
                prefix = self.kv.match_prefix(seq.token_ids, req.cache_salt, lora_id=req.lora_id)
                if prefix.num_tokens == 0:
                    prefix = None
            hit = prefix.num_tokens if prefix else 0
            need = seq.num_uncomputed - hit
            n = min(need, budget[0])
            if n < need and (beam or not (partial_ok and self.config.enable_chunked_prefill)):
                continue  # waits for a step with room for all of it
            if n == 0:
                continue
            spec = seq.spec_token_ids if need == 1 and 1 + len(seq.spec_token_ids) <= budget[0] else []
            if not self.kv.allocate_slots(seq.seq_id, seq.num_computed + hit, n + len(spec), prefix):
                # drafts are optional: without them the token may still fit
                if not spec or not self.kv.allocate_slots(seq.seq_id, seq.num_computed + hit, n, prefix):
                    seq.spec_token_ids = []
                    return False
                spec = []
            seq.spec_token_ids = spec
            if hit:
                seq.num_computed += hit
                req.metrics.num_cached_tokens += hit
                out.num_prefix_hit_tokens += hit
                for tier, tokens in prefix.tier_tokens.items():
                    out.tier_hit_tokens[tier] = out.tier_hit_tokens.get(tier, 0) + tokens
            seq.status = SequenceStatus.PREFILLING if seq.num_uncomputed > 1 else SequenceStatus.DECODING
            budget[0] -= n + len(spec)
            scheduled.add(seq.seq_id)
            out.chunks.append(ScheduledChunk(seq, n + len(spec), len(spec)))
        return True

    def _preemption_victim(self) -> Request:
        """The running request to preempt when blocks run out: under the priority policy the least urgent
        (largest priority value, latest arrival), as vLLM v1's scheduler picks; otherwise the latest admitted."""
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, req: Request, out: Schedule, budget: list[int], scheduled: set[int]) -> None:
        """Release ``req``'s blocks (recompute) or move them to the host tier (swap)."""
        self.running.remove(req)
        dropped = [c for c in out.chunks if c.seq.request is req]
        out.chunks = [c for c in out.chunks if c.seq.request is not req]
        budget[0] += sum(c.num_tokens for c in dropped)
        live = [s for s in req.seqs if not s.finished]
        for s in live:
            scheduled.discard(s.seq_id)
            s.spec_token_ids = []
        self.num_preemptions += 1
        out.preempted.append(req)
        # allocations made this step for dropped chunks are released with the sequence
        if self.config.preemption_mode == "swap" and self._swap_out(live, out):
            self.swapped.append(req)
            log.info("preempted request %s by swap (%d seqs)", req.request_id, len(live))
            return
        for s in live:
            if self.kv.has_seq(s.seq_id):
                self.kv.free(s.seq_id)
            s.num_computed = 0
            s.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(req)
        log.info("preempted request %s by recompute (%d seqs)", req.request_id, len(live))

    def _swap_out(self, seqs: list[Sequence], out: Schedule) -> bool:
        """Move the request's blocks to the host tier at once (shared blocks stay shared); False: host full."""
        pairs = self.kv.swap_out_group([s.seq_id for s in seqs])
        if pairs is None:
            return False
        out.swap_out += pairs
        for s in seqs:
            s.status = SequenceStatus.SWAPPED
        return True

    def _swap_in(self, budget: list[int], out: Schedule, scheduled: set[int]) -> None:
        while self.swapped:
            req = self.swapped[0]
            live = [s for s in req.seqs if not s.finished]
            pairs = self.kv.swap_in_group([s.seq_id for s in live])
            if pairs is None:  # not enough free device blocks yet
                return
            out.swap_in += pairs
            self.swapped.popleft()
            self.running.append(req)
            for s in live:
                s.status = SequenceStatus.DECODING
            if not self._schedule_seqs(req, budget, out, scheduled, partial_ok=True):
                return

    def _next_waiting(self) -> Request:
        if self.config.policy == "priority":
            best = min(self.waiting, key=lambda r: (r.priority, r.arrival_time))
            self.waiting.remove(best)
            return best
        if self.config.policy == "lpm" and 1 < len(self.waiting) <= LPM_MAX_QUEUE and self.config.enable_prefix_caching:
            now = time.monotonic()

            def priority(r: Request) -> float:
                matched = self.kv.match_prefix(r.seqs[0].token_ids, r.cache_salt, False, r.lora_id).num_tokens
                return matched + self.config.lpm_lambda * (now - r.arrival_time)

            best = max(self.waiting, key=priority)
            self.waiting.remove(best)
            return best
        return self.waiting.popleft()

    def _first_block_key(self, req: Request) -> tuple | None:
        """Identity of the prompt's first full block (with the tenant salt), if it has one."""
        bs = self.kv.block_size
        ids = req.prompt_token_ids
        return (req.cache_salt, req.lora_id, tuple(ids[:bs])) if len(ids) > bs else None

    def _in_flight_prefixes(self) -> set[tuple]:
        """First blocks of the running requests' prompts. A waiting request that shares one and misses the prefix
        cache waits: that block is being computed. Not only those with ``num_computed < block_size``: under async
        scheduling a step in flight has advanced ``num_computed`` but its blocks enter the cache only when its
        outputs are folded in, a step later."""
        keys = (self._first_block_key(r) for r in self.running)
        return {k for k in keys if k is not None}

    def _admit(self, budget: list[int], out: Schedule, scheduled: set[int]) -> None:
        """Admit waiting requests; one whose prompt starts like a prompt being prefilled right now waits a
        step or two so it reads those blocks from the prefix cache instead of computing them again."""
        if self.config.batching == "static" and self.running:
            return
        dedupe = self.config.enable_prefix_caching and self.config.batching == "continuous"
        in_flight = self._in_flight_prefixes() if dedupe and self.waiting else set()
        deferred: list[Request] = []
        try:
            while self.waiting and budget[0] > 0:
                req = self.waiting[0]
                live = sum(1 for s in req.seqs if not s.finished)
                if self.num_running_seqs() + live > self.config.max_num_seqs:
                    return
                req = self._next_waiting()
                if not self._lora_fits(req):  # its adapter waits for a free slot or its load; others go ahead
                    deferred.append(req)
                    continue
                key = self._first_block_key(req) if dedupe and req.seqs[0].num_computed == 0 else None
                if key is not None and key in in_flight and self.kv.match_prefix(
                        req.seqs[0].token_ids, req.cache_salt, False, req.lora_id).num_tokens == 0:
                    deferred.append(req)
                    continue
                if req.seqs[0].num_computed == 0 and self.kv.prefetch(  # its blocks are coming from a KV tier
                        req.seqs[0].token_ids, req.cache_salt, wait=not out.chunks and not self.running,
                        lora_id=req.lora_id):
                    deferred.append(req)
                    continue
                if not self._try_admit(req, budget, out, scheduled):
                    self.waiting.appendleft(req)
                    if self.adapters is not None and self.adapters.evict_one(self._lora_busy() | {req.lora_id}):
                        continue  # an idle adapter's pages went back to the pool: try it again
                    return
                if key is not None and req.metrics.num_cached_tokens == 0:
                    in_flight.add(key)
        finally:
            self.waiting.extendleft(reversed(deferred))

    def _lora_fits(self, req: Request) -> bool:
        """Whether admitting ``req`` keeps the running and swapped requests' adapters within ``max_loras``."""
        if not req.lora_id:
            return True
        held = self._lora_busy()
        if req.lora_id not in held and len(held) >= self.config.max_loras:
            return False
        try:
            return self.adapters is None or self.adapters.ready(req.lora_request, held)  # read and in its pages
        except LoRALoadError as e:  # this request fails with the reason, the others go on
            self.failed.append((req, str(e)))
            return False

    def unload_lora(self, lora_id: int) -> bool:
        """Free an unloaded adapter's pages now if no running or swapped request uses it (issue 32)."""
        return self.adapters is not None and self.adapters.unload(lora_id, self._lora_busy())

    def _lora_busy(self) -> set[int]:
        """Adapters that running or swapped requests use (their pages stay)."""
        return {r.lora_id for q in (self.running, self.swapped) for r in q if r.lora_id}

    def _try_admit(self, req: Request, budget: list[int], out: Schedule, scheduled: set[int]) -> bool:
        """Schedule ``req``'s first chunk; on failure undo everything it got this step."""
        before, cached, hit = len(out.chunks), req.metrics.num_cached_tokens, out.num_prefix_hit_tokens
        tier_hit = dict(out.tier_hit_tokens)
        if self._schedule_seqs(req, budget, out, scheduled, partial_ok=True, prefix_first=True) and (
            len(out.chunks) > before
        ):
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.monotonic()
            self.running.append(req)
            return True
        # no blocks (or no budget) for it now: release what it got
        for c in out.chunks[before:]:
            budget[0] += c.num_tokens
            scheduled.discard(c.seq.seq_id)
        out.chunks = out.chunks[:before]
        for s in req.seqs:
            if self.kv.has_seq(s.seq_id):
                self.kv.free(s.seq_id)
            s.num_computed = 0
        req.metrics.num_cached_tokens, out.num_prefix_hit_tokens, out.tier_hit_tokens = cached, hit, tier_hit
        return False
