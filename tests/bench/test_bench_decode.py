"""Smoke test of `pagedllm bench decode` (structure, not timings)."""

from __future__ import annotations

import json

import pytest

from pagedllm.bench.cli import main


@pytest.mark.slow
def test_decode_bench_writes_table_json_plot(tmp_path, capsys):
    assert main(["decode", "--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "decode.json").read_text())
    ms = data["result"]["ms"]
    assert "HF generate" in ms and "reference" in ms
    assert all(len(v) == len(data["result"]["batch_sizes"]) and all(x > 0 for x in v) for v in ms.values())
    assert (tmp_path / "decode.png").stat().st_size > 1000
    assert "HF / best backend" in capsys.readouterr().out
