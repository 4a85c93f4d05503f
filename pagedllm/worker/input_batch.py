"""The worker's persistent batch: every live sequence's tokens, block table and sampling settings
in fixed tensors, updated from the core's per-step diffs instead of rebuilt from lists.

A sequence owns one row from the time the worker first sees it until it finishes (preempted
sequences keep theirs: their tokens do not change, and their table is replaced when they come
back). A step gathers its rows in one C++ call (or index ops): input ids, positions, slot mapping
and block tables over the rows, never a Python loop over tokens or blocks. The per-sequence
bookkeeping between steps (a diff's new tokens, a sampled id, a row's counts) goes through numpy
views of the same memory (``host``, as vLLM's persistent batch does): a scalar write through a
tensor is a dispatcher round trip of ~5-10 us, a numpy one well under 1 us, and a batch-1 step
made ~25 of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from pagedllm import ops
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.protocol.sampling_params import SamplingParams
from pagedllm.protocol.step_io import PENDING_TOKEN, NewSeqData, ScheduledSeq
from pagedllm.worker.noise import noise_key


@dataclass
class StepInputs:
    """One forward pass's inputs, in the order the attention metadata wants (decodes first)."""

    input_ids: torch.Tensor  # [T]
    meta: AttentionMetadata
    order: list[int]  # order[k] = index into SchedulerOutput.scheduled of the k-th sequence in the batch
    lora_ids: torch.Tensor | None = None  # [T] each token's adapter id (0: base); None when no row has one


class InputBatch:
    """Rows of token ids ``[rows, max_model_len]`` and block tables ``[rows, max_blocks]``, plus
    per-row sampling settings as tensors (the sampler gathers them per step)."""

    def __init__(self, max_model_len: int, block_size: int, vocab_size: int, device: torch.device,
                 initial_rows: int = 64) -> None:
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.max_blocks = -(-max_model_len // block_size)
        self.row_of: dict[int, int] = {}
        self.params: list[SamplingParams | None] = []
        self.generators: list[torch.Generator | None] = []
        self._free: list[int] = []
        n = 0
        self.token_ids = torch.zeros((n, max_model_len), dtype=torch.int64)
        self.block_table = torch.zeros((n, self.max_blocks), dtype=torch.int32)
        self.num_tokens = torch.zeros(n, dtype=torch.int64)
        self.num_prompt = torch.zeros(n, dtype=torch.int64)
        self.num_blocks = torch.zeros(n, dtype=torch.int64)
        self.sample_index = torch.zeros(n, dtype=torch.int64)
        self.lora_id = torch.zeros(n, dtype=torch.int64)  # issue 32: each row's adapter (0: base)
        self.noise_key = torch.zeros(n, dtype=torch.int64)  # the sampler's per-row noise key (worker/noise.py)
        self._grow(initial_rows)

    # ---------------------------------------------------------------- rows
    def _grow(self, rows: int) -> None:
        """Double the row tensors (rows are never moved, so row ids stay valid). They are made as normal tensors
        even when a step (under inference mode) grows them: a deferred step's ids are recorded later, outside it."""
        old = self.token_ids.shape[0]
        new = max(rows, 2 * old, 1)

        @torch.inference_mode(False)
        def widen(t: torch.Tensor) -> torch.Tensor:
            out = torch.zeros((new, *t.shape[1:]), dtype=t.dtype)
            out[:old] = t
            return out

        names = ("token_ids", "block_table", "num_tokens", "num_prompt", "num_blocks", "sample_index", "noise_key",
                 "lora_id")
        for name in names:
            setattr(self, name, widen(getattr(self, name)))
        self.host = SimpleNamespace(**{name: getattr(self, name).numpy() for name in names})  # the same memory
        self.params += [None] * (new - old)
        self.generators += [None] * (new - old)
        self._free += range(new - 1, old - 1, -1)

    def _take_row(self, seq_id: int) -> int:
        if seq_id in self.row_of:
            raise ValueError(f"sequence {seq_id} already has a row")
        if not self._free:
            self._grow(0)
        row = self._free.pop()
        self.row_of[seq_id] = row
        return row

    def add(self, new: NewSeqData) -> None:
        n = len(new.token_ids)
        if n > self.max_model_len:
            raise ValueError(f"sequence {new.seq_id} has {n} tokens; the worker holds at most {self.max_model_len}")
        row = self.row_of.get(new.seq_id)
        resync = row is not None  # the core resends a sequence whole after a failed step
        if row is None:
            row = self._take_row(new.seq_id)
        self.token_ids[row, :n] = torch.as_tensor(new.token_ids, dtype=torch.int64)
        self.num_tokens[row] = n
        self.num_prompt[row] = new.num_prompt_tokens
        self.num_blocks[row] = 0
        self.sample_index[row] = new.sample_index
        self.lora_id[row] = 0 if new.lora is None else new.lora.lora_int_id
        self.params[row] = new.params
        if not resync:
            self.generators[row] = make_generator(new.params, new.sample_index)
            self.noise_key[row] = noise_key(new.params.seed, new.sample_index)

    def fork(self, parent: int, child: int, sample_index: int) -> None:
        """The child's row starts as a copy of the parent's (tokens, table, settings); its randomness is
        its own sample index's (the same key drew its first token on the parent's row)."""
        src = self.row_of[parent]
        row = self._take_row(child)
        for t in (self.token_ids, self.block_table, self.num_tokens, self.num_prompt, self.num_blocks, self.lora_id):
            t[row] = t[src]
        self.sample_index[row] = sample_index
        self.params[row] = self.params[src]
        self.generators[row] = make_generator(self.params[src], sample_index)
        self.noise_key[row] = noise_key(self.params[src].seed, sample_index)

    def remove(self, seq_id: int) -> None:
        row = self.row_of.pop(seq_id, None)
        if row is None:
            return
        self.params[row] = None
        self.generators[row] = None
        self._free.append(row)

    def apply(self, s: ScheduledSeq) -> int:
        """Apply one sequence's diff (new tokens, block-table change); returns its row."""
        row = self.row_of[s.seq_id]
        host = self.host
        if s.new_token_ids:
            start = int(host.num_tokens[row])
            end = start + len(s.new_token_ids)
            if end > self.max_model_len:
                raise ValueError(f"sequence {s.seq_id} would exceed {self.max_model_len} tokens")
            new = np.asarray(s.new_token_ids, dtype=np.int64)
            if min(s.new_token_ids) == PENDING_TOKEN:  # async scheduling: the worker wrote it when it sampled it
                new = np.where(new == PENDING_TOKEN, host.token_ids[row, start:end], new)
            host.token_ids[row, start:end] = new
            host.num_tokens[row] = end
        if s.table_keep != int(host.num_blocks[row]) or s.new_block_ids:
            end = s.table_keep + len(s.new_block_ids)
            if s.new_block_ids:
                host.block_table[row, s.table_keep:end] = s.new_block_ids
            host.num_blocks[row] = end
        held = int(host.num_tokens[row])
        k = len(s.spec_token_ids)
        if s.num_computed + s.num_tokens - k > held or held + k > self.max_model_len:
            raise ValueError(f"sequence {s.seq_id}: {s.num_computed} + {s.num_tokens} tokens scheduled ({k} drafts) "
                             f"but the worker holds {held}")
        if k:  # drafts sit past the row's tokens (read as input, not counted as the sequence's own)
            host.token_ids[row, held:held + k] = s.spec_token_ids
        return row

    def record_sampled(self, rows: list[int], token_ids: list[int], positions: torch.Tensor | None = None) -> None:
        """Each row's sampled token goes just past its tokens (not counted as its own yet): the next
        step's diff either repeats it or, under async scheduling, names it ``PENDING_TOKEN``. ``positions``:
        where they go, when recorded after the rows moved on (a deferred step's ids)."""
        rows_a = np.asarray(rows, dtype=np.int64)
        pos = self.host.num_tokens[rows_a] if positions is None else positions.numpy()
        room = pos < self.max_model_len
        self.host.token_ids[rows_a[room], pos[room]] = np.asarray(token_ids, dtype=np.int64)[room]

    # ---------------------------------------------------------------- step
    def prepare(self, scheduled: list[ScheduledSeq], rows: list[int]) -> StepInputs:
        """Input ids and attention metadata for the scheduled sequences (decodes first): one C++ call over their rows
        (``ops/csrc/step_inputs.cpp``), or the same gather by ATen index ops where it can't be built."""
        order = sorted(range(len(scheduled)), key=lambda i: scheduled[i].num_tokens != 1)
        query_lens = [scheduled[i].num_tokens for i in order]
        starts = [scheduled[i].num_computed for i in order]
        ordered = [rows[i] for i in order]
        gather = torch.ops.pagedllm.step_inputs.default if ops.load("step_inputs") else self._gather
        input_ids, positions, slots, tables, seq_lens, qsl, lora_ids = gather(
            self.token_ids, self.block_table, self.num_blocks, self.lora_id, ordered, query_lens, starts,
            self.block_size)
        num_decodes = next((k for k, n in enumerate(query_lens) if n != 1), len(query_lens))
        meta = AttentionMetadata(positions, slots, qsl, seq_lens, tables, self.block_size, num_decodes, query_lens,
                                 [s + q for s, q in zip(starts, query_lens)])
        lora = lora_ids if lora_ids.numel() else None
        dev = self.device
        if dev.type != "cpu":
            input_ids = input_ids.to(dev, non_blocking=True)
            meta = meta.to(dev)
        return StepInputs(input_ids, meta, order, lora)

    @staticmethod
    def _gather(token_ids: torch.Tensor, block_table: torch.Tensor, num_blocks: torch.Tensor, lora_id: torch.Tensor,
                rows: list[int], query_lens: list[int], starts: list[int], block_size: int) -> tuple[torch.Tensor, ...]:
        """``step_inputs`` by ATen index ops (where the C++ op can't be built): the same tensors."""
        row_t = torch.tensor(rows, dtype=torch.int64)
        q = torch.tensor(query_lens, dtype=torch.int64)
        seq_of_token = torch.repeat_interleave(torch.arange(len(rows)), q)
        positions = (torch.tensor(starts, dtype=torch.int64)[seq_of_token] + torch.arange(int(q.sum()))
                     - (torch.cumsum(q, 0) - q)[seq_of_token])
        tables = block_table[row_t, :max(1, int(num_blocks[row_t].max()))]
        meta = AttentionMetadata.from_tensors(positions, seq_of_token, q, q + torch.tensor(starts), tables, block_size)
        row_lora = lora_id[row_t]
        lora_ids = row_lora[seq_of_token] if bool(row_lora.any()) else row_lora[:0]
        return (token_ids[row_t[seq_of_token], positions], positions, meta.slot_mapping, tables, meta.seq_lens,
                meta.query_start_loc, lora_ids)


def make_generator(params: SamplingParams, sample_index: int) -> torch.Generator | None:
    """Seeded requests get one generator per sample for draft verification (spec_verify), so its draws do
    not depend on batch mates (the sampler uses the row's noise key instead)."""
    if params.seed is None:
        return None
    g = torch.Generator()
    g.manual_seed((params.seed * 1_000_003 + sample_index) % (1 << 63))
    return g
