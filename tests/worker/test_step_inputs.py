"""A step's inputs from the worker's persistent batch: the C++ gather (``ops/csrc/step_inputs.cpp``) returns the
tensors of the ATen index-op gather it replaces, for any mix of decodes and prefill chunks over scattered blocks,
with and without adapters, and refuses rows and positions outside the batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm import ops
from pagedllm.worker.input_batch import InputBatch

pytestmark = pytest.mark.skipif(not ops.load("step_inputs"), reason="no C++ compiler here")

BLOCK = 4


def _batch(seed: int, rows: int, lora: bool) -> InputBatch:
    g = torch.Generator().manual_seed(seed)
    b = InputBatch(max_model_len=40, block_size=BLOCK, vocab_size=100, device=torch.device("cpu"), initial_rows=rows)
    b.token_ids.copy_(torch.randint(0, 100, b.token_ids.shape, generator=g))
    b.block_table.copy_(torch.randperm(rows * b.max_blocks, generator=g).view(rows, -1).int())
    b.num_blocks.copy_(torch.randint(1, b.max_blocks + 1, (rows,), generator=g))
    if lora:
        b.lora_id.copy_(torch.randint(0, 3, (rows,), generator=g))
    return b


@st.composite
def _steps(draw):
    rows = draw(st.integers(1, 6))
    seqs = draw(st.lists(st.tuples(st.integers(0, rows - 1), st.integers(1, 7)), min_size=1, max_size=rows))
    return rows, [(r, q, draw(st.integers(0, 40 - q))) for r, q in seqs], draw(st.booleans()), draw(st.integers(0, 99))


@settings(max_examples=60, deadline=None)
@given(_steps())
def test_the_cpp_gather_returns_the_index_ops_tensors(step):
    rows, seqs, lora, seed = step
    b = _batch(seed, rows, lora)
    # positions past a row's own blocks read what its table holds there, in both (the worker never schedules them)
    args = (b.token_ids, b.block_table, b.num_blocks, b.lora_id, [r for r, _, _ in seqs], [q for _, q, _ in seqs],
            [s for _, _, s in seqs], BLOCK)
    width = max(1, int(b.num_blocks[[r for r, _, _ in seqs]].max()))
    if any((s + q - 1) // BLOCK >= width for _, q, s in seqs):  # past every table's width: both refuse
        with pytest.raises(IndexError):
            InputBatch._gather(*args)
        with pytest.raises(RuntimeError, match="past the step's"):
            torch.ops.pagedllm.step_inputs.default(*args)
        return
    want = InputBatch._gather(*args)
    got = torch.ops.pagedllm.step_inputs.default(*args)
    for name, w, g in zip(("input_ids", "positions", "slots", "tables", "seq_lens", "qsl", "lora_ids"), want, got):
        assert g.dtype == w.dtype and torch.equal(g, w), name
    assert got[6].numel() == (sum(q for _, q, _ in seqs) if bool(b.lora_id[[r for r, _, _ in seqs]].any()) else 0)


def test_the_gather_refuses_rows_and_tokens_outside_the_batch():
    b = _batch(0, 2, False)
    args = (b.token_ids, b.block_table, b.num_blocks, b.lora_id)
    with pytest.raises(RuntimeError, match="row 2 is not one of the batch's 2"):
        torch.ops.pagedllm.step_inputs.default(*args, [2], [1], [0], BLOCK)
    with pytest.raises(RuntimeError, match="outside its 40"):
        torch.ops.pagedllm.step_inputs.default(*args, [0], [3], [38], BLOCK)
    with pytest.raises(RuntimeError, match="one entry a sequence"):
        torch.ops.pagedllm.step_inputs.default(*args, [0, 1], [1], [0], BLOCK)
