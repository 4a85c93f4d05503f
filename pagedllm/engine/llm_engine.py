"""The synchronous engine: add requests, step the scheduler/model/sampler loop, collect outputs."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from pagedllm.attention import default_backend, get_backend
from pagedllm.engine.args import EngineArgs, resolve_dtype
from pagedllm.engine.beam_search import BeamSearch
from pagedllm.engine.outputs import CompletionOutput, RequestOutput
from pagedllm.engine.sampler import Sampler
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedllm.engine.sequence import Request, Sequence, SequenceStatus
from pagedllm.kv.kv_cache import KVCache
from pagedllm.kv.kv_quant import resolve_kv_cache_dtype
from pagedllm.kv.kv_cache_manager import KVCacheManager
from pagedllm.model_runner import ModelRunner, SeqChunk
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.loader import load_checkpoint

log = logging.getLogger("pagedllm.engine")


@dataclass
class EngineStats:
    """Counters since start plus the last step's gauges (what /metrics and the dashboard show)."""

    num_steps: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    num_requests_finished: int = 0
    last_step_tokens: int = 0
    last_step_time: float = 0.0
    history: list[tuple[float, int]] = field(default_factory=list)  # (time, generated tokens) per step, bounded


class LLMEngine:
    def __init__(self, args: EngineArgs | None = None, **kwargs):
        args = args or EngineArgs(**kwargs)
        self.args = args
        t0 = time.monotonic()
        ckpt = load_checkpoint(args.model)
        self.model_config = ckpt.config
        self.tokenizer = ckpt.tokenizer
        self.model_name = args.model or "SmolLM2-135M-Instruct"
        dtype = resolve_dtype(args.dtype)
        kv_dtype = dtype if args.kv_cache_dtype == "auto" else resolve_kv_cache_dtype(args.kv_cache_dtype)
        cfg = ckpt.config
        model = LlamaForCausalLM.from_checkpoint(ckpt, dtype, args.quantization)
        del ckpt
        dims = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, args.block_size, kv_dtype)
        if args.num_blocks is not None:
            num_blocks = args.num_blocks
        elif args.kv_cache_memory is not None:
            num_blocks = KVCache.num_blocks_for_budget(args.kv_cache_memory, *dims)
        else:
            num_blocks = KVCache.num_blocks_for_memory_fraction(args.kv_cache_fraction, *dims)
        if num_blocks < 1:
            raise ValueError("the KV cache budget does not hold a single block; raise --kv-cache-memory")
        num_host_blocks = KVCache.num_blocks_for_budget(args.swap_space, *dims) if args.swap_space else 0
        if args.preemption_mode == "swap" and num_host_blocks == 0:
            raise ValueError("preemption_mode='swap' needs a host tier: set swap_space (bytes)")
        self.kv_cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks, args.block_size,
                                dtype=kv_dtype, num_host_blocks=num_host_blocks)
        self.kv = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching, num_host_blocks)
        self.max_model_len = min(args.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        backend_name = args.attention_backend
        if backend_name == "auto":
            backend_name = default_backend()
        self.runner = ModelRunner(model, self.kv_cache, get_backend(backend_name))
        self.scheduler = Scheduler(self.kv, SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
            enable_chunked_prefill=args.enable_chunked_prefill, enable_prefix_caching=args.enable_prefix_caching,
            preemption_mode=args.preemption_mode, policy=args.scheduling_policy, batching=args.batching))
        eos = list(cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in eos:
            eos.append(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos
        self.sampler = Sampler(eos)
        self.beam = BeamSearch(self)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._ids = itertools.count()
        torch.manual_seed(args.seed)
        log.info("engine ready in %.1f s: %s, dtype %s, kv %s, %d blocks of %d tokens (%d tokens), backend %s",
                 time.monotonic() - t0, self.model_name, dtype, kv_dtype, num_blocks, args.block_size,
                 num_blocks * args.block_size, backend_name)

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            vocab = self.model_config.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
            return None, list(prompt)
        raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Everything that can be wrong with a request, checked before it is scheduled."""
        params.validate()
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the context limit (max_model_len) is "
                             f"{self.max_model_len}, leaving no room to generate")
        bs = self.kv.block_size
        width = params.beam_width if params.use_beam_search else params.n
        total = min(len(prompt_ids) + params.max_tokens, self.max_model_len)
        need = -(-total // bs) + (width - 1) * -(-params.max_tokens // bs)
        if need > self.kv.num_blocks:
            raise ValueError(f"request needs up to {need} KV blocks but the pool has {self.kv.num_blocks}; "
                             "shorten the prompt/max_tokens or enlarge the KV cache")

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None) -> Request:
        params = params or SamplingParams()
        text, ids = self.tokenize(prompt)
        self.validate(ids, params)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        req = Request(rid, text, ids, params, cache_salt=cache_salt)
        req.seqs.append(Sequence(req, 0, list(ids), req.make_generator(0)))
        self.requests[rid] = req
        self.scheduler.add(req)
        return req

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for s in req.seqs:
            if not s.finished:
                s.status, s.finish_reason = SequenceStatus.FINISHED, "abort"
        self.scheduler.remove(req)
        req.metrics.finished_time = time.monotonic()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ step
    def step(self) -> list[Request]:
        """Run one scheduler step; returns the requests that made progress (finished ones included)."""
        t0 = time.monotonic()
        sched = self.scheduler.schedule()
        if sched.swap_out:
            self.kv_cache.swap_out(sched.swap_out)
        if sched.swap_in:
            self.kv_cache.swap_in(sched.swap_in)
        if not sched.chunks:
            if self.scheduler.has_work() and not sched.swap_in and not sched.preempted:
                raise RuntimeError("scheduler made no progress: the pool cannot hold any waiting request")
            return []
        chunks = [SeqChunk(c.seq.token_ids[c.seq.num_computed: c.seq.num_computed + c.num_tokens],
                           c.seq.num_computed, self.kv.block_table(c.seq.seq_id), c.completes)
                  for c in sched.chunks]
        completing = [c.seq for c in sched.chunks if c.completes]
        logits = self.runner.execute(chunks, sched.copies)
        self._account(sched)
        progressed = self._sample(completing, logits)
        self._finish_step(sched, t0, sum(1 for s in completing))
        return progressed

    def _account(self, sched: SchedulerOutput) -> None:
        bs = self.kv.block_size
        for c in sched.chunks:
            seq = c.seq
            prompt_part = max(0, min(seq.num_prompt_tokens, seq.num_computed + c.num_tokens) - seq.num_computed)
            self.stats.prompt_tokens_computed += prompt_part
            seq.num_computed += c.num_tokens
            if seq.num_computed // bs > seq.num_hashed and self.args.enable_prefix_caching:
                self.kv.cache_full_blocks(seq.seq_id, seq.token_ids[: seq.num_computed], seq.request.cache_salt)
                seq.num_hashed = seq.num_computed // bs
        self.stats.prompt_tokens_cached += sched.num_prefix_hit_tokens

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[Request]:
        progressed: dict[str, Request] = {}
        plain_rows = [i for i, s in enumerate(seqs) if not s.request.params.use_beam_search]
        beam_rows = [i for i, s in enumerate(seqs) if s.request.params.use_beam_search]
        if beam_rows:
            for req in self.beam.step([seqs[i] for i in beam_rows], logits[beam_rows]):
                progressed[req.request_id] = req
        if plain_rows:
            rows, row_seqs = [], []
            for i in plain_rows:
                seq = seqs[i]
                req = seq.request
                if req.params.n > len(req.seqs) and seq.num_output_tokens == 0:
                    for j in range(len(req.seqs), req.params.n):  # parallel samples share the prompt's blocks
                        child = seq.fork(j, req.make_generator(j))
                        self.kv.fork(seq.seq_id, child.seq_id)
                        req.seqs.append(child)
                        rows.append(i)
                        row_seqs.append(child)
                rows.append(i)
                row_seqs.append(seq)
            result = self.sampler(logits[rows], row_seqs)
            for k, seq in enumerate(row_seqs):
                top = result.top_logprobs[k] if result.top_logprobs is not None else None
                self.append_token(seq, result.token_ids[k], result.logprobs[k], top)
                progressed[seq.request.request_id] = seq.request
        now = time.monotonic()
        for req in progressed.values():
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            if req.finished:
                req.metrics.finished_time = now
                self.scheduler.remove(req)
                self.requests.pop(req.request_id, None)
                self.stats.num_requests_finished += 1
        return list(progressed.values())

    def append_token(self, seq: Sequence, token: int, logprob: float, top: dict[int, float] | None) -> None:
        """Add a sampled token, then apply the stop rules (eos, stop ids, stop strings, lengths)."""
        p = seq.request.params
        seq.token_ids.append(token)
        seq.cumulative_logprob += logprob
        if seq.logprobs is not None and top is not None:
            seq.logprobs.append(top)
        self.stats.generation_tokens += 1
        if seq.status is not SequenceStatus.FINISHED:
            seq.status = SequenceStatus.DECODING
        reason, stop_reason = None, None
        if token in self.eos_token_ids and not p.ignore_eos:
            reason = "stop"
        elif token in p.stop_token_ids:
            reason, stop_reason = "stop", token
        elif p.stop and seq.num_output_tokens >= p.min_tokens:
            # only text that is new since the last check (plus a stop string's overlap) can hold a new match
            if seq.num_output_tokens == max(p.min_tokens, 1):  # first check: text before this token is exempt
                seq.text = self.tokenizer.decode(seq.output_token_ids[:-1], skip_special_tokens=p.skip_special_tokens)
            start = max(0, len(seq.text) - max(len(s) for s in p.stop) + 1)
            seq.text = self.detokenize(seq)
            hits = [(i, s) for s in p.stop if (i := seq.text.find(s, start)) >= 0]
            if hits:
                pos, s = min(hits)
                seq.text = seq.text[:pos]
                reason, stop_reason = "stop", s
        if reason is None and (seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            self.finish(seq, reason, stop_reason)

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, reason, stop_reason
        if not isinstance(stop_reason, str):
            seq.text = self.detokenize(seq)
        if self.kv.has_seq(seq.seq_id):
            self.kv.free(seq.seq_id)  # a finished sample releases its blocks at once

    def detokenize(self, seq: Sequence) -> str:
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.request.params.skip_special_tokens)

    def _finish_step(self, sched: SchedulerOutput, t0: float, sampled: int) -> None:
        st = self.stats
        st.num_steps += 1
        st.num_preemptions = self.scheduler.num_preemptions
        st.last_step_tokens = sched.num_tokens
        st.last_step_time = time.monotonic() - t0
        st.history.append((time.monotonic(), sampled))
        if len(st.history) > 4096:
            del st.history[:2048]
        if self.args.check_integrity:
            self.kv.check_integrity()

    # ------------------------------------------------------------------ outputs
    def output(self, req: Request) -> RequestOutput:
        """The request's state now (cumulative), as RequestOutput."""
        if req.params.use_beam_search:
            return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, self.beam.outputs(req),
                                 req.finished, req.metrics, num_cached_tokens=req.metrics.num_cached_tokens)
        outs = []
        for i, s in enumerate(req.seqs[: req.params.n]):
            text = s.text if s.finished else self.detokenize(s)
            outs.append(CompletionOutput(index=i, text=text, token_ids=list(s.output_token_ids),
                                         finish_reason=s.finish_reason, cumulative_logprob=s.cumulative_logprob,
                                         logprobs=s.logprobs, stop_reason=s.stop_reason))
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.finished, req.metrics,
                             num_cached_tokens=req.metrics.num_cached_tokens)

    def reset_prefix_cache(self) -> int:
        """Forget every cached-free block (as vLLM's ``reset_prefix_cache``; blocks of running requests keep
        theirs), e.g. so a benchmark's second pass over the same prompts computes them again. Returns how
        many were dropped."""
        return self.kv.prefix_cache.evict(self.kv.pool.num_cached_free)

    def pool_stats(self) -> dict:
        """Gauges for metrics and the dashboard."""
        kv = self.kv.stats()
        return {
            **kv,
            "running": self.scheduler.num_running_seqs(),
            "waiting": len(self.scheduler.waiting),
            "swapped": len(self.scheduler.swapped),
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens_computed": self.stats.prompt_tokens_computed,
            "prompt_tokens_cached": self.stats.prompt_tokens_cached,
            "generation_tokens": self.stats.generation_tokens,
            "num_steps": self.stats.num_steps,
        }
