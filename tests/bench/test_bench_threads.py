"""``pagedllm bench threads``: each measurement is a fresh process with its spin count, the configurations alternate,
and every (machine, configuration) gets a row. Timings are never asserted."""

from __future__ import annotations

import json

import pytest

from pagedllm.bench import threads


def test_measure_runs_a_fresh_process_with_its_spin_count_beside_a_busy_one(tiny_model_dir):
    got = threads.measure("spin 100, fixed threads", True, "float32", {"model": tiny_model_dir}, 4)
    assert got["spin"] == "100" and got["tok_s"] > 0
    assert got["threads_at_end"] is None  # fixed: no governor


def test_run_alternates_the_configurations_and_reports_each(tmp_path, capsys, monkeypatch):
    from pagedllm.bench.cli import main

    calls = []

    def fake(config, contended, dtype, engine, tokens):
        calls.append((config, contended))
        return {"tok_s": 10.0 + len(calls), "threads_at_end": 1 if "adaptive" in config else None, "spin": "x"}

    monkeypatch.setattr(threads, "measure", fake)
    assert main(["threads", "--quick", "--rounds", "2", "--out", str(tmp_path)]) == 0
    names = list(threads.CONFIGS)
    n = len(names)
    assert [c for c, _ in calls[:n]] == names and [c for c, _ in calls[2 * n:3 * n]] == names[::-1]
    assert [k for _, k in calls[:2 * n]] == [False] * n + [True] * n
    r = json.loads((tmp_path / "threads.json").read_text())["result"]
    first = names.index("spin 1000, fixed threads")
    assert r["runs"]["quiet"]["spin 1000, fixed threads"] == [11.0 + first, 10.0 + 3 * n - first]
    rows = json.loads((tmp_path / "threads.json").read_text())["tables"][0]["rows"]
    assert len(rows) == len(threads.CONDITIONS) * len(threads.CONFIGS)
    assert "adaptive" in capsys.readouterr().out


def test_the_median_stands_beside_the_mean(tmp_path, monkeypatch):
    """One disturbed run moves the mean, not the median: both are in the table."""
    from pagedllm.bench.cli import main

    runs = iter([150.0, 100.0, 152.0] * 2 * len(threads.CONFIGS))
    monkeypatch.setattr(threads, "measure", lambda *a: {"tok_s": next(runs), "threads_at_end": None, "spin": "x"})
    monkeypatch.setattr(threads, "CONFIGS", {"only": threads.CONFIGS["spin 1000, fixed threads"]})
    assert main(["threads", "--quick", "--rounds", "3", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "threads.json").read_text())["tables"][0]["rows"]
    quiet = next(x for x in rows if x[0] == "quiet")
    assert quiet[1:6] == ["only", pytest.approx((150 + 152 + 100) / 3), 150.0, 100.0, 152.0]
