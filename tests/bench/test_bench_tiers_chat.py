"""``pagedllm bench tiers --traces chat``: the per-user arrivals (think time after each answer) and the waves,
on the tiny model: the report's shape, the accounting per tier, the pool after every configuration, and the
schedule itself (each turn a think time after its answer; the same think times in every configuration)."""

from __future__ import annotations

import argparse
import json

import pytest


def _bench(tiny_model_dir, tmp_path, *extra: str) -> dict:
    from pagedllm.bench.cli import main

    out = tmp_path / "out"
    assert main(["tiers", "--quick", "--traces", "chat", "--out", str(out), "--dtype", "float32",
                 "--engine", f"model={tiny_model_dir}", "--disk-dir", str(tmp_path / "disk"), *extra]) == 0
    return json.loads((out / "tiers.json").read_text())["result"]


@pytest.mark.parametrize("arrivals", ["users", "waves"])
def test_chat_report_and_accounting(tiny_model_dir, tmp_path, arrivals):
    res = _bench(tiny_model_dir, tmp_path, "--arrivals", arrivals)
    rows = {r["config"]: r for r in res["chat"]}
    assert list(rows) == ["tiers off", "L2", "L2 + L3", "after restart (L2 + L3)"]
    conversations, turns = 8, 3  # --quick
    for name, r in rows.items():
        assert r["used_blocks_after"] == 0, name  # no block held once the trace is done (invariants checked too)
        assert r["l1_hit_tokens"] + r["l2_hit_tokens"] + r["l3_hit_tokens"] == r["hit_tokens"], name
        assert r["l2_hit_tokens"] + r["l3_hit_tokens"] <= r["hit_tokens"], name
        assert r["ttft_p50_s"] > 0 and r["ttft_p99_s"] >= r["ttft_p50_s"], name
        assert r["returning_hit_tokens"] <= r["returning_prompt_tokens"], name
        restarted = name.startswith("after restart")
        assert r["requests"] == conversations * (turns - 1 if restarted else turns), name
    if arrivals == "users":  # every prompt token is either read from a tier or the pool, or computed
        for name, r in rows.items():
            assert r["hit_tokens"] + r["computed_tokens"] == r["prompt_tokens"], name
    off, l2 = rows["tiers off"], rows["L2"]
    assert off["l2_hit_tokens"] == off["l3_hit_tokens"] == 0
    assert l2["l2_hit_tokens"] > 0 and l2["l3_hit_tokens"] == 0
    assert l2["computed_tokens"] < off["computed_tokens"]
    assert rows["after restart (L2 + L3)"]["l3_hit_tokens"] > 0
    assert set(res["summary"]) == {"chat_ttft_p50_speedup_l2", "chat_ttft_p50_speedup_l2_l3",
                                   "chat_restart_hit_fraction", "promotion_ms_per_block_l2",
                                   "promotion_ms_per_block_l3", "compute_ms_per_block"}


def test_users_send_each_turn_a_think_time_after_its_answer(tiny_model_dir):
    from pagedllm.bench.tiers_chat import run_users, think_times
    from pagedllm.bench.tiers_common import Sizes, engine

    args = argparse.Namespace(quick=True, arrivals="users", conversations=6, turns=3, users=2, think_time=0.02,
                              documents=None, rag_requests=None, engine_args={"model": tiny_model_dir},
                              dtype="float32", seed=0)
    s = Sizes(args)
    llm = engine(args, s, s.chat_l1, s.max_num_seqs)
    try:
        recs = run_users(llm, s, 0)["records"]
    finally:
        llm.engine.shutdown()
    think = think_times(s, 0)
    assert think == think_times(s, 0) and len({x for row in think for x in row}) == 6 * 3  # seeded, all drawn
    by = {(r["conversation"], r["turn"]): r for r in recs}
    assert sorted(by) == [(c, t) for c in range(6) for t in range(3)]
    for (c, t), r in by.items():
        assert r["ttft_s"] > 0 and r["finished_s"] > r["arrival_s"]
        if t > 0:  # the next question: its answer's finish plus the think time
            prev = by[(c, t - 1)]
            assert r["arrival_s"] == pytest.approx(prev["finished_s"] + think[c][t - 1])
            assert r["prompt_tokens"] == prev["prompt_tokens"] + prev["output_tokens"] + s.user_tokens
        elif c >= s.users:  # a user's next conversation: after its previous conversation's last answer
            prev = by[(c - s.users, s.turns - 1)]
            assert r["arrival_s"] == pytest.approx(prev["finished_s"] + think[c - s.users][s.turns - 1])
        else:  # users join evenly over one mean think time
            assert r["arrival_s"] == pytest.approx(c * s.think_time / s.users)
    # two users: never more than two conversations under way at once
    for r in recs:
        assert sum(o["arrival_s"] <= r["arrival_s"] < o["finished_s"] for o in recs) <= 2


def test_turn_sizes_from_the_command_line():
    from pagedllm.bench.tiers_chat import chat_trace
    from pagedllm.bench.tiers_common import Sizes

    args = argparse.Namespace(quick=False, arrivals="users", conversations=8, turns=3, users=None, think_time=None,
                              documents=None, rag_requests=None, system_tokens=100, context_tokens=200,
                              question_tokens=12, answer_tokens=20)
    s = Sizes(args)
    assert (s.system_tokens, s.context_tokens, s.user_tokens, s.out_tokens) == (100, 200, 12, 20)
    hist, questions = chat_trace(s, 0)
    assert [len(h) for h in hist] == [300] * 8 and {len(q) for qs in questions for q in qs} == {12}
    last_turn = 100 + 200 + 3 * 12 + 2 * 20  # the history the working set and the pool are sized by
    assert s.chat_working_set == 8 * -(-last_turn // 16)
    args.answer_tokens = 0
    with pytest.raises(SystemExit, match="--answer-tokens"):
        Sizes(args)
