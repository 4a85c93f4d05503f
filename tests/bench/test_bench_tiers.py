"""CI smoke for ``pagedllm bench tiers --quick`` (on the tiny model): files, table, and that every tier served."""

from __future__ import annotations

import json


def test_bench_tiers_quick(tiny_model_dir, tmp_path, capsys):
    from pagedllm.bench.cli import main

    out = tmp_path / "out"
    assert main(["tiers", "--quick", "--out", str(out), "--dtype", "float32", "--engine", f"model={tiny_model_dir}",
                 "--disk-dir", str(tmp_path / "disk")]) == 0
    assert "| config" in capsys.readouterr().out
    for ext in ("md", "json", "png"):
        assert (out / f"tiers.{ext}").stat().st_size > 0
    res = json.loads((out / "tiers.json").read_text())["result"]
    chat = {r["config"]: r for r in res["chat"]}
    rag = {r["config"]: r for r in res["rag"]}
    assert chat["tiers off"]["l2_hit_tokens"] == chat["tiers off"]["l3_hit_tokens"] == 0
    assert chat["L2"]["l2_hit_tokens"] > 0 and chat["L2"]["computed_tokens"] < chat["tiers off"]["computed_tokens"]
    assert chat["after restart (L2 + L3)"]["l3_hit_tokens"] > 0
    assert rag["after restart (L2 + L3)"]["l3_hit_tokens"] > 0
    assert set(res["summary"]) == {"chat_ttft_p50_speedup_l2", "chat_ttft_p50_speedup_l2_l3",
                                   "chat_restart_hit_fraction", "rag_reuse_vs_lru_hit_tokens",
                                   "promotion_ms_per_block_l2", "promotion_ms_per_block_l3", "compute_ms_per_block"}
    assert res["summary"]["promotion_ms_per_block_l2"] > 0 and res["summary"]["compute_ms_per_block"] > 0
