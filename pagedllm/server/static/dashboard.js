// Live KV block-pool view: reads /v1/kv/stream (server-sent events over fetch, so an API key can
// be sent) and draws the grid, the charts and the request list. No libraries, no network beyond
// this server. window.kvDashboard exposes the latest snapshot and cell geometry for tools/tests.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const WINDOW_S = 60; // charts show the last minute
  const FREE = "#1f2733", CACHED = "#2f5d73", SHARED = "#ffffff", ACCENT = "#ffd166";
  const grid = $("grid"), tip = $("tip"), list = $("requests");
  const series = { usage: [], hit: [], toks: [] };
  const reqIndex = new Map(); // request id -> colour index, in order of first appearance
  let snap = null, selected = null, mouse = null, frame = 0;
  let layout = { n: 0, cols: 1, cell: 10, pitch: 12 };

  const reqColor = (rid, alpha = 1) => {
    if (rid == null || rid === "?") return `rgba(150,160,175,${alpha})`;
    if (!reqIndex.has(rid)) reqIndex.set(rid, reqIndex.size);
    return `hsla(${(reqIndex.get(rid) * 137.508 + 28) % 360},72%,60%,${alpha})`;
  };
  const pct = (x) => `${(100 * x).toFixed(1)}%`;
  const short = (rid) => (rid.length > 20 ? `${rid.slice(0, 13)}…${rid.slice(-4)}` : rid);

  // ---------------------------------------------------------------- stream
  const keyFromHash = new URLSearchParams(location.hash.slice(1)).get("key");
  if (keyFromHash) { sessionStorage.setItem("pagedllm-key", keyFromHash); history.replaceState(null, "", location.pathname); }

  function setConn(live, text) {
    $("conn").classList.toggle("live", live);
    $("conn").querySelector("span").textContent = text;
  }

  async function connect() {
    const key = sessionStorage.getItem("pagedllm-key");
    try {
      const res = await fetch("/v1/kv/stream", { cache: "no-store", headers: key ? { Authorization: `Bearer ${key}` } : {} });
      if (res.status === 401) { $("keyform").hidden = false; setConn(false, "API key needed"); return; }
      if (!res.ok) throw new Error(`HTTP ${res.status}`);
      setConn(true, "live");
      const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += value;
        for (let k; (k = buf.indexOf("\n\n")) >= 0; buf = buf.slice(k + 2)) {
          const data = buf.slice(0, k).split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5)).join("\n");
          if (data) update(JSON.parse(data));
        }
      }
    } catch (e) { console.warn("kv stream:", e); }
    setConn(false, "reconnecting");
    setTimeout(connect, 1000);
  }

  $("keyform").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem("pagedllm-key", $("key").value.trim());
    $("keyform").hidden = true;
    connect();
  });

  function update(s) {
    snap = s;
    for (const [name, v] of [["usage", s.usage], ["hit", s.hit_rate], ["toks", s.tok_s]]) {
      const arr = series[name];
      arr.push({ t: s.time, v });
      while (arr.length && arr[0].t < s.time - WINDOW_S) arr.shift();
    }
    if (!frame) frame = requestAnimationFrame(render);
  }

  // ---------------------------------------------------------------- summary
  function sharedStats(s) {
    if (s.blocks) {
      let n = 0, max = 0;
      for (const b of s.blocks) { if (b.ref_count > 1) n++; if (b.ref_count > max) max = b.ref_count; }
      return [n, max];
    }
    return [s.buckets.shared.reduce((a, b) => a + b, 0), Math.max(0, ...s.buckets.max_ref)];
  }

  function renderSummary(s) {
    const c = s.counts, [shared, maxRef] = sharedStats(s);
    $("model").textContent = s.model;
    $("n-total").textContent = c.total;
    $("n-used").textContent = c.used;
    $("n-shared").textContent = shared;
    $("n-maxref").textContent = maxRef;
    $("n-cached").textContent = c.cached_free;
    $("n-free").textContent = c.free;
    $("granularity").textContent = (s.blocks
      ? `${c.total} blocks × ${s.block_size} tokens`
      : `${c.total} blocks × ${s.block_size} tokens · one cell = ${s.buckets.size} blocks`) + kvPoolText(s.stats);
    $("v-usage").textContent = pct(s.usage);
    $("v-hit").textContent = pct(s.hit_rate);
    $("v-toks").textContent = s.tok_s.toFixed(1);
  }

  // The pool's element type and its real bytes per token (quantized caches: scales included).
  function kvPoolText(stats) {
    if (!stats || !stats.kv_dtype) return "";
    const perTok = stats.kv_bytes_per_token;
    const size = perTok >= 1024 ? `${(perTok / 1024).toFixed(1)} KiB` : `${Math.round(perTok)} B`;
    return ` · ${stats.kv_dtype} KV cache, ${size}/token, ${stats.kv_capacity_tokens.toLocaleString("en-US")} tokens`;
  }

  // ---------------------------------------------------------------- grid
  function computeLayout(n) {
    const width = grid.parentElement.clientWidth;
    const maxH = Math.max(240, window.innerHeight - grid.getBoundingClientRect().top - 48);
    let cell = 30, cols = 1;
    for (; cell > 3; cell--) {
      cols = Math.max(1, Math.floor((width + gap(cell)) / (cell + gap(cell))));
      if (Math.ceil(n / cols) * (cell + gap(cell)) <= maxH) break;
    }
    cols = Math.max(1, Math.floor((width + gap(cell)) / (cell + gap(cell))));
    return { n, cols, cell, pitch: cell + gap(cell), width };
  }
  function gap(cell) { return cell >= 10 ? 3 : 1; }

  function highlighted() {
    if (!selected || !snap) return null;
    const req = snap.requests.find((r) => r.request_id === selected);
    if (!req) return null;
    const size = snap.blocks ? 1 : snap.buckets.size;
    const set = new Set();
    for (const seq of req.seqs) for (const b of seq.block_table) set.add(Math.floor(b / size));
    return set;
  }

  function drawGrid() {
    const s = snap, n = s.blocks ? s.blocks.length : s.buckets.used.length;
    layout = computeLayout(n);
    const { cols, cell, pitch } = layout, dpr = window.devicePixelRatio || 1;
    const h = Math.ceil(n / cols) * pitch;
    if (grid.width !== Math.round(layout.width * dpr) || grid.height !== Math.round(h * dpr)) {
      grid.width = Math.round(layout.width * dpr);
      grid.height = Math.round(h * dpr);
      grid.style.height = `${h}px`;
    }
    grid.dataset.cols = cols;
    grid.dataset.pitch = pitch;
    const ctx = grid.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, layout.width, h);
    ctx.font = `600 ${Math.max(9, Math.min(12, cell * 0.42))}px system-ui, sans-serif`;
    ctx.textAlign = "center";
    ctx.textBaseline = "middle";
    const hl = highlighted();
    for (let i = 0; i < n; i++) {
      const x = (i % cols) * pitch, y = Math.floor(i / cols) * pitch;
      ctx.globalAlpha = hl && !hl.has(i) ? 0.25 : 1;
      if (s.blocks) drawBlock(ctx, s.blocks[i], x, y, cell);
      else drawBucket(ctx, s.buckets, i, x, y, cell);
      if (hl && hl.has(i)) {
        ctx.globalAlpha = 1;
        ctx.strokeStyle = ACCENT;
        ctx.lineWidth = 2;
        ctx.strokeRect(x + 1, y + 1, cell - 2, cell - 2);
      }
    }
    ctx.globalAlpha = 1;
  }

  function drawBlock(ctx, b, x, y, cell) {
    if (b.state === "free") { ctx.fillStyle = FREE; ctx.fillRect(x, y, cell, cell); return; }
    if (b.state === "cached") { ctx.fillStyle = CACHED; ctx.fillRect(x, y, cell, cell); return; }
    const owners = b.requests.length ? b.requests : ["?"];
    const w = cell / owners.length; // one stripe per owning request
    owners.forEach((rid, k) => { ctx.fillStyle = reqColor(rid); ctx.fillRect(x + k * w, y, Math.ceil(w), cell); });
    if (b.ref_count > 1) refBadge(ctx, b.ref_count, x, y, cell);
  }

  function refBadge(ctx, ref, x, y, cell) {
    ctx.strokeStyle = SHARED;
    ctx.lineWidth = cell >= 10 ? 2 : 1;
    ctx.strokeRect(x + ctx.lineWidth / 2, y + ctx.lineWidth / 2, cell - ctx.lineWidth, cell - ctx.lineWidth);
    if (cell < 16) return;
    const r = Math.min(cell * 0.3, 8);
    ctx.fillStyle = "#0b0e13";
    ctx.beginPath();
    ctx.arc(x + cell - r - 1, y + r + 1, r, 0, 2 * Math.PI);
    ctx.fill();
    ctx.fillStyle = SHARED;
    ctx.fillText(String(ref), x + cell - r - 1, y + r + 1.5);
  }

  function drawBucket(ctx, B, i, x, y, cell) {
    const total = B.free[i] + B.cached[i] + B.used[i];
    ctx.fillStyle = FREE;
    ctx.fillRect(x, y, cell, cell);
    const hu = (cell * B.used[i]) / total, hc = (cell * B.cached[i]) / total;
    ctx.fillStyle = CACHED;
    ctx.fillRect(x, y + cell - hu - hc, cell, hc);
    ctx.fillStyle = reqColor(B.request[i]);
    ctx.fillRect(x, y + cell - hu, cell, hu);
    if (B.shared[i]) refBadge(ctx, B.max_ref[i], x, y, cell);
  }

  function cellAt(px, py) {
    const { cols, cell, pitch, n } = layout;
    const col = Math.floor(px / pitch), row = Math.floor(py / pitch);
    if (col >= cols || px - col * pitch >= cell || py - row * pitch >= cell) return -1;
    const i = row * cols + col;
    return i < n ? i : -1;
  }

  function tipText(i) {
    const s = snap;
    if (s.blocks) {
      const b = s.blocks[i];
      const lines = [`block ${b.id} · ${b.state === "cached" ? "cached-free" : b.state === "used" ? "in use" : "free"}`,
        `refcount  ${b.ref_count}${b.ref_count > 1 ? " (shared)" : ""}`];
      const more = b.requests.length > 6 ? [`          … ${b.requests.length - 6} more`] : [];
      b.requests.slice(0, 6).forEach((rid, k) => lines.push(`${k ? "        " : "requests"}  ${short(rid)}`));
      if (b.owners.length) lines.push(...more, `seqs      ${b.owners.join(", ")}`);
      return lines.join("\n");
    }
    const B = s.buckets, lo = i * B.size, hi = Math.min(lo + B.size, s.num_blocks) - 1;
    return [`blocks ${lo}–${hi}`, `in use    ${B.used[i]}  (shared ${B.shared[i]}, max refcount ${B.max_ref[i]})`,
      `cached    ${B.cached[i]}`, `free      ${B.free[i]}`, `mostly    ${B.request[i] ? short(B.request[i]) : "—"}`].join("\n");
  }

  function renderTip() {
    const i = mouse ? cellAt(mouse.x, mouse.y) : -1;
    if (i < 0) { tip.hidden = true; return; }
    tip.textContent = tipText(i);
    tip.hidden = false;
    const wrap = grid.parentElement;
    const left = Math.min(mouse.x + 14, wrap.clientWidth - tip.offsetWidth - 4);
    const top = mouse.y + 16 + tip.offsetHeight > wrap.clientHeight ? mouse.y - tip.offsetHeight - 8 : mouse.y + 16;
    tip.style.left = `${Math.max(0, left)}px`;
    tip.style.top = `${Math.max(0, top)}px`;
  }

  grid.addEventListener("mousemove", (e) => {
    const r = grid.getBoundingClientRect();
    mouse = { x: e.clientX - r.left, y: e.clientY - r.top };
    if (snap) renderTip();
  });
  grid.addEventListener("mouseleave", () => { mouse = null; tip.hidden = true; });

  // ---------------------------------------------------------------- charts
  function niceMax(v) {
    const p = 10 ** Math.floor(Math.log10(v));
    return [1, 2, 5, 10].map((m) => m * p).find((m) => m >= v);
  }

  function drawChart(canvas, pts, max, color, fmt) {
    const dpr = window.devicePixelRatio || 1, w = canvas.clientWidth, h = canvas.clientHeight;
    if (canvas.width !== Math.round(w * dpr)) { canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr); }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    ctx.strokeStyle = "#263041";
    ctx.lineWidth = 1;
    const top = 16, bottom = h - 4; // labels sit above the plot area
    for (const f of [0, 0.5, 1]) {
      const y = Math.round(top + (bottom - top) * f) + 0.5;
      ctx.beginPath(); ctx.moveTo(0, y); ctx.lineTo(w, y); ctx.stroke();
    }
    ctx.fillStyle = "#8593a6";
    ctx.font = "10px system-ui, sans-serif";
    ctx.textAlign = "left";
    ctx.textBaseline = "top";
    ctx.fillText(fmt(max), 3, 2);
    if (!pts.length) return;
    // the x axis spans the data seen so far (at least 10 s), up to the last WINDOW_S seconds
    const now = pts[pts.length - 1].t, span = Math.min(WINDOW_S, Math.max(10, now - pts[0].t));
    ctx.textAlign = "right";
    ctx.fillText(`last ${Math.round(span)} s`, w - 3, 2);
    const X = (t) => w - ((now - t) / span) * w, Y = (v) => top + (bottom - top) * (1 - Math.min(v / max, 1));
    ctx.beginPath();
    pts.forEach((p, k) => (k ? ctx.lineTo(X(p.t), Y(p.v)) : ctx.moveTo(X(p.t), Y(p.v))));
    ctx.strokeStyle = color;
    ctx.lineWidth = 1.6;
    ctx.stroke();
    ctx.lineTo(X(now), bottom);
    ctx.lineTo(X(pts[0].t), bottom);
    ctx.closePath();
    ctx.globalAlpha = 0.18;
    ctx.fillStyle = color;
    ctx.fill();
    ctx.globalAlpha = 1;
  }

  function drawCharts() {
    const toksMax = niceMax(Math.max(1, ...series.toks.map((p) => p.v)));
    const usageMax = Math.min(1, niceMax(Math.max(0.05, ...series.usage.map((p) => p.v))));
    const pct0 = (v) => `${Math.round(100 * v)}%`;
    drawChart($("c-usage"), series.usage, usageMax, "#e09b3d", pct0);
    drawChart($("c-hit"), series.hit, 1, "#5ec28f", pct0);
    drawChart($("c-toks"), series.toks, toksMax, "#4fb3e8", (v) => `${v} tok/s`);
  }

  // ---------------------------------------------------------------- requests
  // One <li> per request, kept across updates (only changed ones are rewritten) so clicks land.
  const rows = new Map(), shown = new WeakMap(); // request id -> <li>; <li> -> its current html
  const esc = (t) => String(t).replace(/[&<>"]/g, (c) => `&#${c.charCodeAt(0)};`);

  const MAX_RUNS = 12;

  /** A block table as runs [first, last, shared] of consecutive ids with the same sharedness. */
  function runs(table, ref) {
    const out = [];
    for (const b of table) {
      const shared = ref(b) > 1, last = out[out.length - 1];
      if (last && b === last[1] + 1 && shared === last[2]) last[1] = b;
      else out.push([b, b, shared]);
    }
    return out;
  }

  function requestHtml(r, ref) {
    const seq = r.seqs[0];
    const tok = seq ? `${seq.num_computed}/${seq.num_tokens} tok` : "";
    const tables = r.seqs.map((q) => {
      const shown = runs(q.block_table, ref);
      const parts = shown.slice(0, MAX_RUNS).map(([lo, hi, shared]) => {
        const t = lo === hi ? `${lo}` : `${lo}–${hi}`;
        return shared ? `<b>${t}</b>` : t;
      });
      if (shown.length > MAX_RUNS) parts.push(`… ${shown.length - MAX_RUNS} more runs`);
      const label = r.seqs.length > 1 ? `seq ${q.seq_id}: ` : "";
      return `<div class="bt">${label}[${parts.join(" ")}] <span>${q.block_table.length} blocks</span></div>`;
    }).join("");
    return `<div class="top"><span class="rid" title="${esc(r.request_id)}">${esc(short(r.request_id))}</span>` +
      `<span class="st ${r.status}">${r.status}</span><span class="tok">${tok}</span></div>${tables}`;
  }

  function renderRequests(s) {
    const nr = s.num_requests;
    $("req-counts").textContent = `${nr.running} running · ${nr.waiting} waiting${nr.swapped ? ` · ${nr.swapped} swapped` : ""}`;
    const ref = s.blocks ? (b) => (s.blocks[b] ? s.blocks[b].ref_count : 0) : () => 0;
    const live = new Set(s.requests.map((r) => r.request_id));
    for (const [rid, li] of rows) if (!live.has(rid)) { li.remove(); rows.delete(rid); }
    for (const r of s.requests) {
      let li = rows.get(r.request_id);
      if (!li) {
        li = document.createElement("li");
        li.dataset.rid = r.request_id;
        li.style.borderLeftColor = reqColor(r.request_id);
        rows.set(r.request_id, li);
      }
      const html = requestHtml(r, ref);
      if (shown.get(li) !== html) { li.innerHTML = html; shown.set(li, html); }
      li.classList.toggle("sel", r.request_id === selected);
      list.appendChild(li); // keeps the snapshot's order
    }
    $("no-requests").hidden = s.requests.length > 0;
  }

  list.addEventListener("click", (e) => {
    const li = e.target.closest("li[data-rid]");
    if (!li) return;
    selected = selected === li.dataset.rid ? null : li.dataset.rid;
    if (!frame) frame = requestAnimationFrame(render);
  });

  // ---------------------------------------------------------------- KV tiers (issue 31)
  function mib(b) { return `${(b / 2 ** 20).toFixed(1)} MiB`; }

  // One row per tier below the pool: occupancy, blocks promoted (hits) and demoted, bytes moved.
  function renderTiers(s) {
    const st = s.stats || {}, panel = $("tiers");
    panel.hidden = st.promotions === undefined;
    if (panel.hidden) return;
    const rows = [["tier", "holds", "hits (blocks)", "promoted", "demoted"]];
    if (st.host_tier_blocks !== undefined)
      rows.push(["host RAM", `${st.host_tier_used} / ${st.host_tier_blocks} blocks`, st.host_tier_promoted_blocks,
                 mib(st.host_tier_promoted_bytes), mib(st.host_tier_demoted_bytes)]);
    if (st.disk_tier_bytes !== undefined)
      rows.push([st.disk_tier_full ? "disk (full)" : "disk", `${mib(st.disk_tier_used_bytes)} / ${mib(st.disk_tier_bytes)}`,
                 st.disk_tier_promoted_blocks, mib(st.disk_tier_promoted_bytes), mib(st.disk_tier_demoted_bytes)]);
    rows.push(["", `promotion ${(1000 * st.promotion_seconds_mean).toFixed(1)} ms mean`, "", "", ""]);
    $("tier-rows").innerHTML = rows.map((r, i) =>
      `<tr>${r.map((c) => (i ? `<td>${c}</td>` : `<th>${c}</th>`)).join("")}</tr>`).join("");
  }

  // ---------------------------------------------------------------- main
  function render() {
    frame = 0;
    if (!snap) return;
    renderSummary(snap);
    drawGrid();
    drawCharts();
    renderRequests(snap);
    renderTiers(snap);
    renderTip();
  }

  window.addEventListener("resize", () => { if (!frame) frame = requestAnimationFrame(render); });
  window.kvDashboard = {
    get snapshot() { return snap; },
    /** Centre of grid cell ``i`` (a block, or a bucket for large pools) in canvas CSS pixels. */
    cellCenter(i) {
      const { cols, pitch, cell } = layout;
      return { x: (i % cols) * pitch + cell / 2, y: Math.floor(i / cols) * pitch + cell / 2 };
    },
  };
  connect();
})();
