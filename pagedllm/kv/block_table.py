"""Per-sequence page tables (logical block -> physical block) and batched slot mapping."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
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
    concatenated in batch order. Tables are flattened (no padding) and indexed with vectorised
    array ops, no per-token Python loop; numpy, because on these small arrays each torch op costs
    several times more dispatch overhead (the result is a zero-copy torch tensor)."""
    if not len(block_tables) == len(starts) == len(num_tokens):
        raise ValueError("block_tables, starts and num_tokens need one entry per sequence")
    nb = np.fromiter(map(len, block_tables), np.int64, len(block_tables))
    n = np.asarray(num_tokens, dtype=np.int64).reshape(-1)
    s = np.asarray(starts, dtype=np.int64).reshape(-1)
    bad = np.flatnonzero((s < 0) | (n < 0) | (s + n > nb * block_size))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"sequence {i}: positions [{s[i]}, {s[i] + n[i]}) do not fit its {nb[i]} blocks of {block_size}")
    flat = np.fromiter(chain.from_iterable(block_tables), np.int64, int(nb.sum()))
    seq_of = np.repeat(np.arange(len(nb)), n)
    # position of each token = its sequence's start + its offset within the sequence's run
    run_start = np.cumsum(n) - n
    pos = np.arange(int(n.sum()), dtype=np.int64) - run_start[seq_of] + s[seq_of]
    shift = block_size.bit_length() - 1  # block_size is a power of two
    table_start = np.cumsum(nb) - nb
    blocks = flat[table_start[seq_of] + (pos >> shift)]
    return torch.from_numpy((blocks << shift) | (pos & (block_size - 1)))
