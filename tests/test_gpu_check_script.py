"""The GPU check's tooling on the CPU: scripts/gpu_check.sh's dry run (every part, tiny and quick, ending in its
summary table), the oracle's verdicts, and the random-weight model shapes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from pagedllm.bench import gpu_models, gpu_oracle

ROOT = Path(__file__).resolve().parents[1]
PARTS = ["setup", "models", "tests", "oracle", "oracle_1b", "server", "bench"]


def test_the_dry_run_runs_every_part_and_ends_with_the_summary(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PAGEDLLM_WHEELS": str(tmp_path / "no-wheels"),
           "PAGEDLLM_GPU_WORK": str(tmp_path / "work")}
    env.pop("PAGEDLLM_TEST_MODEL_DIR", None)
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    lines = run.stdout.strip().splitlines()
    table = lines[-len(PARTS):]
    assert [row.split()[0] for row in table] == PARTS, run.stdout
    status = {row.split()[0]: row.split()[1] for row in table}
    assert status == {**dict.fromkeys(PARTS, "PASS"), "bench": "SKIP"}, run.stdout + run.stderr
    assert run.returncode == 0
    assert "oracle: 2/2 rows pass on cpu" in (out / "oracle.log").read_text()
    assert "completions, chat, json_schema, streaming answered" in (out / "server.log").read_text()
    assert (out / "summary.txt").read_text().strip().splitlines()[-len(PARTS):] == table


@pytest.mark.parametrize("dtype, kv, share, want", [
    ("float32", "auto", 1.0, "exact"), ("float32", "float32", 0.99, "FAIL"), ("float32", "int8", 0.95, "close"),
    ("bfloat16", "auto", 0.9, "close"), ("float16", "fp8_e5m2", 0.5, "FAIL")])
def test_oracle_verdicts_follow_the_stated_tolerances(dtype, kv, share, want):
    assert gpu_oracle.verdict(dtype, kv, share) == want


def test_agreement_counts_tokens_before_each_first_divergence():
    share, first = gpu_oracle.agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8]])
    assert (share, first) == (6 / 8, 2)


def test_unknown_model_shape_is_named():
    with pytest.raises(ValueError, match="unknown shape 'llama-70b'"):
        gpu_models.make_model("llama-70b", "unused", "unused")


def test_a_near_tie_of_hf_excuses_a_divergence_and_a_clear_choice_does_not(tiny_model_dir):
    """The oracle's tie rule on a real model: HF's own top token is never a near-tie's loser, its bottom token
    always loses clearly; a prompt excused by a tie counts whole."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    context = [5, 17, 300, 42, 9]
    with torch.inference_mode():
        logits = hf(torch.tensor([context])).logits[0, -1]
    assert gpu_oracle.hf_gap(hf, context, int(logits.argmax())) == 0.0  # a tie (gap <= TIE) with itself
    assert gpu_oracle.hf_gap(hf, context, int(logits.argmin())) > gpu_oracle.TIE
    # the gap a FAIL row reports: HF's top logit minus the token's, over the largest |logit|
    want = float(logits.max() - logits.min()) / float(logits.abs().max())
    assert gpu_oracle.hf_gap(hf, context, int(logits.argmin())) == pytest.approx(want)
    share, first = gpu_oracle.agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[9, 2, 3, 4], [5, 6, 7, 8]], tied={0})
    assert (share, first) == (1.0, 0)
