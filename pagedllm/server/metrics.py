"""Prometheus metrics on a registry of the app's own (two apps in one process never clash).

Engine state (gauges and the engine's own counters) is read from ``AsyncEngine.stats()`` at
scrape time, so it is exact and costs nothing between scrapes; latencies are observed by the
server as requests stream.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagedllm.protocol.outputs import RequestOutput
from pagedllm.server.tier_metrics import TierCollector
from pagedllm.server.vllm_metrics import VLLMMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (name, kind, documentation, value from a pool_stats() snapshot)
_ENGINE_METRICS = [
    ("pagedllm_num_requests_running", "gauge", "Sequences being computed (prefill or decode).", lambda s: s["running"]),
    ("pagedllm_num_requests_waiting", "gauge", "Requests queued for admission.", lambda s: s["waiting"]),
    ("pagedllm_num_requests_swapped", "gauge", "Requests swapped out to the host tier.", lambda s: s["swapped"]),
    ("pagedllm_kv_blocks_total", "gauge", "KV blocks in the device pool.", lambda s: s["num_blocks"]),
    ("pagedllm_spec_acceptance_rate", "gauge", "Speculative decoding: drafts kept / drafts proposed (0 when off).",
     lambda s: s.get("spec_acceptance_rate", 0.0)),
    ("pagedllm_spec_mean_accepted_length", "gauge",
     "Speculative decoding: tokens a drafted sequence gains per step (0 when off).",
     lambda s: s.get("spec_mean_accepted_length", 0.0)),
    ("pagedllm_kv_capacity_tokens", "gauge", "Tokens the KV pool holds (its dtype: kv_cache_dtype).",
     lambda s: s["kv_capacity_tokens"]),
    ("pagedllm_kv_bytes_per_token", "gauge", "KV bytes per token across layers, quantization scales included.",
     lambda s: s["kv_bytes_per_token"]),
    ("pagedllm_kv_blocks_used", "gauge", "KV blocks referenced by at least one sequence.", lambda s: s["used"]),
    ("pagedllm_kv_blocks_free", "gauge", "KV blocks an allocation can take (unused, cached or not).",
     lambda s: s["free"] + s["cached_free"]),
    ("pagedllm_kv_blocks_cached", "gauge", "KV blocks holding a prefix-cache entry (used or not).",
     lambda s: s["num_cached"]),
    ("pagedllm_kv_cache_usage_percent", "gauge", "Used KV blocks as a percentage of the pool.",
     lambda s: 100.0 * s["usage"]),
    ("pagedllm_prefix_cache_queries", "counter", "Prefix-cache lookups (one per admitted sequence).",
     lambda s: s["queries"]),
    ("pagedllm_prefix_cache_hits", "counter", "Prefix-cache lookups that reused at least one block.",
     lambda s: s["hits"]),
    ("pagedllm_prefix_cache_query_tokens", "counter", "Prompt tokens looked up in the prefix cache.",
     lambda s: s["query_tokens"]),
    ("pagedllm_prefix_cache_hit_tokens", "counter", "Prompt tokens served from the prefix cache.",
     lambda s: s["hit_tokens"]),
    ("pagedllm_num_preemptions", "counter", "Sequences preempted to free KV blocks.", lambda s: s["num_preemptions"]),
    ("pagedllm_prompt_tokens", "counter", "Prompt tokens computed (prefix-cache hits excluded).",
     lambda s: s["prompt_tokens_computed"]),
    ("pagedllm_prompt_tokens_cached", "counter", "Prompt tokens read from the prefix cache.",
     lambda s: s["prompt_tokens_cached"]),
    ("pagedllm_generation_tokens", "counter", "Tokens generated.", lambda s: s["generation_tokens"]),
    ("pagedllm_engine_steps", "counter", "Engine steps run.", lambda s: s["num_steps"]),
]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                    80.0, 160.0)


class _EngineCollector:
    """Yields the engine metrics from the snapshot taken by the scrape that is running."""

    def __init__(self) -> None:
        self.snapshot: dict | None = None

    def collect(self) -> Iterator[Metric]:
        if self.snapshot is None:
            return
        for name, kind, doc, value in _ENGINE_METRICS:
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield family(name, doc, value=float(value(self.snapshot)))


class ServerMetrics:
    def __init__(self, model_name: str = "") -> None:
        disable_created_metrics()  # process-wide: the *_created series only double the scrape
        self.registry = CollectorRegistry()
        self._engine = _EngineCollector()
        self.registry.register(self._engine)
        self.ttft = Histogram("pagedllm_time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.inter_token = Histogram("pagedllm_inter_token_latency_seconds",
                                     "Time between consecutive outputs of a request (one engine step each).",
                                     buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("pagedllm_e2e_request_latency_seconds", "Arrival to the request's last token.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.finished = Counter("pagedllm_request_success", "Engine requests finished, by the first choice's reason.",
                                ["finished_reason"], registry=self.registry)
        self.aborted = Counter("pagedllm_request_aborted",
                               "Engine requests dropped unfinished (client went away, or the engine failed).",
                               registry=self.registry)
        self.vllm = VLLMMetrics(self.registry, model_name)
        self.tiers = TierCollector()  # issue 31: KV tiers
        self.registry.register(self.tiers)

    def observe_inter_token(self, seconds: float) -> None:
        self.inter_token.observe(seconds)
        self.vllm.inter_token.observe(seconds)

    def observe_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        for ttft, e2e in ((self.ttft, self.e2e), (self.vllm.ttft, self.vllm.e2e)):  # ours and vLLM's names
            if m.ttft is not None:
                ttft.observe(m.ttft)
            if m.finished_time is not None:
                e2e.observe(m.finished_time - m.arrival_time)
        self.vllm.observe_finished(m)
        self.finished.labels(out.outputs[0].finish_reason or "unknown").inc()

    def render(self, snapshot: dict) -> bytes:
        """Prometheus text for this registry, with engine metrics from ``snapshot`` (pool_stats())."""
        self._engine.snapshot = snapshot
        self.vllm.snapshot = snapshot
        self.tiers.snapshot = snapshot
        return generate_latest(self.registry)
