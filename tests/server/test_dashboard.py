"""The live KV dashboard: snapshot counts against the pool's integrity check (per block and in
buckets), and headless Chromium watching prefix-shared blocks while requests run.

The browser test uses Debian's ``chromium`` + ``chromium-driver`` and ``selenium`` (installed here
when missing); set PAGEDLLM_DASHBOARD_SCREENSHOT=docs/dashboard.png to refresh the README image.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Any

import httpx
import pytest

SYSTEM = (
    "You are the front-desk assistant of the Riverside public library. Answer questions about opening "
    "hours, borrowing limits, renewals, late fees, study-room bookings, the maker space, children's "
    "story time and the monthly book club. Be brief, polite and exact; if you do not know something, "
    "say so and suggest asking a librarian at the main desk. Opening hours: Monday to Friday 9 to 20, "
    "Saturday 10 to 17, closed on Sundays and public holidays. Members may borrow twelve items at once "
    "for three weeks and renew each item twice unless another member has reserved it. Late fees are "
    "twenty cents per item per day, capped at five euros per item. Study rooms seat four to eight "
    "people and can be booked up to two weeks ahead for at most three hours a day.\n\n"
)
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage"]


def _ask(server, i: int, max_tokens: int) -> None:
    r = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {server.api_key}"},
                   json={"prompt": f"{SYSTEM}Question {i}: can I renew a book that is {i} days late?",
                         "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}, timeout=300)
    r.raise_for_status()


def _start_requests(server, n: int, max_tokens: int) -> list[threading.Thread]:
    """``n`` concurrent completions sharing SYSTEM, each in its own thread."""
    threads = [threading.Thread(target=_ask, args=(server, i, max_tokens)) for i in range(1, n + 1)]
    for t in threads:
        t.start()
    return threads


def _integrity_counts(eng) -> dict[str, int]:
    """The counts ``KVCacheManager.check_integrity`` verifies, after it passed."""
    kv = eng.kv
    kv.check_integrity()
    return {"total": kv.num_blocks, "free": kv.pool.unhashed.size, "cached_free": kv.pool.cached.size,
            "used": sum(b.ref_count > 0 for b in kv.pool.blocks)}


def _one_moment_reads(core) -> tuple[dict[str, Any], dict[str, int]]:
    """The snapshot's raw copy and the integrity counts in one call on the core: no step between them."""
    from pagedllm.server.dashboard import _read

    return _read(core), _integrity_counts(core)


def _at_one_moment(engine) -> tuple[dict[str, Any], dict[str, Any], dict[str, int]]:
    """A per-block snapshot, a 16-bucket snapshot and the integrity counts of one moment."""
    import copy

    from pagedllm.server.dashboard import MAX_CELLS, _build

    raw, counts = asyncio.run(engine.call(_one_moment_reads))
    return _build(copy.deepcopy(raw), MAX_CELLS), _build(raw, 16), counts


def _check_snapshot(snap: dict[str, Any], buckets: dict[str, Any], counts: dict[str, int]) -> None:
    assert snap["counts"] == counts
    assert buckets["counts"] == counts
    blocks = snap["blocks"]
    assert [b["id"] for b in blocks] == list(range(counts["total"]))
    states = Counter(b["state"] for b in blocks)
    assert (states["free"], states["cached"], states["used"]) == (counts["free"], counts["cached_free"],
                                                                  counts["used"])
    tables = {q["seq_id"]: q["block_table"] for r in snap["requests"] for q in r["seqs"]}
    seq_request = {q["seq_id"]: r["request_id"] for r in snap["requests"] for q in r["seqs"]}
    for b in blocks:  # between steps every reference is a block-table entry
        assert b["ref_count"] == len(b["owners"]) == sum(t.count(b["id"]) for t in tables.values()), b
        assert (b["state"] == "used") == (b["ref_count"] > 0)
        assert "hash" not in b  # hashes are never shown
    # buckets aggregate the same moment
    bk, size = buckets["buckets"], buckets["buckets"]["size"]
    assert buckets["blocks"] is None and len(bk["used"]) <= 16 and size == -(-counts["total"] // 16)
    for i in range(len(bk["used"])):
        run = blocks[i * size:(i + 1) * size]
        assert bk["free"][i] == sum(b["state"] == "free" for b in run)
        assert bk["cached"][i] == sum(b["state"] == "cached" for b in run)
        assert bk["used"][i] == sum(b["state"] == "used" for b in run)
        assert bk["shared"][i] == sum(b["ref_count"] > 1 for b in run)
        assert bk["max_ref"][i] == max(b["ref_count"] for b in run)
        held = Counter(seq_request[s] for b in run for s in b["owners"])  # table entries per request
        if bk["request"][i] is None:
            assert not held
        else:
            assert held[bk["request"][i]] == max(held.values())


def test_snapshot_counts_equal_integrity_counts(server):
    """While requests sharing a system prompt run and after they finish, every snapshot's counts
    equal the integrity check's; per-block data and buckets agree with them."""
    _ask(server, 0, 1)  # caches SYSTEM's blocks
    threads = _start_requests(server, 4, 24)
    shared = 0
    while any(t.is_alive() for t in threads):
        snap, buckets, counts = _at_one_moment(server.engine)
        _check_snapshot(snap, buckets, counts)
        shared = max(shared, max(b["ref_count"] for b in snap["blocks"]))
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert shared >= 2, "no block was ever shared by the requests' common system prompt"
    snap, buckets, counts = _at_one_moment(server.engine)
    _check_snapshot(snap, buckets, counts)
    assert counts["used"] == 0 and counts["cached_free"] > 0 and snap["requests"] == []
    assert snap["hit_rate"] > 0

    auth = {"Authorization": f"Bearer {server.api_key}"}
    r = httpx.get(f"{server.url}/v1/kv/snapshot", headers=auth)
    assert r.status_code == 200 and r.json()["counts"] == counts  # idle: nothing changed since
    assert httpx.get(f"{server.url}/v1/kv/snapshot").status_code == 401
    with httpx.stream("GET", f"{server.url}/v1/kv/stream", headers=auth, timeout=10) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        first = next(line for line in s.iter_lines() if line.startswith("data: "))
    assert '"counts":' in first


def _browser_unavailable() -> str | None:
    """Install Debian's chromium + chromium-driver and selenium when missing; the reason they
    cannot be had, or None."""
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        if shutil.which("apt-get") is None or os.geteuid() != 0:
            return "chromium/chromedriver are not installed and apt-get is unavailable (needs root)"
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"]):
            r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
            if r.returncode:
                return f"`{' '.join(cmd)}` failed: {r.stderr[-400:]}"
    try:
        import selenium  # noqa: F401
    except ImportError:
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "selenium"], check=False, capture_output=True,
                           text=True)
        if r.returncode:
            return f"pip install selenium failed: {r.stderr[-400:]}"
    return None


@pytest.fixture
def browser():
    reason = _browser_unavailable()
    if reason:
        pytest.fail(f"headless Chromium unavailable (scripts/setup.sh installs it): {reason}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    profile = tempfile.mkdtemp(prefix="pagedllm-chromium-")
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={profile}"]:
        opts.add_argument(flag)
    driver = webdriver.Chrome(options=opts, service=Service(shutil.which("chromedriver")))
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": 1360, "height": 800, "deviceScaleFactor": 1, "mobile": False})
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def test_dashboard_in_chromium(server, browser, tmp_path):
    """The page shows shared blocks (refcount > 1, in the grid's hover card) while requests that
    share a system prompt run, and no used blocks once they finish; saves a screenshot."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def text(id_: str) -> str:
        return browser.find_element(By.ID, id_).text

    num_blocks = server.engine.limits.num_blocks
    browser.get(f"{server.url}/dashboard#key={server.api_key}")  # the page sends the key itself
    wait = WebDriverWait(browser, 60, poll_frequency=0.05)
    wait.until(lambda d: "live" in d.find_element(By.ID, "conn").get_attribute("class")
               and text("n-total") == str(num_blocks))

    pool = server.engine.spec.kv_pool  # the pool's dtype and real bytes per token are on the page
    assert f"{pool['dtype']} KV cache" in text("granularity")
    assert f"{pool['capacity_tokens']:,} tokens" in text("granularity")
    _ask(server, 0, 1)  # SYSTEM is in the prefix cache before the burst
    threads = _start_requests(server, 5, 64)
    try:
        wait.until(lambda d: text("n-maxref").isdigit() and int(text("n-maxref")) > 1
                   and text("req-counts").startswith("5 running"))
        block, center = browser.execute_script(
            "const s = window.kvDashboard.snapshot;"
            "const b = s.blocks.reduce((a, x) => (x.ref_count > a.ref_count ? x : a));"
            "return [b, window.kvDashboard.cellCenter(b.id)];")
        assert block["ref_count"] > 1 and len(block["owners"]) == block["ref_count"]
        grid = browser.find_element(By.ID, "grid")
        ActionChains(browser).move_to_element_with_offset(
            grid, int(center["x"] - grid.rect["width"] / 2), int(center["y"] - grid.rect["height"] / 2)).perform()
        wait.until(lambda d: f"block {block['id']} " in text("tip"))
        ref = int(re.search(r"refcount\s+(\d+)", text("tip")).group(1))
        assert ref > 1 and "(shared)" in text("tip")
        assert int(text("n-shared")) > 0 and int(text("n-used")) > 0
        shot = tmp_path / "dashboard.png"
        shot.write_bytes(browser.get_screenshot_as_png())
        assert shot.stat().st_size > 10_000

        rows = browser.find_elements(By.CSS_SELECTOR, "#requests li[data-rid]")
        assert rows, "no running request listed"
        rows[0].click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#requests li.sel"))
    finally:
        for t in threads:
            t.join()

    wait.until(lambda d: text("n-used") == "0" and d.find_element(By.ID, "no-requests").is_displayed()
               and not d.find_elements(By.CSS_SELECTOR, "#requests li"))
    assert int(text("n-cached")) > 0 and text("n-shared") == "0"
    if os.environ.get("PAGEDLLM_DASHBOARD_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["PAGEDLLM_DASHBOARD_SCREENSHOT"])
