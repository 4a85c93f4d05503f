"""``pagedllm bench batch1`` runs every system it names (llama.cpp where installed) and leaves the engine's default
batch-1 paths switched on after comparing them with the old ones."""

import importlib.util
import json

from pagedllm.bench import cli
from pagedllm.models import decode_layer, quant


def test_batch1_quick(tmp_path, capsys):
    # a decode token is a difference of two timed runs: 16 of them keep it far above the runs' noise (2 did not:
    # llama.cpp came out at -1 ms/token once, under a loaded suite)
    assert cli.main(["batch1", "--quick", "--out", str(tmp_path), "--threads", "1", "--decode-tokens", "16"]) == 0
    rep = json.loads((tmp_path / "batch1.json").read_text())
    runs = rep["result"]["runs"]
    assert len(runs) == 7 + (importlib.util.find_spec("llama_cpp") is not None)
    assert all(len(v) == 1 and v[0][0] > 0 and v[0][1] > 0 for v in runs.values())
    assert quant.FACTORED_GEMV and decode_layer.FUSED and decode_layer.ONE_REGION
    assert "CPU ms/token" in capsys.readouterr().out
