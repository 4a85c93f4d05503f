"""CI smoke for ``pagedllm bench tiers --quick --traces rag`` (on the tiny model): files, table, and that every
tier served (the chat trace: tests/bench/test_bench_tiers_chat.py)."""

from __future__ import annotations

import json


def test_bench_tiers_quick_rag(tiny_model_dir, tmp_path, capsys):
    from pagedllm.bench.cli import main

    out = tmp_path / "out"
    assert main(["tiers", "--quick", "--traces", "rag", "--out", str(out), "--dtype", "float32",
                 "--engine", f"model={tiny_model_dir}", "--disk-dir", str(tmp_path / "disk")]) == 0
    assert "| config" in capsys.readouterr().out
    for ext in ("md", "json", "png"):
        assert (out / f"tiers.{ext}").stat().st_size > 0
    res = json.loads((out / "tiers.json").read_text())["result"]
    assert res["chat"] == []
    rag = {r["config"]: r for r in res["rag"]}
    for name, r in rag.items():
        assert r["used_blocks_after"] == 0, name
        assert r["l1_hit_tokens"] + r["l2_hit_tokens"] + r["l3_hit_tokens"] == r["hit_tokens"], name
    assert rag["tiers off"]["l2_hit_tokens"] == rag["tiers off"]["l3_hit_tokens"] == 0
    assert rag["L2, reuse"]["l2_hit_tokens"] > 0
    assert rag["after restart (L2 + L3)"]["l3_hit_tokens"] > 0
    assert set(res["summary"]) == {"rag_reuse_vs_lru_hit_tokens"}
