"""Per-sequence page tables (logical block -> physical block) and batched slot mapping."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch


class BlockTable:
    """Physical block ids of one sequence, in logical order."""

    __slots__ = ("block_ids", "block_size")

    def __init__(self, block_size: int, block_ids: list[int] | None = None) -> None:
        self.block_size = block_size
        self.block_ids: list[int] = block_ids if block_ids is not None else []

    def __len__(self) -> int:
        return len(self.block_ids)

    @property
    def num_slots(self) -> int:
        return len(self.block_ids) * self.block_size

    def slot(self, position: int) -> int:
        """Global slot of one logical position: block * block_size + offset."""
        return self.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def slot_mapping(self, start: int, num_tokens: int) -> torch.Tensor:
        return slot_mapping([self.block_ids], [start], [num_tokens], self.block_size)


def slot_mapping(
    block_tables: Sequence[Sequence[int]],
    starts: Sequence[int],
    num_tokens: Sequence[int],
    block_size: int,
) -> torch.Tensor:
    """int64 slots of positions ``[starts[i], starts[i] + num_tokens[i])`` of every sequence,
    concatenated in batch order. Tables are flattened (no padding) and indexed with tensor ops,
    so the cost does not grow with a per-token Python loop."""
    if not len(block_tables) == len(starts) == len(num_tokens):
        raise ValueError("block_tables, starts and num_tokens need one entry per sequence")
    lens = [len(t) for t in block_tables]
    for i, (s, n, nb) in enumerate(zip(starts, num_tokens, lens)):
        if s < 0 or n < 0 or s + n > nb * block_size:
            raise ValueError(
                f"sequence {i}: positions [{s}, {s + n}) do not fit its {nb} blocks of {block_size}"
            )
    flat = torch.tensor(list(chain.from_iterable(block_tables)), dtype=torch.int64)
    n = torch.tensor(num_tokens, dtype=torch.int64)
    nb = torch.tensor(lens, dtype=torch.int64)
    seq_of = torch.repeat_interleave(torch.arange(len(lens)), n)
    # position of each token = its sequence's start + its offset within the sequence's run
    run_start = n.cumsum(0) - n
    pos = torch.arange(int(n.sum())) - run_start[seq_of] + torch.tensor(starts, dtype=torch.int64)[seq_of]
    shift = block_size.bit_length() - 1  # block_size is a power of two
    table_start = nb.cumsum(0) - nb
    blocks = flat[table_start[seq_of] + (pos >> shift)]
    return (blocks << shift) | (pos & (block_size - 1))
