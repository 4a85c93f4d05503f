"""Decode graphs (``pagedllm/worker/cuda_graphs.py``) on the CPU: no GPU here, so the capture is replaced by one
whose replay re-runs the captured step on the same buffers, as a CUDA graph replays its kernels on the same
addresses. A runner that forgot to copy a step's inputs into the buffers, padded rows that touched a
sequence's blocks, or graphs kept across a pool change would all show here. Real CUDA capture is not run."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention import get_backend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kv.kv_cache import KVCache
from pagedllm.models.forward_pass import ForwardPass
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.tiny import tiny_hf_model
from pagedllm.worker import cuda_graphs
from pagedllm.worker.cuda_graphs import DecodeGraphs, capture_sizes

BLOCK = 4


class RerunCapture:
    """Capture = run the step once; replay = run it again (reading only the buffers it was built over)."""

    def __init__(self) -> None:
        self.replays = 0

    def capture(self, step):
        step()

        def replay() -> None:
            self.replays += 1
            step()

        return replay


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    hf, cfg = tiny_hf_model("qwen2")
    m = LlamaForCausalLM(cfg)
    m.load_hf_state_dict(hf.state_dict())
    return m


def make_runner(model, num_blocks: int = 24) -> ForwardPass:
    cfg = model.config
    kv = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks, BLOCK)
    return ForwardPass(model, kv, get_backend("cpu"))


def prefill(runner: ForwardPass, prompts: list[list[int]], tables: list[list[int]]) -> None:
    lens = [len(p) for p in prompts]
    meta = AttentionMetadata.build(lens, lens, tables, BLOCK)
    runner.forward(torch.tensor(sum(prompts, [])), meta)


def decode_meta(seq_lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
    return AttentionMetadata.build([1] * len(seq_lens), seq_lens, tables, BLOCK)


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(10_000)[-1] == 512
    big = capture_sizes(512)
    assert big[:4] == [1, 2, 4, 8] and big[big.index(256) + 1] == 272 and len(big) == 3 + 32 + 16


def test_decode_steps_replay_the_eager_results_and_padding_writes_only_the_scratch_block(model):
    """Steps of 4, 3 (bucket 4: its padding row held the 4th sequence's step), 2 and 3 sequences give the eager
    hidden states bit for bit and leave the pool as eager steps do, apart from the scratch block. The 4th
    sequence finishes after the first step and its last block goes to the 3rd, whose next token lands in the
    slot the 4th wrote: a padding row left as it was would write there again."""
    tables = [[0, 1], [2, 3], [4, 5], [6, 7]]
    prompts = [[5, 9, 13, 2, 7], [11, 3], [4, 4, 8, 1, 6, 2, 9], [8, 6, 4, 2]]
    eager, graphed = make_runner(model), make_runner(model)
    for r in (eager, graphed):
        prefill(r, prompts, tables)
    capture = RerunCapture()
    scratch = graphed.kv_cache.num_blocks - 1
    graphs = DecodeGraphs(graphed, max_num_seqs=4, max_model_len=64, scratch_block=scratch, capture=capture)
    graphs.capture_all()
    assert graphs.num_captures == 3 and capture.replays == 0
    lens = [len(p) for p in prompts]
    steps = [([0, 1, 2, 3], [17, 23, 31, 37]), ([0, 1, 2], [40, 41, 42]), ([0, 2], [50, 51]), ([0, 1, 2], [3, 4, 5])]
    for step, (rows, ids) in enumerate(steps):
        if step == 1:
            tables[2].append(7)  # the 4th sequence's block: slot 28 held its token at position 4, now the 3rd's
        for i in rows:
            lens[i] += 1
        meta = decode_meta([lens[i] for i in rows], [tables[i] for i in rows])
        want = eager.forward(torch.tensor(ids), meta)
        got = graphs.forward(torch.tensor(ids), meta)
        assert torch.equal(got, want), step
    assert graphs.replays == {1: 0, 2: 1, 4: 3} and capture.replays == 4
    live = slice(0, scratch * BLOCK)
    assert torch.equal(graphed.kv_cache.data[..., live, :], eager.kv_cache.data[..., live, :])
    assert graphed.kv_cache.data[..., scratch * BLOCK, :].abs().sum() > 0  # padding went there
    graphs.invalidate()  # weights swapped in place: captured again on the next step
    lens[0] += 1
    graphs.forward(torch.tensor([9]), decode_meta([lens[0]], [tables[0] + [8]]))
    assert graphs.num_captures == 6


def test_mixed_steps_and_batches_above_the_largest_bucket_run_eagerly(model):
    runner = make_runner(model)
    prefill(runner, [[1, 2, 3]] * 3, [[0], [1], [2]])
    capture = RerunCapture()
    graphs = DecodeGraphs(runner, max_num_seqs=2, max_model_len=64, scratch_block=23, capture=capture)
    graphs.capture_all()
    mixed = AttentionMetadata.build([1, 2], [4, 5], [[0, 1], [1, 3]], BLOCK)
    assert not graphs.can_run(mixed)
    graphs.forward(torch.tensor([7, 8, 9]), mixed)
    three = decode_meta([4, 4, 4], [[0, 5], [1, 6], [2, 7]])
    assert not graphs.can_run(three)
    assert graphs.forward(torch.tensor([1, 2, 3]), three).shape[0] == 3
    assert capture.replays == 0 and not any(graphs.replays.values())


def test_a_new_pool_drops_the_graphs_and_captures_again(model):
    """Graphs hold the pool's addresses: after the runner gets another pool, a replay of the old graphs would
    write into the old one. The runner captures again and the step lands in the new pool."""
    runner = make_runner(model)
    prefill(runner, [[3, 1, 4, 1, 5]], [[0, 1]])
    capture = RerunCapture()
    graphs = DecodeGraphs(runner, max_num_seqs=1, max_model_len=64, scratch_block=23, capture=capture)
    graphs.capture_all()
    old = runner.kv_cache
    new = make_runner(model).kv_cache
    new.data.copy_(old.data)
    before = old.data.clone()
    runner.kv_cache = new
    meta = decode_meta([6], [[0, 1]])
    want = make_runner(model)
    want.kv_cache.data.copy_(before)
    assert torch.equal(graphs.forward(torch.tensor([9]), meta), want.forward(torch.tensor([9]), meta))
    assert graphs.num_captures == 2 and capture.replays == 1
    assert torch.equal(old.data, before) and torch.equal(new.data[..., :23 * BLOCK, :],
                                                         want.kv_cache.data[..., :23 * BLOCK, :])


def test_scratch_block_must_be_in_the_pool(model):
    with pytest.raises(ValueError, match="scratch_block"):
        DecodeGraphs(make_runner(model), max_num_seqs=2, max_model_len=64, scratch_block=24, capture=RerunCapture())


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_engine_greedy_with_decode_graphs_equals_eager(tiny_model_dir, monkeypatch, backend):
    """The whole engine with graphs (chunked prefill and mixed steps eager, decode steps replayed, batches that
    shrink as requests finish) generates the eager engine's tokens; the scratch block is kept from the KV
    manager. Triton (interpreted) decodes in graphs by split-K sized from max_model_len (4096 here), so a
    bucket's grid is fixed."""
    prompts = [[5, 17, 300, 42] * 3, [7, 8, 9], [100, 200, 300, 400, 500]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 3, 6)]
    # the C++ kernels on the CPU; Triton in its interpreter on the CPU, or on the GPU with real graphs where one is
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    kw = dict(device=dev, kv_cache_memory=4 << 20, max_num_batched_tokens=16, max_num_seqs=4, check_integrity=True)
    eager = LLM(tiny_model_dir, attention_backend="cpu" if dev == "cpu" else backend, enforce_eager=True, **kw)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    if dev == "cpu":
        monkeypatch.setattr(cuda_graphs, "graph_capture", lambda device: RerunCapture())
    llm = LLM(tiny_model_dir, attention_backend=backend, **kw)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    graphs = llm.engine.core.executor.worker.model_runner.graphs
    assert all(graphs.replays[b] for b in (1, 2, 4))  # 3 decodes (bucket 4), then 2, then 1
    assert llm.engine.kv.num_blocks == eager.engine.kv.num_blocks - 1
    assert eager.engine.core.executor.worker.model_runner.graphs is None


def test_whole_decode_step_in_one_graph_samples_as_the_eager_sampler(tiny_model_dir, monkeypatch):
    """Decode steps whose rows are all plain (greedy or temperature only, seeded here) run forward, LM head
    and sampler from one graph and draw the eager engine's tokens; a step with a row that needs the full
    sampler (top-k, logprobs) replays the forward-only graph and samples eagerly, with the same result."""
    prompts = [[5, 17, 300, 42] * 3, [7, 8, 9], [100, 200, 300, 400, 500], [9, 9, 9, 9]]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=1.2, seed=4, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=5, top_k=20, logprobs=2, max_tokens=3, ignore_eos=True)]
    kw = dict(device="cpu", attention_backend="cpu", kv_cache_memory=4 << 20, max_num_batched_tokens=16, max_num_seqs=4,
              check_integrity=True)
    eager = LLM(tiny_model_dir, enforce_eager=True, **kw)
    want = [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob)
            for o in eager.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(cuda_graphs, "graph_capture", lambda device: RerunCapture())
    llm = LLM(tiny_model_dir, **kw)
    got = [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob)
           for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [g[0] for g in got] == [w[0] for w in want]
    assert [g[1] for g in got] == pytest.approx([w[1] for w in want], abs=1e-4)
    graphs = llm.engine.core.executor.worker.model_runner.graphs
    assert graphs.variant_replays["sample"] and graphs.variant_replays["hidden"]
    assert llm.engine.kv.stats()["used"] == 0
