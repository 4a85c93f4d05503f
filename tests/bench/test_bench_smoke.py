"""CI smoke: every ``pagedllm bench <name> --quick`` runs on the embedded model and writes its md/json/png.

Checks the outputs' structure (files, keys, baselines ran or were skipped with a note), never timings.
All benches run in one process with engines reused per distinct config (loading weights dominates).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TINY = {
    "throughput": ["--dtype", "float32", "--requests", "3", "--max-prompt", "24", "--max-output", "6", "--min-output",
                   "2", "--batch-size", "2", "--decode-tokens", "6"],  # fp32: the int8-activation run needs it
    "sweep": ["--batch-sizes", "1,2", "--new-tokens", "4"],
    "waste": ["--max-tokens", "6", "--repeat", "1"],
    "latency": ["--max-tokens", "6", "--num-requests", "3", "--rate", "4", "--serve-time", "60"],
    "memory": [],
    "prefix": ["--requests", "3", "--system-tokens", "32", "--conversations", "2", "--turns", "2"],
    "context": ["--decode-tokens", "3", "--max-context", "48", "--hf-max-context", "48", "--mixed-step", "8",
                "--chat-turns", "32,48"],
    "alloc": [],
    "attention": [],
    "structured": ["--batch-sizes", "2", "--steps", "3"],
    "spec": ["--batches", "1", "--max-tokens", "12"],
}


@pytest.fixture(scope="module")
def outdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bench_out")


@pytest.fixture(scope="module", autouse=True)
def reuse_engines():
    from pagedllm.bench import common

    old = common.REUSE_ENGINES
    common.REUSE_ENGINES = True
    yield
    common.REUSE_ENGINES = old
    common._LLMS.clear()


def run_bench(name: str, outdir: Path, capsys) -> dict:
    from pagedllm.bench.cli import main

    rc = main([name, "--quick", "--out", str(outdir), *TINY[name]])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "|" in stdout and "---" in stdout, "a Markdown table goes to stdout"
    for ext in ("md", "json", "png"):
        p = outdir / f"{name}.{ext}"
        assert p.is_file() and p.stat().st_size > 0, p
    assert (outdir / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((outdir / f"{name}.json").read_text())
    for key in ("name", "title", "notes", "tables", "result", "environment"):
        assert key in data
    assert data["environment"]["dtype"]
    return data


def test_throughput(outdir, capsys):
    from pagedllm.bench.throughput import A8_NAME
    from pagedllm.models.quant import kernel_available

    d = run_bench("throughput", outdir, capsys)
    r = d["result"]
    systems = [x["system"] for x in r["runs"]]
    assert systems[0] == "pagedllm"
    assert any("DynamicCache" in s for s in systems) and any("StaticCache" in s for s in systems)
    named = systems + [s["system"] for s in r["skipped"]]
    for want in ("generate_batch", "llama.cpp", "vLLM"):
        assert any(want in s for s in named), f"{want} neither ran nor was skipped"
    for s in r["skipped"]:
        assert s["note"]
    for run in r["runs"]:
        assert run["output_tokens"] > 0 and run["elapsed_s"] > 0
    assert all(v is None or v > 0 for v in r["speedup"].values())
    b1 = r["decode_b1_tok_s"]
    assert b1["pagedllm"] > 0
    if kernel_available(int8_activations=True):  # the same engine with int8 activations (llama.cpp's arithmetic)
        assert b1[A8_NAME] > 0
    if any("llama.cpp" in s for s in systems):
        assert b1["llama_cpp"] > 0
    # the skipped baselines appear in the table with their note, and the roofline's ceiling as a row and a column,
    # then W1's floor at the cores' instruction peak (with the decode K/V reads), last
    rows = d["tables"][0]["rows"]
    peak = [row for row in rows if row[0].startswith("roofline: W1 floor at the cores' peak")]
    assert len(rows) == len(r["runs"]) + len(r["skipped"]) + 2 and len(peak) == 1
    ceiling = rows[-2]
    assert ceiling[0].startswith("roofline: W1 ceiling") and "W1 ceiling" in d["tables"][0]["columns"][-2]
    assert rows[0][-2] == pytest.approx(100 * r["runs"][0]["output_tok_s"] / ceiling[2])
    assert rows[-1] == peak[0] and peak[0][2] > 0 and peak[0][-2] == pytest.approx(100 * peak[0][2] / ceiling[2])
    assert r["roofline"]["requests_run"]  # the floors are of the requests this run sent, not W1's expected one


def test_throughput_leaves_partial_results_when_cut_short(tmp_path, capsys, monkeypatch):
    from pagedllm.bench import baselines
    from pagedllm.bench.cli import main

    def crash(*a, **k):
        raise RuntimeError("baseline crashed")

    monkeypatch.setattr(baselines, "hf_padded", crash)
    with pytest.raises(RuntimeError, match="baseline crashed"):
        main(["throughput", "--quick", "--out", str(tmp_path), *TINY["throughput"], "--baselines", "hf-dynamic,hf-cb"])
    data = json.loads((tmp_path / "throughput.json").read_text())
    assert [r["system"] for r in data["result"]["runs"]] == ["pagedllm"]
    assert data["result"]["pending"] == ["hf-dynamic", "hf-cb"]
    assert "PARTIAL" in (tmp_path / "throughput.md").read_text()


def test_throughput_runs_vllm_between_two_runs_of_ours(tmp_path, capsys, monkeypatch):
    """vLLM goes first among the baselines, our engine runs again right after it, and every speedup is
    against the mean of those two runs (a stand-in result here: vLLM itself is an optional install)."""
    from pagedllm.bench import baselines
    from pagedllm.bench.cli import main
    from pagedllm.bench.common import RunResult
    from pagedllm.bench.throughput import AGAIN

    asked = []

    def vllm_stand_in(reqs, dtype, b1):
        asked.append(b1)
        res = RunResult(baselines.VLLM_NAME, 2.0, len(reqs), 10, 8)
        res.extra = {"b1_tok_s": 12.5}  # its batch-1 decode rate on our batch-1 request, from the same process
        return res

    monkeypatch.setattr(baselines, "vllm_cpu", vllm_stand_in)
    main(["throughput", "--quick", "--out", str(tmp_path), *TINY["throughput"], "--baselines", "hf-dynamic,vllm"])
    capsys.readouterr()
    r = json.loads((tmp_path / "throughput.json").read_text())["result"]
    assert len(asked) == 1 and asked[0].max_tokens == r["decode_b1_tok_s"]["tokens"] and asked[0].prompt_len == 32
    assert r["decode_b1_tok_s"]["vllm"] == 12.5
    runs = {x["system"]: x for x in r["runs"]}
    assert [x["system"] for x in r["runs"]][:3] == ["pagedllm", baselines.VLLM_NAME, AGAIN]
    mean = (runs["pagedllm"]["output_tok_s"] + runs[AGAIN]["output_tok_s"]) / 2
    assert r["speedup"][baselines.VLLM_NAME] == pytest.approx(mean / 4.0)
    hf = runs["HF generate, DynamicCache, padded batches of 2"]
    assert r["speedup"][hf["system"]] == pytest.approx(mean / hf["output_tok_s"])  # the other baselines too
    assert AGAIN not in r["speedup"] or r["speedup"][AGAIN] is None
    assert runs[AGAIN]["extra"]["prompt_tokens_cached"] == runs["pagedllm"]["extra"]["prompt_tokens_cached"]


def test_throughput_a8_runs_the_workload_on_int8_activations_too(tmp_path, capsys):
    from pagedllm.bench.cli import main
    from pagedllm.bench.throughput import A8_NAME
    from pagedllm.models.quant import kernel_available

    if not kernel_available(int8_activations=True):
        pytest.skip("the int8 (AVX2) kernel could not be built on this machine")
    main(["throughput", "--quick", "--out", str(tmp_path), *TINY["throughput"], "--baselines", "none", "--a8"])
    capsys.readouterr()
    d = json.loads((tmp_path / "throughput.json").read_text())
    runs = d["result"]["runs"]
    assert [x["system"] for x in runs] == ["pagedllm", A8_NAME]
    assert runs[1]["output_tokens"] == runs[0]["output_tokens"] > 0  # the same workload, every token
    assert A8_NAME not in d["result"]["speedup"]
    assert "int8 activations" in d["tables"][0]["rows"][1][-1]


def test_throughput_exact_runs_fp32_beside_another_dtype(tmp_path, capsys):
    from pagedllm.bench.cli import main
    from pagedllm.bench.throughput import EXACT_NAME

    main(["throughput", "--quick", "--out", str(tmp_path), *TINY["throughput"], "--dtype", "bfloat16",
          "--baselines", "none", "--exact", "--no-roofline"])
    capsys.readouterr()
    d = json.loads((tmp_path / "throughput.json").read_text())
    runs = d["result"]["runs"]
    assert [x["system"] for x in runs] == ["pagedllm", EXACT_NAME]
    assert runs[1]["output_tokens"] == runs[0]["output_tokens"] > 0
    assert "exact fp32" in d["tables"][0]["rows"][1][-1]
    assert d["result"]["decode_b1_tok_s"][EXACT_NAME] > 0
    # already exact: nothing to run beside it
    main(["throughput", "--quick", "--out", str(tmp_path), *TINY["throughput"], "--baselines", "none", "--exact",
          "--no-roofline"])
    capsys.readouterr()
    d = json.loads((tmp_path / "throughput.json").read_text())
    assert [x["system"] for x in d["result"]["runs"]] == ["pagedllm"]


def test_padded_baseline_time_budget_stops_mid_batch():
    import torch

    from pagedllm.bench.baselines import hf_padded
    from pagedllm.bench.workloads import BenchRequest

    reqs = [BenchRequest([100 + i, 200, 300 + i], 3 + i % 2) for i in range(6)]
    full = hf_padded(reqs, torch.float32, batch_size=2, progress=False)
    assert (full.num_requests, full.output_tokens, full.prompt_tokens) == (6, 21, 18)
    assert full.extra["completed_batches"] == 3 and "stopped_mid_batch_at_s" not in full.extra
    # budget 0: generate stops every row after its first step, the first batch's prompts were prefilled
    res = hf_padded(reqs, torch.float32, batch_size=2, progress=False, budget_s=0.0)
    assert (res.num_requests, res.output_tokens, res.prompt_tokens) == (0, 2, 6)
    assert res.extra["completed_batches"] == 0 and res.extra["num_batches"] == 3
    assert 0 < res.extra["stopped_mid_batch_at_s"] <= res.elapsed_s


def test_tokens_by_interpolates_a_run_timeline():
    from pagedllm.bench.common import tokens_by

    tl = [(0.0, 0), (1.0, 10), (3.0, 30)]
    assert [tokens_by(tl, t) for t in (0.5, 1.0, 2.0, 5.0)] == [5.0, 10.0, 20.0, 30.0]


def test_generate_batch_time_budget_counts_tokens_streamed_so_far():
    import torch

    from pagedllm.bench.baselines import Skipped, hf_continuous
    from pagedllm.bench.workloads import BenchRequest

    reqs = [BenchRequest([100 + i, 200, 300 + i], 400) for i in range(2)]
    res = hf_continuous(reqs, torch.float32, progress=False, budget_s=3.0)
    assert not isinstance(res, Skipped), res.note  # the test set-up installs a transformers with generate_batch
    assert res.extra["cut_at_s"] >= 3.0 and res.num_requests == 0
    assert 0 < res.output_tokens < 800 and res.prompt_tokens == 6  # both prompts were prefilled


def test_sweep(outdir, capsys):
    r = run_bench("sweep", outdir, capsys)["result"]
    assert set(map(str, r["pagedllm"])) == {"1", "2"} and set(map(str, r["hf_dynamic"])) == {"1", "2"}
    for v in r["pagedllm"].values():
        for k in ("total_tok_s", "ms_per_tok", "ttft_ms", "peak_mb", "kv_mb"):
            assert k in v


def test_waste(outdir, capsys):
    d = run_bench("waste", outdir, capsys)
    r = d["result"]
    assert len(r["needed"]) == 4 and r["ran_for"] == max(r["needed"])
    assert all(0 <= w <= 100 for w in r["waste_pct"])
    assert len(r["hf_needed"]) == 4
    assert len(r["queue"]) == 3  # continuous, static, HF padded


def test_latency(outdir, capsys):
    r = run_bench("latency", outdir, capsys)["result"]
    demo = r["demo"]
    assert len(demo["static"]["latency_s"]) == 8 == len(demo["continuous"]["latency_s"])
    s = r["serving"]
    assert "skipped" not in s and s["completed"] >= 1, s  # the server starts and answers


def test_memory(outdir, capsys):
    r = run_bench("memory", outdir, capsys)["result"]
    assert r["pool_bytes_match"] is True
    for row in r["wall"]:
        assert row["static_gb"] >= row["paged_gb"] >= row["needed_gb"] > 0
    for d in r["overhead_pct"].values():
        assert set(map(str, d)) == {"8", "16", "32", "64", "128"}
        assert all(v >= 0 for v in d.values())


def test_prefix(outdir, capsys):
    r = run_bench("prefix", outdir, capsys)["result"]
    for key in ("shared", "chat"):
        assert len(r[key]) == 3
        off = r[key]["no prefix cache, fcfs"]
        on = r[key]["prefix cache, fcfs"]
        assert off["hit_rate"] == 0.0
        assert on["prompt_computed"] <= off["prompt_computed"]


def test_context(outdir, capsys):
    r = run_bench("context", outdir, capsys)["result"]
    assert r["single"] and r["mixed"]["pagedllm"] and r["chat"]
    assert "pagedllm" in r["slope_ms_per_1k"]


@pytest.mark.parametrize("name", ["alloc", "attention"])
def test_external(name, outdir, capsys):
    d = run_bench(name, outdir, capsys)
    assert d["result"]


def test_structured(outdir, capsys):
    r = run_bench("structured", outdir, capsys)["result"]
    assert r["batch_sizes"] == [2] and len(r["overhead"]) == 1
    assert r["ms"]["structured (mask + accept)"][0] > 0 and r["ms"]["decode step"][0] > 0


def test_spec(outdir, capsys):
    r = run_bench("spec", outdir, capsys)["result"]
    assert [x["workload"] for x in r["runs"]] == ["copy", "W1"]
    assert all(x["identical"] for x in r["runs"])  # greedy: speculation changes no token
    assert all(x["tok_s_on"] > 0 and x["tok_s_off"] > 0 for x in r["runs"])


def test_engine_overrides_take_each_fields_type():
    from pagedllm.bench.cli import _engine_overrides

    got = _engine_overrides(["block_size=64", "num-blocks=1e3", "kv_cache_fraction=0.2", "enforce_eager=true",
                             "kv_cache_dtype=int8", "async_scheduling=0"])
    assert got == {"block_size": 64, "num_blocks": 1000, "kv_cache_fraction": 0.2, "enforce_eager": True,
                   "kv_cache_dtype": "int8", "async_scheduling": False}
    with pytest.raises(SystemExit, match="unknown engine arg"):
        _engine_overrides(["blocksize=64"])
