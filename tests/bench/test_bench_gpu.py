"""CI smoke for issue 30's benches on the CPU: ``bench gpu --quick`` (a tiny random Llama; our engine, HF padded
``generate`` and ``generate_batch`` in the same run; the roofline from the measured copy bandwidth) and
``bench steptime --quick`` (a decode step's host time by part). Structure only, never timings."""

from __future__ import annotations

import json

import pytest


def _run(name: str, out, capsys) -> dict:
    from pagedllm.bench.cli import main

    assert main([name, "--quick", "--out", str(out)]) == 0
    assert "|" in capsys.readouterr().out
    for ext in ("md", "json", "png"):
        assert (out / f"{name}.{ext}").stat().st_size > 0
    return json.loads((out / f"{name}.json").read_text())["result"]


def test_bench_gpu_quick(tmp_path, capsys):
    r = _run("gpu", tmp_path, capsys)
    assert set(r["tok_s"]) == {"256 requests", "W1 x 1024"}
    for load in r["tok_s"].values():
        assert load["pagedllm"] > 0 and load["HF generate, padded 64"] > 0
        hf_cb = load["HF generate_batch"]
        assert (isinstance(hf_cb, float) and hf_cb > 0) or hf_cb.startswith(("failed", "this transformers"))
    assert r["decode_ms"] > 0 and r["copy_bandwidth_Bps"] > 0
    assert r["roofline_ms"] == pytest.approx(1000 * r["weight_bytes"] / r["copy_bandwidth_Bps"])


def test_bench_steptime_quick(tmp_path, capsys):
    r = _run("steptime", tmp_path, capsys)
    for col, ms in r["ms"].items():
        parts = sum(v for k, v in ms.items() if k not in ("step (total)", "other"))
        assert ms["forward (layers)"] > 0 and ms["sampler"] > 0, col
        assert parts + ms["other"] == pytest.approx(ms["step (total)"])
