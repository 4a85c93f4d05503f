"""``pagedllm bench serve --baselines vllm``: the CI smoke run (our server only: CI has no vLLM) and its report's
shape, the vLLM launch line and environment, the order of the servers across rounds, and the ratio table."""

from __future__ import annotations

import json

import pytest

from pagedllm.bench import serve_vllm
from pagedllm.bench.serve_vllm import OURS, VLLM


def test_quick_runs_our_server_at_both_rates_and_writes_the_report(tmp_path, capsys):
    from pagedllm.bench.cli import main

    assert main(["serve", "--baselines", "vllm", "--quick", "--num-requests", "3", "--out", str(tmp_path)]) == 0
    assert "| pagedllm serve |" in capsys.readouterr().out
    data = json.loads((tmp_path / "serve.json").read_text())
    assert (tmp_path / "serve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = data["result"]
    assert res["mode"] == "vllm" and res["rates"] == [2.0, 16.0] and res["rounds"] == 1
    assert [(r["system"], r["rate"]) for r in res["runs"]] == [(OURS, 2.0), (OURS, 16.0)]
    for r in res["runs"]:
        # every request streamed all its tokens (a short count is a failure), each timed
        assert (r["completed"], r["failed"]) == (3, 0), r["errors"]
        assert r["tok_s"] > 0 and 0 < r["all"]["ttft_p50"] <= r["all"]["ttft_p99"]
        assert r["all"]["itl_p50"] is not None
        # the server's TTFT is its queue + prefill; the client, which stamps before and after, sees more
        sp = r["split"]
        assert sp["queue"] >= 0 and sp["prefill"] > 0
        assert sp["queue"] + sp["prefill"] == pytest.approx(sp["ttft"], rel=1e-6)
        assert sp["before_core"] == pytest.approx(0, abs=1e-6)  # ours: queue starts at the arrival stamp
        assert sp["outside"] > 0 and sp["client"] == pytest.approx(sp["ttft"] + sp["outside"])
    assert set(res["mean"]) == {OURS} and res["ratios"] == {}
    assert any("vLLM not run: --quick" in n for n in data["notes"])
    assert [t["title"] for t in data["tables"]][0].startswith("Serving under Poisson load")
    assert any(t["title"].startswith("Where a first token's time goes") for t in data["tables"])
    # each load's floor at the cores' peak (a quick roofline, measured in the run) bounds what the server did
    for rate, r in zip(("2.0", "16.0"), res["runs"]):
        assert res["floors"][rate] > r["tok_s"]
        # CPU seconds: the server's HTTP process, its engine core process and this client all worked
        assert r["cpu"]["front_end"] > 0 and r["cpu"]["engine"] > 0 and r["cpu"]["client"] > 0
    titles = [t["title"] for t in data["tables"]]
    assert "Each load's bounds (out tok/s): no server beats either" in titles
    assert "CPU seconds while each rate is served (means)" in titles


def test_split_means_between_two_scrapes():
    from pagedllm.bench.serve_split import split

    before = {"ttft_sum": 1.0, "ttft_count": 2, "queue_sum": 0.25, "queue_count": 2}
    after = {"ttft_sum": 1.6, "ttft_count": 5, "queue_sum": 0.4, "queue_count": 5, "prefill_sum": 0.45,
             "prefill_count": 3}
    got = split(before, after, [0.25, 0.25, 0.28])
    assert got["ttft"] == pytest.approx(200) and got["queue"] == pytest.approx(50)
    assert got["prefill"] == pytest.approx(150) and got["client"] == pytest.approx(260)
    assert got["outside"] == pytest.approx(60) and got["before_core"] == pytest.approx(0)
    got = split({}, {"ttft_sum": 1.0, "ttft_count": 2, "queue_sum": 0.1, "queue_count": 2, "prefill_sum": 0.6,
                     "prefill_count": 2}, [0.6])
    assert got["before_core"] == pytest.approx(150)  # vLLM's wait before its core registers the request
    # nothing counted between the scrapes, or a server without the histogram: no figure, not a zero
    assert split(after, after, [0.2])["ttft"] is None and split({}, {}, [])["outside"] is None


def test_vllm_launch_line_and_environment(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/work/tree")
    cmd = serve_vllm.vllm_serve_command("/opt/venv/bin/python", "/models/smol", 8123, "float32", 2048, 5)
    assert cmd[:3] == ["/opt/venv/bin/vllm", "serve", "/models/smol"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags == {"--host": "127.0.0.1", "--port": "8123", "--dtype": "float32", "--max-model-len": "2048",
                     "--seed": "5", "--served-model-name": serve_vllm.SERVED_NAME, "--uvicorn-log-level": "warning"}
    env = serve_vllm.vllm_server_env("/opt/venv/bin/python", 2)
    assert "PYTHONPATH" not in env  # its venv must not import our checkout
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert len(env["VLLM_CPU_OMP_THREADS_BIND"].split(",")) <= 2


def test_our_server_runs_the_dtype_as_given_and_vllm_the_one_it_resolves_to(tmp_path, monkeypatch):
    """As in bench throughput: ``--dtype auto`` gives our server ``auto`` (what our engine picks for it) and vLLM
    the resolved dtype; the report names what ours computes in."""
    from pagedllm.bench.cli import build_parser
    from pagedllm.config.device import cpu_has_native_bf16

    launched = []
    monkeypatch.setattr(serve_vllm, "launch", lambda cmd, *a, **k: (launched.append(cmd), (None, "fake"))[1])
    args = build_parser().parse_args(["serve", "--baselines", "vllm", "--dtype", "auto", "--out", str(tmp_path)])
    args.engine_args = {}
    for system in (OURS, VLLM):
        assert serve_vllm.start(system, args, "bfloat16", "/opt/venv/bin/python")[:2] == (None, "fake")
    dtypes = [cmd[cmd.index("--dtype") + 1] for cmd in launched]
    assert dtypes == ["auto", "bfloat16"]
    assert serve_vllm.ours_format(args) == ("gguf-bf16" if cpu_has_native_bf16() else "gguf")
    args.dtype, args.engine_args = "float32", {"quantization": "none"}
    assert serve_vllm.ours_format(args) == "fp32"


def test_rounds_alternate_which_server_goes_first(tmp_path, monkeypatch):
    from pagedllm.bench import baselines
    from pagedllm.bench.cli import build_parser

    order = []

    def fake_round(system, args, cfg, dtype, vllm_py, loads, warm):
        order.append(system)
        assert len(loads) == len(cfg["rates"]) and all(len(reqs) == 2 for reqs, _ in loads)
        return [{"system": system, "skipped": "fake"}]

    monkeypatch.setattr(baselines, "vllm_python", lambda: "/opt/venv/bin/python")
    monkeypatch.setattr(serve_vllm, "serve_round", fake_round)
    args = build_parser().parse_args(["serve", "--baselines", "vllm", "--num-requests", "2", "--rounds", "3",
                                      "--no-roofline", "--out", str(tmp_path)])
    args.engine_args = {}
    rep = serve_vllm.run(args)
    assert order == [OURS, VLLM, VLLM, OURS, OURS, VLLM]
    assert sum("not run: fake" in n for n in rep.notes) == 6


def _run(system: str, rate: float, rnd: int, tok_s: float, ttft_p50: float) -> dict:
    return {"system": system, "rate": rate, "round": rnd, "load": 1.0, "completed": 4, "failed": 0, "errors": [],
            "tok_s": tok_s, "all": {"ttft_p50": ttft_p50, "ttft_p99": 2 * ttft_p50, "itl_p50": 10.0, "itl_p99": 30.0}}


def test_report_means_rounds_and_divides_ours_by_vllms():
    runs = [_run(OURS, 2.0, 0, 300.0, 100.0), _run(VLLM, 2.0, 0, 200.0, 200.0),
            _run(VLLM, 2.0, 1, 200.0, 100.0), _run(OURS, 2.0, 1, 340.0, 50.0),
            {"system": VLLM, "round": 2, "skipped": "server exited with code 1"}]
    cfg = {"num_requests": 4, "rates": [2.0], "rounds": 2, "prompt_len": (32, 512), "output_len": (16, 256),
           "ceilings": {"2.0": 250.0}}
    rep = serve_vllm.report(runs, cfg, "float32", None, "--dtype float32: gguf")
    assert rep.result["ratios"]["2.0"]["ceiling"] == 1.25  # no server could show more than 1.25x vLLM's 200
    assert any("2.0 req/s: 250.0" in n for n in rep.notes)
    assert rep.result["mean"][OURS]["2.0"]["tok_s"] == 320.0
    assert rep.result["mean"][VLLM]["2.0"]["completed"] == 8
    assert rep.result["ratios"]["2.0"]["tok_s"] == 1.6
    assert rep.result["ratios"]["2.0"]["ttft_p50"] == 0.5  # 75 ms vs 150 ms
    assert any("round 2: not run: server exited" in n for n in rep.notes)
    assert any("vLLM dtype float32, ours --dtype float32: gguf" in n for n in rep.notes)
    assert [t.title for t in rep.tables][1].startswith("pagedllm / vLLM")
    assert not any(t.title.startswith("Each load's bounds") for t in rep.tables)  # no roofline measured
    assert any("psutil is not installed" in n for n in rep.notes)  # these runs carry no CPU seconds


def test_report_sets_each_server_against_its_loads_floor_and_counts_cpu_seconds():
    cpu = {"front_end": 1.5, "engine": 40.0, "client": 1.0}
    runs = [{**_run(OURS, 16.0, 0, 350.0, 100.0), "cpu": cpu, "wall_s": 22.0},
            {**_run(VLLM, 16.0, 0, 280.0, 100.0), "cpu": {**cpu, "front_end": 3.0}, "wall_s": 26.0}]
    cfg = {"num_requests": 4, "rates": [16.0], "rounds": 1, "prompt_len": (32, 512), "output_len": (16, 256),
           "ceilings": {"16.0": 2000.0}, "floors": {"16.0": 560.0}}
    rep = serve_vllm.report(runs, cfg, "bfloat16", None, "--dtype auto: gguf-bf16")
    (bounds,) = [t for t in rep.tables if t.title.startswith("Each load's bounds")]
    assert bounds.rows == [["16.0", 2000.0, 560.0, 420.0, 0.75, 0.625, 0.5]]  # 1.5 x 280 = 420 = 75% of the floor
    (cpus,) = [t for t in rep.tables if t.title.startswith("CPU seconds")]
    assert cpus.rows == [["16.0", OURS, 1.5, 40.0, 1.0, 22.0], ["16.0", VLLM, 3.0, 40.0, 1.0, 26.0]]
    assert not any("psutil" in n for n in rep.notes)
    # the plot's bound: the lower of the arrival ceiling and the floor, none without a floor
    assert serve_vllm.load_bound(cfg, "16.0") == 560.0
    assert serve_vllm.load_bound({**cfg, "ceilings": {"16.0": 300.0}}, "16.0") == 300.0
    assert serve_vllm.load_bound({**cfg, "floors": {}}, "16.0") is None


def test_cpu_split_counts_the_server_apart_from_its_descendants():
    from pagedllm.bench.serve_procs import cpu_split

    before = {10: 1.0, 11: 5.0}
    after = {10: 2.5, 11: 9.0, 12: 0.5}  # 12: a worker started in between
    assert cpu_split(10, before, after) == {"front_end": 1.5, "engine": 4.5}


def test_arrival_ceiling_is_the_loads_tokens_over_its_last_arrival():
    from pagedllm.bench.workloads import BenchRequest

    reqs = [BenchRequest([1, 2], 100), BenchRequest([3], 50), BenchRequest([4], 150)]
    assert serve_vllm.arrival_ceiling(reqs, [0.0, 0.5, 2.0]) == 150.0  # 300 tokens, the last sent at 2 s
    assert serve_vllm.arrival_ceiling(reqs[:1], [0.0]) is None  # one request at once: no bound from arrivals
    from pagedllm.models.loader import load_tokenizer

    cfg = {"num_requests": 64, "rates": [2.0], "prompt_len": (8, 16), "output_len": (16, 256)}
    reqs, arrivals = serve_vllm.workload(load_tokenizer(), cfg, 0, seed=0)
    ceiling = serve_vllm.arrival_ceiling(reqs, arrivals)
    assert 20 < arrivals[-1] < 45 and ceiling == sum(r.max_tokens for r in reqs) / arrivals[-1]


def _sse(*chunks: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def _stream(handler, max_tokens: int, sampling: dict | None = None) -> dict:
    import asyncio

    import httpx

    from pagedllm.bench.serve_http import stream_one
    from pagedllm.bench.workloads import BenchRequest

    async def go() -> dict:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await stream_one(client, "http://srv/v1/completions", "m", BenchRequest([1, 2, 3], max_tokens, "x"),
                                    sampling)

    return asyncio.run(go())


def test_stream_one_times_text_chunks_and_counts_the_servers_tokens():
    import httpx

    sent = {}

    def handler(request: httpx.Request) -> httpx.Response:
        sent.update(json.loads(request.content))
        text = [{"choices": [{"text": t}]} for t in ("a", "", "b", "c")]
        return httpx.Response(200, content=_sse(*text, {"choices": [], "usage": {"completion_tokens": 3}}))

    r = _stream(handler, 3)
    assert sent["stream"] and sent["ignore_eos"] and sent["stream_options"] == {"include_usage": True}
    assert sent["prompt"] == [1, 2, 3] and sent["max_tokens"] == 3
    assert r["error"] is None and r["tokens"] == 3 and r["ttft"] >= 0
    assert len(r["itl"]) == 2  # three text chunks; the empty one is no token gap
    assert sent["temperature"] == 0.0 and "top_p" not in sent  # greedy by default
    sent.clear()
    assert _stream(handler, 3, serve_vllm.SAMPLING["chat"])["error"] is None
    assert {k: sent[k] for k in serve_vllm.SAMPLING["chat"]} == serve_vllm.SAMPLING["chat"] and sent["top_k"] == 50


def test_stream_one_reports_refusals_and_short_streams_as_failures():
    import httpx

    r = _stream(lambda req: httpx.Response(400, json={"error": {"message": "bad max_tokens"}}), 3)
    assert r["error"].startswith("HTTP 400") and "bad max_tokens" in r["error"]
    short = _sse({"choices": [{"text": "a"}]}, {"choices": [], "usage": {"completion_tokens": 1}})
    assert _stream(lambda req: httpx.Response(200, content=short), 3)["error"] == "1 of 3 tokens"


def test_bad_workload_flags_are_refused_by_name(tmp_path):
    import pytest

    from pagedllm.bench.cli import build_parser

    for flags, name in ((["--rates", "2,fast"], "--rates"), (["--rates", "0"], "--rates"),
                        (["--prompt-len", "512"], "--prompt-len"), (["--output-range", "64-16"], "--output-range")):
        args = build_parser().parse_args(["serve", "--baselines", "vllm", *flags])
        with pytest.raises(ValueError, match=name):
            serve_vllm.settings(args)
