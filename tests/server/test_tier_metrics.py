"""The KV tiers seen from the server: /metrics per tier (ours and vLLM's names) and the dashboard snapshot."""

from __future__ import annotations

import httpx

from tests.server.conftest import live_server
from tests.server.test_dashboard import browser  # noqa: F401 - the headless Chromium fixture

PROMPTS = [[1000 + (i * 37 + j * 11) % 20000 for i in range(130)] for j in range(6)]


def _metrics(srv) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{srv.url}/metrics", headers={"Authorization": f"Bearer {srv.api_key}"}).text
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        name, value = line.rsplit(" ", 1)
        tier = name.split('tier="')[1].split('"')[0] if 'tier="' in name else ""
        out[name.split("{")[0], tier] = float(value)
    return out


def test_tier_metrics_snapshot_and_dashboard(tiny_model_dir, tmp_path, browser):  # noqa: F811
    # L2 holds 24 of the tiny model's 8 KiB blocks: the rest of the 48 the pool evicts go down to disk
    opts = {"model": tiny_model_dir, "num_blocks": 16, "kv_offload_memory": 24 << 13, "kv_disk_path": str(tmp_path)}
    with live_server(opts) as srv:
        auth = {"Authorization": f"Bearer {srv.api_key}"}
        for _ in range(2):  # the second round finds its prompts evicted from the pool, in the tiers
            for p in PROMPTS:
                r = httpx.post(f"{srv.url}/v1/completions", headers=auth, timeout=120,
                               json={"model": srv.engine.model_name, "prompt": p, "max_tokens": 2, "temperature": 0})
                assert r.status_code == 200, r.text
        m = _metrics(srv)
        assert m["pagedllm_kv_tier_promoted_blocks_total", "host"] + m["pagedllm_kv_tier_promoted_blocks_total", "disk"] >= 6 * 8
        assert m["pagedllm_kv_tier_demoted_bytes_total", "host"] > 0
        assert m["pagedllm_kv_tier_host_blocks_used", ""] > 0
        assert m["pagedllm_kv_tier_disk_bytes_used", ""] > 0 and m["pagedllm_kv_tier_disk_full", ""] == 0
        assert m["vllm:external_prefix_cache_hits_total", ""] >= 6 * 8 * 16
        assert m["vllm:external_prefix_cache_queries_total", ""] >= m["vllm:external_prefix_cache_hits_total", ""]
        tier_hits = [m["pagedllm_kv_tier_prompt_hit_tokens_total", t] for t in ("host", "disk")]
        assert sum(tier_hits) > 0  # the second round's prompts were read from the tiers...
        assert sum(tier_hits) <= m["pagedllm_prompt_tokens_cached_total", ""]  # ...and counted among the hits once
        for t, hit in zip(("host", "disk"), tier_hits):
            assert hit <= 16 * m["pagedllm_kv_tier_promoted_blocks_total", t]
        snap = httpx.get(f"{srv.url}/v1/kv/snapshot", headers=auth).json()
        assert snap["stats"]["host_tier_promoted_blocks"] == m["pagedllm_kv_tier_promoted_blocks_total", "host"]

        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import WebDriverWait

        browser.get(f"{srv.url}/dashboard#key={srv.api_key}")
        rows = lambda d: d.find_element(By.ID, "tier-rows").text
        WebDriverWait(browser, 60, poll_frequency=0.05).until(
            lambda d: d.find_element(By.ID, "tiers").is_displayed() and "host RAM" in rows(d))
        text = rows(browser)
        used, total = snap["stats"]["host_tier_used"], snap["stats"]["host_tier_blocks"]
        assert f"{used} / {total} blocks" in text and "disk" in text and "promotion" in text
