"""Prometheus metrics of the KV tiers below the pool (host RAM, disk), labelled by tier, read from the
``pool_stats()`` snapshot of the scrape; nothing is exported when the engine has no tiers."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

TIERS = ("host", "disk")

# (name, kind, documentation, stats key with {tier} for the tier)
_PER_TIER = [
    ("pagedllm_kv_tier_promoted_blocks", "counter", "KV blocks promoted from the tier into the pool.",
     "{tier}_tier_promoted_blocks"),
    ("pagedllm_kv_tier_promoted_bytes", "counter", "KV bytes promoted from the tier into the pool.",
     "{tier}_tier_promoted_bytes"),
    ("pagedllm_kv_tier_demoted_blocks", "counter", "KV blocks the pool evicted that the tier stored.",
     "{tier}_tier_demoted_blocks"),
    ("pagedllm_kv_tier_demoted_bytes", "counter", "KV bytes the pool evicted that the tier stored.",
     "{tier}_tier_demoted_bytes"),
    ("pagedllm_kv_tier_prompt_hit_tokens", "counter",
     "Prompt tokens of scheduled requests read from blocks the tier promoted for them.", "prompt_tokens_cached_{tier}"),
]
_GAUGES = [
    ("pagedllm_kv_tier_host_blocks", "Blocks the host-RAM tier holds at most.", "host_tier_blocks"),
    ("pagedllm_kv_tier_host_blocks_used", "Blocks in the host-RAM tier now.", "host_tier_used"),
    ("pagedllm_kv_tier_disk_bytes", "Bytes the disk tier may use.", "disk_tier_bytes"),
    ("pagedllm_kv_tier_disk_bytes_used", "Bytes of the disk tier's files this engine knows.", "disk_tier_used_bytes"),
    ("pagedllm_kv_tier_disk_full", "1 while the disk is full (demotion to disk stopped).", "disk_tier_full"),
    ("pagedllm_kv_tier_promotion_seconds_mean", "Mean time from a tier hit to its blocks in the pool.",
     "promotion_seconds_mean"),
]
_COUNTERS = [
    ("pagedllm_kv_tier_corrupt_files", "Disk-tier files that failed verification (deleted, never served).",
     "disk_tier_corrupt"),
    ("pagedllm_kv_tier_promotions", "Runs of blocks promoted from the tiers.", "promotions"),
    ("pagedllm_kv_tier_query_tokens", "Prompt tokens past a pool miss looked up in the tiers.", "tier_query_tokens"),
    ("pagedllm_kv_tier_hit_tokens", "Of those, tokens found in a tier.", "tier_hit_tokens"),
]


class TierCollector:
    """Yields the tier metrics from the snapshot of the scrape that is running."""

    def __init__(self) -> None:
        self.snapshot: dict | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if s is None or "promotions" not in s:
            return
        for name, kind, doc, key in _PER_TIER:
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=["tier"])
            for tier in TIERS:
                family.add_metric([tier], float(s[key.format(tier=tier)]))
            yield family
        for name, doc, key in _GAUGES:
            if key in s:
                yield GaugeMetricFamily(name, doc, value=float(s[key]))
        for name, doc, key in _COUNTERS:
            if key in s:
                yield CounterMetricFamily(name, doc, value=float(s[key]))
