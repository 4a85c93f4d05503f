"""Shared bench plumbing: building our engine, driving it with a progress bar, peak-memory sampling."""

from __future__ import annotations

import gc
import os
import statistics
import threading
import time
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from pagedllm.bench.workloads import BenchRequest

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakRSS:
    """Samples the process RSS every few ms in a thread; ``peak_mb`` is the peak above the start."""

    def __init__(self, interval: float = 0.003):
        self.interval = interval
        self.start = self.peak = 0
        self._stop = threading.Event()
        self._t: threading.Thread | None = None

    def __enter__(self) -> PeakRSS:
        gc.collect()
        self.start = self.peak = rss_bytes()
        self._stop.clear()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._t:
            self._t.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def peak_mb(self) -> float:
        return (self.peak - self.start) / 2**20

    @property
    def peak_total_mb(self) -> float:
        return self.peak / 2**20


_LLMS: dict = {}
REUSE_ENGINES = False  # the smoke tests turn this on: engines are reused across benches in one process
# scheduler-only settings that a reused engine can switch in place (EngineArgs name -> SchedulerConfig name)
_SCHED_FIELDS = {"max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_num_batched_tokens",
                 "enable_chunked_prefill": "enable_chunked_prefill", "enable_prefix_caching": "enable_prefix_caching",
                 "scheduling_policy": "policy", "batching": "batching"}


def make_llm(dtype: str = "auto", seed: int = 0, **engine_args):
    """A fresh ``LLM``; with ``REUSE_ENGINES`` (smoke tests: loading the weights dominates the tiny
    --quick runs) an engine with the same non-scheduler settings is reused and its scheduler settings
    are switched in place."""
    from pagedllm.entrypoints.llm import LLM

    if not REUSE_ENGINES:
        return LLM(dtype=dtype, seed=seed, **engine_args)
    import dataclasses

    from pagedllm.config.args import EngineArgs

    defaults = dataclasses.asdict(EngineArgs.offline(device=engine_args.get("device", "auto")))  # as LLM sets them
    fixed = tuple(sorted((k, v) for k, v in engine_args.items() if k not in _SCHED_FIELDS and defaults.get(k) != v))
    key = (dtype, seed, fixed)
    llm = _LLMS.get(key)
    if llm is None:
        llm = _LLMS[key] = LLM(dtype=dtype, seed=seed, **engine_args)
        return llm
    eng = llm.engine
    assert not eng.has_unfinished()
    for name, sched_name in _SCHED_FIELDS.items():
        v = engine_args.get(name, defaults[name])
        setattr(eng.args, name, v)
        setattr(eng.scheduler.config, sched_name, v)
        if name == "enable_prefix_caching":
            eng.kv.enable_prefix_caching = v
    return llm


def engine_warmup(llm, n: int = 2) -> None:
    """One short request so first-call costs (allocations, backend setup) stay out of the timings."""
    from pagedllm.protocol import SamplingParams

    eng = llm.engine
    ids = eng.tokenizer.encode("Warm up the engine with a short prompt.", add_special_tokens=False)
    llm.generate([ids] * n, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0), use_tqdm=False)


@dataclass
class RunResult:
    """One system's run over a workload."""

    system: str
    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    ttft_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)  # arrival -> finished, per request
    tpot_s: list[float] = field(default_factory=list)  # per request mean inter-token time
    output_lens: list[int] = field(default_factory=list)
    peak_mb: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s if self.elapsed_s > 0 else float("nan")

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else float("nan")

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s if self.elapsed_s > 0 else float("nan")

    def keep_completed(self, reqs: list[BenchRequest]) -> None:
        """A run cut short by a time budget: count only the first requests it finished (arrival order)."""
        self.num_requests = len(self.output_lens)
        self.prompt_tokens = sum(r.prompt_len for r in reqs[:self.num_requests])

    def summary(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("ttft_s", "latency_s", "tpot_s", "output_lens")}
        d.update(requests_per_s=self.requests_per_s, output_tok_s=self.output_tok_s, total_tok_s=self.total_tok_s,
                 mean_ttft_s=mean(self.ttft_s), mean_latency_s=mean(self.latency_s), mean_tpot_s=mean(self.tpot_s))
        return d


def mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def percentile(xs, p: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def run_engine(llm, reqs: list[BenchRequest], system: str = "pagedllm", ignore_eos: bool = True,
               desc: str | None = None, progress: bool = True, measure_memory: bool = False) -> RunResult:
    """Submit every request at t0 and step the engine to completion (continuous batching as configured).

    Returns timings from each request's metrics plus the peak KV blocks in use.
    """
    from pagedllm.protocol import SamplingParams

    eng = llm.engine
    stats0 = (eng.stats.prompt_tokens_computed, eng.stats.prompt_tokens_cached, eng.stats.num_steps,
              eng.stats.num_preemptions, eng.stats.generation_tokens)
    mem = PeakRSS() if measure_memory else None
    if mem:
        mem.__enter__()
    t0 = time.monotonic()
    handles = [eng.add_request(r.prompt_ids, SamplingParams(max_tokens=r.max_tokens, ignore_eos=ignore_eos,
                                                            temperature=0.0)) for r in reqs]
    bar = tqdm(total=len(reqs), desc=desc or system, unit="req", disable=not progress, dynamic_ncols=True,
               leave=False)
    peak_used, done, finals = 0, 0, {}
    timeline = [(0.0, 0)]  # (seconds since t0, output tokens so far) after every step
    try:
        while eng.has_unfinished():
            finals.update((o.request_id, o) for o in eng.step() if o.finished)
            timeline.append((time.monotonic() - t0, eng.stats.generation_tokens - stats0[4]))
            peak_used = max(peak_used, eng.kv.stats()["used"])
            n = len(finals)
            if n > done or eng.stats.num_steps % 16 == 0:
                bar.set_postfix_str(f"{(eng.stats.generation_tokens - stats0[4]) / (time.monotonic() - t0):.1f} "
                                    "out tok/s")
                bar.update(n - done)
                done = n
    finally:
        bar.close()
    elapsed = time.monotonic() - t0
    if mem:
        mem.__exit__(None, None, None)
    outs = [finals[h] for h in handles]
    res = RunResult(system, elapsed, len(reqs), sum(r.prompt_len for r in reqs), 0)
    for o in outs:
        m = o.metrics
        n = len(o.outputs[0].token_ids)
        res.output_tokens += n
        res.output_lens.append(n)
        res.ttft_s.append(m.first_token_time - m.arrival_time if m.first_token_time else None)
        res.latency_s.append(m.finished_time - m.arrival_time if m.finished_time else None)
        res.tpot_s.append(m.time_per_output_token(n))
    from pagedllm.kv.kv_cache import KVCache

    cfg, kv_cache = eng.forward_pass.model.config, eng.forward_pass.kv_cache
    bpb = KVCache.bytes_per_block(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, eng.kv.block_size, kv_cache.dtype)
    res.peak_mb = mem.peak_mb if mem else None
    res.extra = {
        "peak_kv_blocks": peak_used,
        "peak_kv_mb": peak_used * bpb / 2**20,
        "prompt_tokens_computed": eng.stats.prompt_tokens_computed - stats0[0],
        "prompt_tokens_cached": eng.stats.prompt_tokens_cached - stats0[1],
        "num_steps": eng.stats.num_steps - stats0[2],
        "num_preemptions": eng.stats.num_preemptions - stats0[3],
        "outputs": outs,
        "timeline": timeline,
    }
    return res


def tokens_by(timeline: list[tuple[float, int]], t: float) -> float:
    """Output tokens a run had made ``t`` seconds after its start (linear between steps), from
    ``run_engine``'s ``extra["timeline"]``: compares us with a baseline stopped at a time budget."""
    prev_t, prev_n = 0.0, 0
    for ti, n in timeline:
        if ti >= t:
            return prev_n + (n - prev_n) * (t - prev_t) / (ti - prev_t) if ti > prev_t else float(n)
        prev_t, prev_n = ti, n
    return float(prev_n)


def strip_outputs(d: dict) -> dict:
    """RunResult.summary() without the RequestOutput objects (for JSON)."""
    d = dict(d)
    extra = dict(d.get("extra") or {})
    extra.pop("outputs", None)
    extra.pop("timeline", None)
    d["extra"] = extra
    return d


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or b != b:
        return None
    return a / b
