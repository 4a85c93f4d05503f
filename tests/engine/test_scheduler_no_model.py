"""The engine core with no model (vLLM's tests/v1/core style): a fake executor returns made-up tokens
and keeps a real persistent batch from the plain-data diffs, which must always equal the core's own
view (token ids and block tables). Chunked prefill, preemption by recompute and swap, prefix hits,
copy-on-write forks, token budgets and static batching."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config.args import EngineArgs
from pagedllm.core.engine_core import EngineCore
from pagedllm.protocol.core_io import EngineCoreRequest
from pagedllm.protocol.sampling_params import SamplingParams
from pagedllm.protocol.step_io import ModelRunnerOutput, SchedulerOutput, SeqOutput, decode, encode
from pagedllm.executor.base import Executor
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.worker import KVCacheSpec

VOCAB = 1000
BS = 16


class FakeExecutor(Executor):
    """Samples token ``(seq_id * 31 + position) % VOCAB`` (never eos), and checks after every step that
    the persistent batch it rebuilt from the diffs matches the core."""

    def __init__(self, num_blocks: int, num_host_blocks: int = 0, max_model_len: int = 512) -> None:
        self.spec = KVCacheSpec(num_blocks, num_host_blocks, BS, max_model_len, VOCAB, [VOCAB - 1], "fake", "none",
                                "float32", "float32", "none", "cpu",
                                {"dtype": "float32", "bytes_per_token": 0.0, "capacity_tokens": num_blocks * BS})
        self.batch = InputBatch(max_model_len, BS, VOCAB, torch.device("cpu"), initial_rows=2)
        self.steps: list[SchedulerOutput] = []
        self.core: EngineCore | None = None

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        so = decode(encode(so))  # everything crosses a process boundary in the mp executor
        self.steps.append(so)
        b = self.batch
        for parent, child, index in so.forks:
            b.fork(parent, child, index)
        for sid in so.finished_seq_ids:
            b.remove(sid)
        for new in so.new_seqs:
            b.add(new)
        outs = []
        for s in so.scheduled:
            row = b.apply(s)
            self._check_mirror(s.seq_id, row)
            pos = int(b.num_tokens[row])
            toks = [(s.seq_id * 31 + pos + j) % (VOCAB - 1) for j in range(s.num_samples)] if s.needs_logits else []
            out = SeqOutput(s.seq_id, toks, [-1.0] * len(toks))
            if s.beam_topk:
                raise AssertionError("no beam search here")
            outs.append(out)
        return ModelRunnerOutput(outs)

    def _check_mirror(self, seq_id: int, row: int) -> None:
        core = self.core
        seq = next(s for r in core.requests.values() for s in r.seqs if s.seq_id == seq_id)
        n = int(self.batch.num_tokens[row])
        assert self.batch.token_ids[row, :n].tolist() == seq.token_ids[:n] and n == seq.num_tokens
        nb = int(self.batch.num_blocks[row])
        assert self.batch.block_table[row, :nb].tolist() == core.kv.block_table(seq_id)


def make_core(num_blocks: int = 64, host: int = 0, **kw) -> tuple[EngineCore, FakeExecutor]:
    ex = FakeExecutor(num_blocks, host)
    args = EngineArgs(block_size=BS, check_integrity=True, **kw)
    core = EngineCore(args, executor=ex)
    ex.core = core
    return core, ex


def add(core: EngineCore, rid: str, prompt: list[int], **params) -> None:
    core.add_request(EngineCoreRequest(rid, prompt, SamplingParams(ignore_eos=True, **params)))


def run(core: EngineCore, max_steps: int = 500) -> dict[str, list[list[int]]]:
    """Step until idle; returns each request's output token ids per sample."""
    outs: dict[str, dict[int, list[int]]] = {}
    for _ in range(max_steps):
        if not core.has_unfinished():
            break
        for o in core.step():
            for d in o.seqs:
                outs.setdefault(o.request_id, {}).setdefault(d.index, []).extend(d.new_token_ids)
    assert not core.has_unfinished()
    core.check_integrity()
    assert core.kv.stats()["used"] == 0, "blocks leaked"
    return {r: [v[i] for i in sorted(v)] for r, v in outs.items()}


def test_chunked_prefill_and_budget():
    core, ex = make_core(max_num_batched_tokens=32)
    add(core, "a", list(range(100)), max_tokens=3)
    add(core, "b", list(range(200, 210)), max_tokens=3)
    out = run(core)
    assert all(so.num_tokens <= 32 for so in ex.steps)
    a_chunks = [(s.num_computed, s.num_tokens, s.needs_logits) for so in ex.steps for s in so.scheduled
                if s.seq_id == ex.steps[0].scheduled[0].seq_id]
    assert a_chunks[:4] == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]
    assert [len(v[0]) for v in out.values()] == [3, 3]
    # the prompt travels once; afterwards only the sampled token each step
    news = [n for so in ex.steps for n in so.new_seqs]
    assert len(news) == 2 and sorted(len(n.token_ids) for n in news) == [10, 100]
    decodes = [s for so in ex.steps for s in so.scheduled if s.num_computed >= 100]
    assert decodes and all(len(s.new_token_ids) == 1 for s in decodes)


def test_prefix_hit_skips_cached_blocks():
    core, ex = make_core()
    shared = list(range(40))
    add(core, "a", shared + [1], max_tokens=2)
    run(core)
    add(core, "b", shared + [2], max_tokens=2)
    run(core)
    first_b = ex.steps[-2].scheduled[0]
    # two full blocks from the cache, and 8 tokens of a's tail (shared[32:40] + [1] + its first output)
    assert first_b.num_computed == 40 and first_b.num_tokens == 1
    assert ex.steps[-2].new_seqs[0].token_ids == shared + [2]


def test_fork_for_parallel_samples_copies_the_partial_block():
    core, ex = make_core()
    add(core, "a", list(range(20)), max_tokens=4, n=3)
    out = run(core)
    assert len(out["a"]) == 3 and all(len(t) == 4 for t in out["a"])
    prefill = next(so for so in ex.steps if so.scheduled and so.scheduled[0].num_samples == 3)
    nxt = ex.steps[ex.steps.index(prefill) + 1]
    assert len(nxt.forks) == 2
    # three samples write into the shared partial block: two copy it (a one-entry table change each),
    # the last holder writes in place
    assert len(nxt.copies) == 2
    assert sorted(s.table_keep for s in nxt.scheduled) == [1, 1, 2]
    assert sum(len(s.new_block_ids) for s in nxt.scheduled) == 2


def test_preemption_by_recompute_resends_the_table():
    core, ex = make_core(num_blocks=8, max_num_batched_tokens=256)
    add(core, "a", list(range(40)), max_tokens=40)
    add(core, "b", list(range(100, 140)), max_tokens=40)
    out = run(core)
    assert core.scheduler.num_preemptions > 0
    assert all(len(v[0]) == 40 for v in out.values())
    resumed = [s for so in ex.steps for s in so.scheduled if s.table_keep == 0 and s.new_block_ids
               and not any(n.seq_id == s.seq_id for n in so.new_seqs)]
    # a preempted sequence comes back with a whole new table (re-hitting its own blocks in the prefix cache)
    assert resumed and all(s.num_computed % BS == 0 for s in resumed)


def test_preemption_by_swap_moves_blocks_out_and_back():
    core, ex = make_core(num_blocks=8, host=16, preemption_mode="swap", max_num_batched_tokens=256)
    add(core, "a", list(range(40)), max_tokens=40)
    add(core, "b", list(range(100, 140)), max_tokens=40)
    out = run(core)
    assert any(so.swap_out for so in ex.steps) and any(so.swap_in for so in ex.steps)
    assert all(len(v[0]) == 40 for v in out.values())


def test_static_batching_admits_only_when_idle():
    core, ex = make_core(batching="static", max_num_seqs=2)
    for i in range(3):
        add(core, f"r{i}", list(range(i * 50, i * 50 + 10)), max_tokens=5)
    run(core)
    admitted = [len(so.new_seqs) for so in ex.steps if so.new_seqs]
    assert admitted == [2, 1]


def test_abort_releases_blocks_and_the_worker_row():
    core, ex = make_core()
    add(core, "a", list(range(30)), max_tokens=50)
    core.step()
    core.step()
    sid = core.requests["a"].seqs[0].seq_id
    core.abort_request("a")
    assert core.kv.stats()["used"] == 0
    add(core, "b", list(range(5)), max_tokens=2)
    run(core)
    assert sid in ex.steps[2].finished_seq_ids and sid not in ex.batch.row_of


@pytest.mark.parametrize("n,max_tokens", [(16, 48), (4, 240), (4, 232)])
def test_admission_counts_copies_of_the_shared_partial_block(n, max_tokens):
    """Issue 24's crash: a 24-token prompt with n samples on a 64-block pool must either fit or be refused."""
    core, _ = make_core(num_blocks=64)
    prompt = list(range(24))
    need = core.limits.blocks_needed(len(prompt), SamplingParams(n=n, max_tokens=max_tokens))
    if need > 64:
        with pytest.raises(ValueError, match="KV blocks"):
            add(core, "a", prompt, n=n, max_tokens=max_tokens)
        return
    add(core, "a", prompt, n=n, max_tokens=max_tokens)
    out = run(core)
    assert len(out["a"]) == n


class PoisonExecutor(FakeExecutor):
    """Fails the whole step whenever request ``bad`` is new in it (``times`` times), or reports a sampling
    error for it alone (``per_seq``)."""

    def __init__(self, *a, times: int = 1, per_seq: bool = False, **kw) -> None:
        super().__init__(*a, **kw)
        self.times, self.per_seq = times, per_seq

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        bad = {s.seq_id for r, req in self.core.requests.items() if r == "bad" for s in req.seqs}
        if not self.per_seq and self.times and any(n.seq_id in bad for n in so.new_seqs):
            self.times -= 1
            self.batch.add(next(n for n in so.new_seqs if n.seq_id in bad))  # half-applied, as a real failure
            raise RuntimeError("poisoned step")
        out = super().execute(so)
        if self.per_seq:
            for o in out.outputs:
                if o.seq_id in bad and o.token_ids:
                    o.token_ids, o.logprobs, o.error = [], [], "sampling failed: poisoned"
        return out


def _poison_core(**kw) -> tuple[EngineCore, PoisonExecutor]:
    ex = PoisonExecutor(64, **kw)
    core = EngineCore(EngineArgs(block_size=BS, check_integrity=True), executor=ex)
    ex.core = core
    return core, ex


@pytest.mark.parametrize("per_seq", [False, True])
def test_one_bad_request_does_not_stop_the_others(per_seq):
    core, ex = _poison_core(per_seq=per_seq)
    add(core, "good1", list(range(30)), max_tokens=20)
    add(core, "good2", list(range(200, 210)), max_tokens=20, n=2)
    errors, outs = {}, {}
    for o in core.step() + core.step():  # both in flight (good2 forked) before the poison arrives
        for d in o.seqs:
            outs.setdefault(o.request_id, {}).setdefault(d.index, []).extend(d.new_token_ids)
    add(core, "bad", list(range(100, 140)), max_tokens=20)
    while core.has_unfinished():
        for o in core.step():
            if o.error:
                errors[o.request_id] = o.error
            for d in o.seqs:
                outs.setdefault(o.request_id, {}).setdefault(d.index, []).extend(d.new_token_ids)
    assert set(errors) == {"bad"} and "poisoned" in errors["bad"]
    assert all(len(v) == 20 for r in ("good1", "good2") for v in outs[r].values())
    assert len(outs["good2"]) == 2
    core.check_integrity()
    assert core.kv.stats()["used"] == 0


def test_a_step_that_fails_twice_is_fatal():
    core, _ = _poison_core(times=5)
    add(core, "bad", list(range(30)), max_tokens=5)
    core.step()  # the first failure aborts the new request
    add(core, "bad", list(range(30)), max_tokens=5)
    with pytest.raises(RuntimeError, match="twice"):
        core.step()
