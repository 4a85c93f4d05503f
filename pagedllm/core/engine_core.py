"""The engine core: the scheduler, the KV manager and the requests' token ids, driving an executor.

Each step: schedule, turn the schedule into a plain-data ``SchedulerOutput`` (new sequences once,
then diffs), run it on the worker(s), and fold the ``ModelRunnerOutput`` back in: computed tokens
counted, full blocks hashed (by the KV manager), sampled tokens appended, stop rules on token ids
applied (eos, stop ids, lengths). It returns token-id deltas (``EngineCoreOutput``); text, stop
strings and the API's shapes belong to the front end.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

from pagedllm.config.args import EngineArgs
from pagedllm.core.beam_search import BeamSearch
from pagedllm.kv.kv_events import make_publisher
from pagedllm.protocol.core_io import EngineCoreOutput, EngineCoreRequest, SeqDelta
from pagedllm.protocol.limits import RequestLimits
from pagedllm.core.scheduler import Schedule, ScheduledChunk, Scheduler, SchedulerConfig
from pagedllm.core.sequence import Request, Sequence, SequenceStatus
from pagedllm.core.speculation import Speculator
from pagedllm.protocol.step_io import (DeferredOutput, Logprobs, ModelRunnerOutput, NewSeqData, ScheduledSeq,
                                       SchedulerOutput, resolve)
from pagedllm.executor import Executor, make_executor
from pagedllm.protocol.errors import WorkerError
from pagedllm.kv.kv_cache_manager import KVCacheManager
from pagedllm.kv.tier_setup import build_tiers
from pagedllm.lora.pager import AdapterPager

log = logging.getLogger("pagedllm.core")
GRAMMAR_WAIT_S = 0.01  # an idle core waits this long for a grammar before it reads its commands again


@dataclass
class InFlightStep:
    """A step run but not folded in yet (async scheduling)."""

    sched: Schedule
    so: SchedulerOutput
    ro: ModelRunnerOutput | DeferredOutput  # deferred: the worker answered before the ids reached the host
    t0: float
    computed: dict[int, int]  # seq id -> computed tokens right after this step


@dataclass
class EngineStats:
    """Counters since start plus the last step's gauges (what /metrics and the dashboard show)."""

    num_steps: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0
    # of the cached, those promoted from a tier below the pool for the request that hit them ("host", "disk")
    prompt_tokens_cached_tier: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    generation_tokens: int = 0
    num_preemptions: int = 0
    num_requests_finished: int = 0
    last_step_tokens: int = 0
    last_step_time: float = 0.0
    history: list[tuple[float, int]] = field(default_factory=list)  # (time, generated tokens) per step, bounded


class EngineCore:
    def __init__(self, args: EngineArgs, executor: Executor | None = None) -> None:
        self.args = args
        self.executor = executor or make_executor(args)
        spec = self.executor.spec
        self.spec = spec
        self.limits = RequestLimits(spec.max_model_len, spec.num_blocks, spec.block_size, spec.vocab_size)
        self.eos_token_ids = list(spec.eos_token_ids)
        self.max_model_len = spec.max_model_len
        self.kv = KVCacheManager(spec.num_blocks, spec.block_size, args.enable_prefix_caching, spec.num_host_blocks,
                                 args.kv_eviction)
        self.kv_events = make_publisher(args.kv_events_config, spec.block_size)  # vLLM's KV events, or None
        if self.kv_events is not None:
            self.kv.prefix_cache.on_event = self.kv_events.record
        if args.kv_offload_memory or args.kv_disk_path:  # issue 31: tiers below the pool
            blocks = self.executor.tier_blocks()  # the pool, or each rank's shard of it through the executor
            self.kv.attach_tiers(*build_tiers(args, spec, blocks), blocks)
        self.scheduler = Scheduler(self.kv, SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
            enable_chunked_prefill=args.enable_chunked_prefill, enable_prefix_caching=args.enable_prefix_caching,
            preemption_mode=args.preemption_mode, policy=args.scheduling_policy, batching=args.batching,
            max_loras=args.max_loras if args.enable_lora else 0))
        self.scheduler.adapters = AdapterPager.for_engine(args, spec, self.kv)  # issue 32: adapters in KV pages
        self.beam = BeamSearch(self)
        self._structured = None  # StructuredOutputManager, made with the first structured request
        self._compiling: dict[str, Future] = {}  # requests whose grammar compiles; they join the scheduler after
        self.speculator = Speculator.from_config(args.speculative_config, getattr(self.executor, "worker", None))
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._forks: list[tuple[int, int, int]] = []  # for the next SchedulerOutput
        self._released: list[int] = []  # sequences the worker can drop
        self._outputs: dict[str, tuple[Request, EngineCoreOutput]] = {}  # this step's, by request
        self._recovering = False  # the last step failed and its requests are being retried
        self.async_scheduling = (spec.device.startswith("cuda") if args.async_scheduling is None
                                 else args.async_scheduling)
        self._in_flight: InFlightStep | None = None  # async scheduling: the step whose tokens are not folded in yet

    # ------------------------------------------------------------------ requests
    def add_request(self, r: EngineCoreRequest) -> None:
        """Queue a request (the front end validated it with ``self.limits``; checked again here)."""
        if r.request_id in self.requests:
            raise ValueError(f"request id {r.request_id!r} is already in use")
        self.limits.check(r.prompt_token_ids, r.params)
        if r.lora_request is not None and not self.scheduler.config.max_loras:
            raise ValueError(f"lora_request {r.lora_request.lora_name!r}: this engine was started without enable_lora")
        if r.lora_request is not None and self.kv_events is not None:  # BlockStored names the adapter
            self.kv_events.lora_names[r.lora_request.lora_int_id] = r.lora_request.lora_name
        req = Request(r.request_id, None, list(r.prompt_token_ids), r.params, cache_salt=r.cache_salt,
                      priority=r.priority, lora_request=r.lora_request)
        if r.arrival_time is not None:
            req.arrival_time = req.metrics.arrival_time = r.arrival_time
        seq = Sequence(req, 0, list(r.prompt_token_ids))
        req.seqs.append(seq)
        compiling = None
        if r.params.structured_outputs is not None:  # a spec that does not parse is refused here, at once
            compiling = self.structured.prepare(r.params.structured_outputs)
        if self.speculator is not None:
            self.speculator.start(r.request_id, req.prompt_token_ids)
        self.requests[r.request_id] = req
        if compiling is None:
            self.scheduler.add(req)
        else:
            self._compiling[r.request_id] = compiling
            self._take_compiled()  # a spec compiled before is in already

    def _take_compiled(self) -> None:
        """Requests whose grammar is compiled join the scheduler; one whose compile failed ends with the reason.
        Until then a request holds no blocks, and the other requests' steps go on while its grammar compiles."""
        for request_id, compiling in list(self._compiling.items()):
            if not compiling.done():
                continue
            del self._compiling[request_id]
            req = self.requests[request_id]
            try:
                compiled = compiling.result()
            except Exception as e:  # noqa: BLE001 - this request fails with the reason, the others go on
                self.abort_request(request_id, error=str(e))
                continue
            self.structured.add(req.seqs[0].seq_id, req.params.structured_outputs, req.prompt_token_ids, compiled)
            self.scheduler.add(req)

    def abort_request(self, request_id: str, error: str | None = None) -> None:
        """Stop a request and free its blocks; with ``error`` its caller hears why (serving it failed)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self._compiling.pop(request_id, None)  # its compile goes on: requests with the same spec share it
        if error is not None:
            out = self._output(req)
            out.error, out.finished = error, True
        for s in req.seqs:
            if not s.finished:
                s.status, s.finish_reason = SequenceStatus.FINISHED, "abort"
            s.drop_pending()
            self._released.append(s.seq_id)
            if self._structured is not None:  # an aborted structured sequence's grammar state goes too
                self._structured.free(s.seq_id)
        self.scheduler.remove(req)
        req.metrics.finished_time = time.monotonic()
        if self.speculator is not None:
            self.speculator.forget(request_id)

    def finish_seq(self, request_id: str, index: int, reason: str = "stop", stop_reason: str | int | None = None) -> None:
        """End one sample early (the front end found a stop string in its text)."""
        req = self.requests.get(request_id)
        if req is None:
            return
        for s in req.seqs:
            if s.index == index and not s.finished:
                self.finish(s, reason, stop_reason)
        if req.finished:
            self._retire(req, time.monotonic())

    def has_unfinished(self) -> bool:
        """Work queued, or a step in flight with a sequence still going (one whose sequences all stopped a
        step late has nothing to show: the next step folds it in)."""
        step = self._in_flight
        return (self.scheduler.has_work() or bool(self._compiling)
                or (step is not None and not all(c.seq.finished for c in step.sched.chunks)))

    @property
    def structured(self):
        """Grammar states of structured sequences (xgrammar over the model's tokenizer), made on first use."""
        if self._structured is None:
            from pagedllm.models.loader import load_tokenizer
            from pagedllm.structured.manager import StructuredOutputManager

            self._structured = StructuredOutputManager(load_tokenizer(self.args.model), self.spec.vocab_size,
                                                       self.eos_token_ids)
        return self._structured

    # ------------------------------------------------------------------ public interface for beam search
    def fork_seq(self, parent: Sequence, index: int) -> Sequence:
        """A child sharing every block of ``parent`` (the worker copies the parent's row next step)."""
        child = parent.fork(index)
        self.kv.fork(parent.seq_id, child.seq_id)
        if self._structured is not None:
            self._structured.fork(parent.seq_id, child.seq_id)
        if parent.num_sent:
            self._forks.append((parent.seq_id, child.seq_id, index))
        return child

    def release_seq(self, seq: Sequence, reason: str = "abort") -> None:
        """Drop a sequence that will not continue (its blocks and its worker row). One that finished leaves
        its last, partly filled block findable too (``cache_tail``), for a prompt that continues it: up to, not
        including, its last token, whose K/V a step in flight may still be writing (async scheduling)."""
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        seq.drop_pending()
        if self.kv.has_seq(seq.seq_id):
            if reason in ("stop", "length"):  # (a swapped-out sequence holds no pool block: nothing to index)
                req = seq.request
                self.kv.cache_tail(seq.seq_id, seq.token_ids[:min(seq.num_computed, seq.num_tokens - 1)],
                                   req.cache_salt, req.lora_id)
            self.kv.free(seq.seq_id)
        if self._structured is not None:
            self._structured.free(seq.seq_id)
        self._released.append(seq.seq_id)

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        self.release_seq(seq, reason)
        seq.stop_reason = stop_reason
        self._delta(seq).finish_reason, self._delta(seq).stop_reason = reason, stop_reason

    # ------------------------------------------------------------------ step
    def step(self) -> list[EngineCoreOutput]:
        """Run one scheduler step; returns the outputs of requests that made progress. Under async
        scheduling a step of plain requests stays in flight: the next call schedules and runs the next
        step (its sequences' last tokens are ``PENDING_TOKEN`` places the worker fills) before folding
        this one's tokens in, so outputs come one call later."""
        t0 = time.monotonic()
        if self._compiling:
            self._wait_for_grammars()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.max_model_len)
        sched = self.scheduler.schedule()
        for req, why in self.scheduler.failed:  # issue 32: an adapter that cannot be served fails its request
            self.abort_request(req.request_id, error=why)
        self.scheduler.failed.clear()
        so = self._worker_step(sched)
        prev, self._in_flight = self._in_flight, None
        if not sched.chunks:
            if so.swap_out or so.swap_in or so.copies or so.forks or so.finished_seq_ids or so.lora_pages:
                self.executor.execute(so)
            if prev is not None:
                self._resolve(prev)
            elif self.scheduler.has_work() and not sched.swap_in and not sched.preempted:
                raise RuntimeError("scheduler made no progress: the pool cannot hold any waiting request")
            return self._take_outputs()
        overlap = self._overlaps(sched)
        so.defer_output = overlap and self.executor.defers
        try:
            ro = self.executor.execute(so)
        except WorkerError:
            raise  # the worker process is gone: nothing to retry on
        except Exception as e:  # noqa: BLE001 - pinned on this step's new requests, or retried once
            if prev is not None:
                self._resolve(prev)
            self._recover(sched, so, e)
            return self._take_outputs()
        self._recovering = False
        if overlap:
            self._in_flight = InFlightStep(sched, so, ro, t0, self._advance_in_flight(sched))
        if prev is not None:
            self._resolve(prev)
        if self._in_flight is None:
            self._update(sched, so, ro)
            self._finish_step(sched, t0)
        return self._take_outputs()

    def _wait_for_grammars(self) -> None:
        """Take in the compiled grammars; with nothing else to run, first wait a little for one (the core's
        loop would otherwise spin on a core the compile needs)."""
        if not self.scheduler.has_work() and self._in_flight is None:
            wait(list(self._compiling.values()), timeout=GRAMMAR_WAIT_S, return_when=FIRST_COMPLETED)
        self._take_compiled()

    def _overlaps(self, sched: Schedule) -> bool:
        """Whether this step may stay in flight: async scheduling on, and only plain requests in it (beam
        search, parallel samples, drafts and grammars need their tokens before the next step is made)."""
        if not self.async_scheduling or self.speculator is not None:
            return False
        return all(not p.use_beam_search and (p.best_of or p.n) == 1 and p.structured_outputs is None
                   for p in (c.seq.request.params for c in sched.chunks))

    def _advance_in_flight(self, sched: Schedule) -> dict[int, int]:
        """Count a step in flight as computed now, and hold a place for each token it samples, so the next
        schedule sees where every sequence will be. Returns each sequence's computed count after it."""
        computed = {}
        for c in sched.chunks:
            samples = c.completes
            self._advance(c)
            computed[c.seq.seq_id] = c.seq.num_computed
            if samples:
                c.seq.add_pending()
        return computed

    def _resolve(self, step: InFlightStep) -> None:
        """Fold in a step that was in flight (its outputs are ready once the next step is running)."""
        self._update(step.sched, step.so, resolve(step.ro), step.computed)
        self._finish_step(step.sched, step.t0)

    def _advance(self, c: ScheduledChunk) -> None:
        """The chunk's tokens have K/V now."""
        seq = c.seq
        self.stats.prompt_tokens_computed += max(
            0, min(seq.num_prompt_tokens, seq.num_computed + c.num_tokens) - seq.num_computed)
        seq.num_computed += c.num_tokens

    def _recover(self, sched: Schedule, so: SchedulerOutput, e: Exception) -> None:
        """A failed step: its new requests are aborted with the error; every other request of the step
        starts over (recomputed, its worker row resent whole). A second failure in a row is fatal."""
        if self._recovering:
            raise RuntimeError(f"engine step failed twice in a row: {type(e).__name__}: {e}") from e
        self._recovering = True
        self._released += so.finished_seq_ids  # in case the worker failed before dropping them
        if self.scheduler.adapters is not None:  # issue 32: adapters whose pages the worker may not have written
            self.scheduler.adapters.forget(so.lora_pages)
        log.exception("engine step failed; retrying without its new requests", exc_info=e)
        new = {n.seq_id for n in so.new_seqs}
        touched = {c.seq.request.request_id: c.seq.request for c in sched.chunks}
        touched.update((r.request_id, r) for r in sched.preempted)
        for rid, req in touched.items():
            if any(s.seq_id in new for s in req.seqs):
                self.abort_request(rid, error=f"serving this request failed: {type(e).__name__}: {e}")
                continue
            self.scheduler.requeue(req)
            for s in req.seqs:
                s.num_sent = 0

    def _worker_step(self, sched: Schedule) -> SchedulerOutput:
        """The schedule as plain data: what the worker has not seen, and what changed."""
        so = SchedulerOutput(forks=self._forks, finished_seq_ids=self._released, swap_out=sched.swap_out,
                             swap_in=sched.swap_in, copies=sched.copies, lora_pages=sched.lora_pages)
        self._forks, self._released = [], []
        for c in sched.chunks:
            seq, req = c.seq, c.seq.request
            p = req.params
            if seq.num_sent == 0:
                so.new_seqs.append(NewSeqData(seq.seq_id, list(seq.token_ids), seq.num_prompt_tokens, p, seq.index,
                                               req.lora_request))
                new_tokens = []
            else:
                new_tokens = seq.token_ids[seq.num_sent:]
            seq.num_sent = seq.num_tokens
            keep, new_blocks = self.kv.take_table_diff(seq.seq_id)
            beam = p.use_beam_search
            width = p.best_of or p.n
            first_sample = c.completes and not beam and seq.num_output_tokens == 0 and len(req.seqs) < width
            prompt_lp = p.prompt_logprobs if seq.index == 0 and seq.num_computed < seq.num_prompt_tokens else None
            so.scheduled.append(ScheduledSeq(
                seq.seq_id, seq.num_computed, c.num_tokens, new_tokens, keep, new_blocks, c.completes,
                num_samples=width - len(req.seqs) + 1 if first_sample else 1,
                beam_topk=self.beam.candidates(req) if beam else 0, prompt_logprobs=prompt_lp,
                spec_token_ids=list(seq.spec_token_ids) if c.num_spec else []))
        if self._structured is not None and self._structured.states:
            filled = self._structured.fill([c.seq.seq_id if c.completes else None for c in sched.chunks])
            if filled is not None:
                so.grammar_bitmask, so.grammar_rows = filled
        return so

    def _update(self, sched: Schedule, so: SchedulerOutput, ro: ModelRunnerOutput,
                computed: dict[int, int] | None = None) -> None:
        """Fold a step's outputs in; ``computed``: it was in flight and already advanced (each sequence's
        computed count right after it, what its hashed blocks cover)."""
        salt_of = self.kv.cache_full_blocks
        beams: list[tuple[Sequence, Logprobs]] = []
        for c, out in zip(sched.chunks, ro.outputs):
            seq = c.seq
            req = seq.request
            if req.request_id not in self.requests or seq.finished:  # aborted, or stopped while in flight
                continue
            if computed is None:
                self._advance(c)
            elif not seq.status.is_running:  # preempted while in flight: its blocks are gone or on the host
                if out.error is not None:
                    self.abort_request(req.request_id, error=out.error)
                else:
                    self._take_samples(seq, out)
                continue
            ids = seq.token_ids
            if c.num_spec:  # rejected drafts: their KV is not the sequence's; only verified tokens are hashed
                kept = max(len(out.token_ids) - 1, 0)
                seq.num_computed -= c.num_spec - kept
                self.kv.free_tail(seq.seq_id, seq.num_computed)
                self.speculator.record(seq, c.num_spec, kept, out.token_ids)
                seq.spec_token_ids = []
                if kept:  # the kept drafts' KV is in the pool before they join token_ids below
                    ids = ids + out.token_ids[:kept]
            salt_of(seq.seq_id, ids, req.cache_salt,
                    num_computed=seq.num_computed if computed is None else computed[seq.seq_id], lora_id=req.lora_id)
            if out.error is not None:
                self.abort_request(req.request_id, error=out.error)
                continue
            if out.prompt_logprobs is not None:
                self._output(req).prompt_logprobs = out.prompt_logprobs
            if out.beam_topk is not None:
                beams.append((seq, out.beam_topk))
                continue
            self._take_samples(seq, out, c.num_spec)
        self.stats.prompt_tokens_cached += sched.num_prefix_hit_tokens
        for tier, tokens in sched.tier_hit_tokens.items():
            self.stats.prompt_tokens_cached_tier[tier] += tokens
        if beams:
            self.beam.step(beams)
        now = time.monotonic()
        for req, _ in list(self._outputs.values()):
            if req.metrics.first_token_time is None and any(s.num_output_tokens for s in req.seqs):
                req.metrics.first_token_time = now
            if req.finished:
                self._retire(req, now)

    def _take_samples(self, seq: Sequence, out, num_spec: int = 0) -> None:
        """Append a step's tokens for ``seq`` (and stop it where a rule says so)."""
        req = seq.request
        try:
            if num_spec:
                for tok, lp in zip(out.token_ids, out.logprobs):  # kept drafts, then the target's token
                    self.append_token(seq, tok, lp, None)
                    if seq.finished:
                        break
            elif out.token_ids:
                self._append_samples(seq, out)
        except Exception as e:  # noqa: BLE001 - stopping or a grammar failed for this request alone
            log.exception("request %s failed while taking its tokens", req.request_id)
            self.abort_request(req.request_id, error=f"serving this request failed: {type(e).__name__}: {e}")

    def _append_samples(self, seq: Sequence, out) -> None:
        """Append the sampled token(s); a request's first token for n samples forks the others."""
        req = seq.request
        lp = out.top_logprobs
        for j in range(1, len(out.token_ids)):  # fork_seq copies the grammar state before the parent advances
            child = self.fork_seq(seq, len(req.seqs))
            req.seqs.append(child)
            self.append_token(child, out.token_ids[j], out.logprobs[j], None if lp is None else _row(lp, j))
        self.append_token(seq, out.token_ids[0], out.logprobs[0], None if lp is None else _row(lp, 0))

    def append_token(self, seq: Sequence, token: int, logprob: float, top: Logprobs | None) -> None:
        """Add a sampled token, then apply the stop rules on token ids (eos, stop ids, lengths)."""
        p = seq.request.params
        if self._structured is not None and self._structured.accept([seq.seq_id], [token]):
            raise RuntimeError(f"sequence {seq.seq_id} sampled token {token}, which its grammar forbids")
        seq.append(token)
        seq.cumulative_logprob += logprob
        self.stats.generation_tokens += 1
        d = self._delta(seq)
        d.new_token_ids.append(token)
        d.cumulative_logprob = seq.cumulative_logprob
        if top is not None:
            d.logprobs = top if d.logprobs is None else _cat(d.logprobs, top)
        if seq.status is not SequenceStatus.FINISHED:
            seq.status = SequenceStatus.DECODING
        reason, stop_reason = None, None
        if token in self.eos_token_ids and not p.ignore_eos:
            reason = "stop"
        elif token in p.stop_token_ids:
            reason, stop_reason = "stop", token
        done = seq.num_tokens - seq.num_pending  # tokens sampled by a step in flight do not count yet
        if reason is None and (done - seq.num_prompt_tokens >= p.max_tokens or done >= self.max_model_len):
            reason = "length"
        if reason is not None:
            self.finish(seq, reason, stop_reason)

    def _retire(self, req: Request, now: float) -> None:
        if req.request_id not in self.requests:
            return
        req.metrics.finished_time = now
        self.scheduler.remove(req)
        self.requests.pop(req.request_id, None)
        self.stats.num_requests_finished += 1
        self._output(req).finished = True
        if self.speculator is not None:
            self.speculator.forget(req.request_id)

    # ------------------------------------------------------------------ outputs
    def _output(self, req: Request) -> EngineCoreOutput:
        entry = self._outputs.get(req.request_id)
        if entry is None:
            entry = self._outputs[req.request_id] = (req, EngineCoreOutput(req.request_id))
        return entry[1]

    def _delta(self, seq: Sequence) -> SeqDelta:
        out = self._output(seq.request)
        for d in out.seqs:
            if d.index == seq.index:
                return d
        d = SeqDelta(seq.index, [], seq.cumulative_logprob)
        out.seqs.append(d)
        return d

    def beam_output(self, req: Request, hypotheses: list[tuple[list[int], float]]) -> None:
        """Beam search reports its current best hypotheses (whole outputs) for the front end."""
        out = self._output(req)
        out.seqs = [SeqDelta(i, list(toks), lp, finish_reason="stop" if req.finished else None, replace=True)
                    for i, (toks, lp) in enumerate(hypotheses)]

    def _take_outputs(self) -> list[EngineCoreOutput]:
        if self.kv_events is not None:  # one event batch per step
            self.kv_events.flush()
        outs = []
        for req, o in self._outputs.values():
            o.num_cached_tokens = req.metrics.num_cached_tokens
            o.metrics = dataclasses.replace(req.metrics)
            outs.append(o)
        self._outputs = {}
        return outs

    def _finish_step(self, sched: Schedule, t0: float) -> None:
        st = self.stats
        st.num_steps += 1
        st.num_preemptions = self.scheduler.num_preemptions
        st.last_step_tokens = sched.num_tokens
        st.last_step_time = time.monotonic() - t0
        if self.speculator is not None and all(c.num_tokens == 1 + c.num_spec for c in sched.chunks):
            self.speculator.observe_step(sched.num_tokens, st.last_step_time)  # a decode step: the draft cost curve
        sampled = sum(len(d.new_token_ids) for _, o in self._outputs.values() for d in o.seqs if not d.replace)
        st.history.append((time.monotonic(), sampled))
        if len(st.history) > 4096:
            del st.history[:2048]
        if self.args.check_integrity:
            self.check_integrity()

    # ------------------------------------------------------------------ KV blocks between engines
    def export_kv_blocks(self, block_ids: list[int]) -> dict:
        """The K/V of device blocks as CPU tensors (``KVCache.export_blocks``), for another engine."""
        return self._local_kv_cache().export_blocks(block_ids)

    def import_kv_blocks(self, block_ids: list[int], data: dict) -> None:
        """Write K/V from another engine's ``export_kv_blocks`` into device blocks (between steps)."""
        self._local_kv_cache().import_blocks(block_ids, data)

    def _local_kv_cache(self):
        worker = getattr(self.executor, "worker", None)
        if worker is None:
            raise ValueError("distributed_executor_backend: moving KV blocks between engines needs the "
                             "worker in the core's process ('uni')")
        return worker.kv_cache

    # ------------------------------------------------------------------ read-only views
    def reset_prefix_cache(self) -> int:
        """Forget every cached-free block (as vLLM's ``reset_prefix_cache``). Returns how many."""
        return self.kv.reset_prefix_cache()

    def pool_stats(self) -> dict:
        """Gauges for metrics and the dashboard."""
        return {
            **self.kv.stats(),
            "running": self.scheduler.num_running_seqs(),
            "waiting": len(self.scheduler.waiting) + len(self._compiling),  # as vLLM counts WAITING_FOR_FSM
            "swapped": len(self.scheduler.swapped),
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens_computed": self.stats.prompt_tokens_computed,
            "prompt_tokens_cached": self.stats.prompt_tokens_cached,
            "prompt_tokens_cached_host": self.stats.prompt_tokens_cached_tier["host"],
            "prompt_tokens_cached_disk": self.stats.prompt_tokens_cached_tier["disk"],
            "generation_tokens": self.stats.generation_tokens,
            "num_steps": self.stats.num_steps,
            "kv_dtype": self.spec.kv_pool["dtype"],
            "kv_bytes_per_token": self.spec.kv_pool["bytes_per_token"],
            "kv_capacity_tokens": self.spec.kv_pool["capacity_tokens"],
            **({} if self.speculator is None else {
                "spec_drafts": self.speculator.stats.num_drafts,
                "spec_accepted": self.speculator.stats.num_accepted,
                "spec_acceptance_rate": self.speculator.stats.acceptance_rate,
                "spec_mean_accepted_length": self.speculator.stats.mean_accepted_length}),
        }

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        if self.scheduler.adapters is not None:
            self.scheduler.adapters.check_integrity()

    @property
    def model_name(self) -> str:
        return self.spec.model_name

    def shutdown(self) -> None:
        if self._structured is not None:
            self._structured.shutdown()
        if self.kv_events is not None:
            self.kv_events.close()
        self.kv.close()  # the pool's cached blocks to the KV tiers (a restart finds them on disk)
        if self.scheduler.adapters is not None:
            self.scheduler.adapters.close()
        self.executor.shutdown()


def _row(lp: Logprobs, i: int) -> Logprobs:
    return Logprobs(lp.token_ids[i:i + 1], lp.logprobs[i:i + 1])


def _cat(a: Logprobs, b: Logprobs) -> Logprobs:
    import torch

    return Logprobs(torch.cat([a.token_ids, b.token_ids]), torch.cat([a.logprobs, b.logprobs]))
