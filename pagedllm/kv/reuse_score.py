"""The reuse score shared by every eviction decision (pool, host RAM, disk), kept in a form that never
needs rescoring.

A block's expected reuse is its decayed use count: each use adds ``1 + depth_weight / (1 + depth)`` (a
shallow block, a system prompt's first blocks, serves every prefix that passes through it), and the count
halves every ``half_life`` clock ticks. Stored as ``log2(count) + now / half_life``, two blocks' keys
compare the way their decayed counts do at any later time (both decay by the same factor), so a heap
built on the keys stays ordered while the clock runs: no pass over all blocks per eviction.
"""

from __future__ import annotations

import math

NO_KEY = -math.inf  # a block never used: it goes first
# A use of a chain's first block counts 1.1, of a deep block ~1. Small on purpose: every hit on a deep block
# also passes through its ancestors, so frequency already ranks a chain's head above its tail, and a
# request releases its tail first. A weight of 1 kept many documents' first blocks instead of the popular
# documents whole (Zipf RAG through the engine: 1.10x LRU's hit tokens at 1.0, 1.11-1.13x at 0.1, 1.14x at 0).
DEPTH_WEIGHT = 0.1


def use_weight(depth: int, depth_weight: float) -> float:
    """What one use of a block at ``depth`` in its prefix chain adds to its count."""
    return 1.0 + depth_weight / (1 + depth)


def add_use(key: float, now: int, half_life: float, amount: float) -> float:
    """The key after ``amount`` more uses at clock ``now`` (``key``: the current one, or NO_KEY; no use
    yet and ``amount`` 0 stays NO_KEY)."""
    shift = now / half_life
    count = 2.0 ** (key - shift) + amount
    return math.log2(count) + shift if count > 0 else NO_KEY


def decayed(key: float, now: int, half_life: float) -> float:
    """The decayed count a key stands for at clock ``now``."""
    return 2.0 ** (key - now / half_life)
