"""scripts/soak.py in its short mode (CI): every kind of request in the mix runs against a real server
without one failure, and the run ends with RSS figures for both processes and a verdict."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_soak_short_mode(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "soak.py"), "--short", "--out", str(out)],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["requests"] == 400 and sum(result["mix"].values()) == 400
    assert set(result["mix"]) == {"chat", "completion", "n2", "logprobs", "json", "choice", "stream", "abort"}
    assert set(result["growth_second_half"]) == {"api_mb", "core_mb"} and result["verdict"] in ("pass", "fail")
    assert all(s["api_mb"] > 0 and s["core_mb"] > 0 for s in result["samples"])
