"""The engine and latency metrics under vLLM's names (``vllm:*``, labelled with ``model_name``), so
dashboards and autoscalers written for vLLM read pagedllm unchanged."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagedllm.protocol.outputs import RequestMetrics

# name -> (kind, documentation); the values are computed by _values from a pool_stats() snapshot
_VLLM_ENGINE_METRICS = {
    "vllm:num_requests_running": ("gauge", "Number of requests in model execution batches."),
    "vllm:num_requests_waiting": ("gauge", "Number of requests waiting to be processed."),
    "vllm:kv_cache_usage_perc": ("gauge", "KV-cache usage. 1 means 100 percent usage."),
    "vllm:prefix_cache_queries": ("counter", "Prefix cache queries, in terms of number of queried tokens."),
    "vllm:prefix_cache_hits": ("counter", "Prefix cache hits, in terms of number of cached tokens."),
    "vllm:num_preemptions": ("counter", "Cumulative number of preemptions."),
    "vllm:external_prefix_cache_queries": ("counter", "External prefix cache queries from KV connector cross-instance "
                                           "cache sharing, in terms of number of queried tokens."),
    "vllm:external_prefix_cache_hits": ("counter", "External prefix cache hits from KV connector cross-instance "
                                        "cache sharing, in terms of number of cached tokens."),
    "vllm:prompt_tokens": ("counter", "Number of prefill tokens processed."),
    "vllm:generation_tokens": ("counter", "Number of generation tokens processed."),
}


def _values(s: dict) -> dict[str, float]:
    return {"vllm:num_requests_running": s["running"], "vllm:num_requests_waiting": s["waiting"],
            "vllm:kv_cache_usage_perc": s["usage"], "vllm:prefix_cache_queries": s["query_tokens"],
            "vllm:prefix_cache_hits": s["hit_tokens"], "vllm:num_preemptions": s["num_preemptions"],
            # the KV tiers below the pool are where vLLM's offloading connector reports its hits
            "vllm:external_prefix_cache_queries": s.get("tier_query_tokens", 0),
            "vllm:external_prefix_cache_hits": s.get("tier_hit_tokens", 0),
            "vllm:prompt_tokens": s["prompt_tokens_computed"] + s["prompt_tokens_cached"],
            "vllm:generation_tokens": s["generation_tokens"]}

_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
            80.0, 160.0, 640.0, 2560.0)


class VLLMMetrics:
    """Registers the ``vllm:*`` families on ``registry``; engine values come from the scrape's snapshot."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.model_name = model_name
        self.snapshot: dict | None = None
        registry.register(self)
        label = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              label, buckets=_BUCKETS, registry=registry).labels(model_name)
        self.inter_token = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                     label, buckets=_BUCKETS, registry=registry).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             label, buckets=_BUCKETS, registry=registry).labels(model_name)
        # issue 36: TTFT split as vLLM splits it (arrival -> first scheduled -> first token), read by bench serve
        self.queue = Histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.",
                               label, buckets=_BUCKETS, registry=registry).labels(model_name)
        self.prefill = Histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.",
                                 label, buckets=_BUCKETS, registry=registry).labels(model_name)

    def observe_finished(self, m: RequestMetrics) -> None:
        """A finished request's queue and prefill times (a request that never got scheduled has neither)."""
        if m.first_scheduled_time is None:
            return
        self.queue.observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is not None:
            self.prefill.observe(m.first_token_time - m.first_scheduled_time)

    def collect(self) -> Iterator[Metric]:
        if self.snapshot is None:
            return
        values = _values(self.snapshot)
        for name, (kind, doc) in _VLLM_ENGINE_METRICS.items():
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(values[name]))
            yield family
