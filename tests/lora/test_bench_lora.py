"""CI smoke of ``pagedllm bench lora --quick``: it runs, writes its md/json/png and every row has all three systems
(structure only, never timings)."""

from __future__ import annotations

import json


def test_bench_lora_quick(tmp_path, capsys):
    from pagedllm.bench.cli import main

    assert main(["lora", "--quick", "--out", str(tmp_path), "--adapters", "1,3", "--requests", "3",
                 "--hf-dtype", "bfloat16"]) == 0
    assert "| adapters |" in capsys.readouterr().out
    assert (tmp_path / "lora.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads((tmp_path / "lora.json").read_text())["result"]
    assert result["hf_dtype"] == "bfloat16"
    runs = result["runs"]
    assert [r["adapters"] for r in runs] == [1, 3]
    assert all(r["base_tok_s"] > 0 and r["lora_tok_s"] > 0 and r["hf_peft_tok_s"] > 0 for r in runs)
    # the LoRA engine's compute slots and adapter pages come out of the same KV budget as the base engine's
    assert all(0 < r["kv_blocks_lora"] < r["kv_blocks_base"] for r in runs)
