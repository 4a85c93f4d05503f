"""Random scheduler-like action sequences against KVCacheManager, checked two ways: the
manager's own invariants after every action, and the KV *content* of every live sequence
(a fake pool of token ids goes through the same slot mapping, copy-on-write and swap copies,
applied in the documented order), so sharing, CoW and swap are shown to move the right data."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedllm.kv import KVCacheManager

BS = 4
NUM_BLOCKS = 24
NUM_HOST = 12
PREFIXES = [[7] * 12, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9, 8, 8, 8, 8]]
SALTS = [None, None, "tenant-b"]


class KVMachine(RuleBasedStateMachine):
    eviction = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.m = KVCacheManager(NUM_BLOCKS, BS, num_host_blocks=NUM_HOST, eviction=self.eviction)
        self.dev: list[int | None] = [None] * (NUM_BLOCKS * BS)
        self.host: list[int | None] = [None] * (NUM_HOST * BS)
        self.tokens: dict[int, list[int]] = {}  # computed tokens per live sequence
        self.salt: dict[int, str | None] = {}
        self.swapped: set[int] = set()
        self.writes: dict[int, tuple[int, list[int]]] = {}  # this step's forward writes
        self.swap_outs: list[tuple[int, int]] = []
        self.swap_ins: list[tuple[int, int]] = []
        self.swapped_in_now: set[int] = set()
        self.next_id = 0

    # -- helpers --------------------------------------------------------------------------
    def _idle(self) -> list[int]:
        return sorted(s for s in self.tokens if s not in self.swapped and s not in self.writes)

    def _allocate(self, sid: int, computed: int, new: list[int], prefix=None) -> bool:
        free_before = self.m.num_free_blocks
        ok = self.m.allocate_slots(sid, computed, len(new), prefix=prefix)
        if not ok:
            assert self.m.num_free_blocks == free_before, "failed allocation changed the pool"
            return False
        self.tokens[sid] = self.tokens.get(sid, [])[:computed]
        self.writes[sid] = (computed, new)
        return True

    @staticmethod
    def _copy(src_pool, dst_pool, pairs) -> None:
        data = [src_pool[s * BS : (s + 1) * BS] for s, _ in pairs]  # gather before scatter
        for (_, d), blk in zip(pairs, data):
            dst_pool[d * BS : (d + 1) * BS] = blk

    # -- rules ----------------------------------------------------------------------------
    @rule(p=st.integers(0, 2), keep=st.integers(0, 12), suffix=st.lists(st.integers(20, 22), max_size=9))
    def new_seq(self, p: int, keep: int, suffix: list[int]) -> None:
        toks = PREFIXES[p][:keep] + suffix
        if not toks:
            return
        sid = self.next_id
        self.next_id += 1
        match = self.m.match_prefix(toks, SALTS[p])
        assert match.num_tokens <= len(toks) - 1 and match.num_tokens % BS == 0
        for i, b in enumerate(match.blocks):
            assert self.dev[b * BS : (b + 1) * BS] == toks[i * BS : (i + 1) * BS], "prefix hit with wrong KV"
        self.salt[sid] = SALTS[p]
        self.tokens[sid] = toks[: match.num_tokens]
        if not self._allocate(sid, match.num_tokens, toks[match.num_tokens :], prefix=match):
            del self.tokens[sid], self.salt[sid]
            assert not self.m.has_seq(sid)

    @precondition(lambda self: self._idle())
    @rule(data=st.data(), new=st.lists(st.integers(20, 23), min_size=1, max_size=6))
    def append(self, data, new: list[int]) -> None:
        sid = data.draw(st.sampled_from(self._idle()))
        self._allocate(sid, len(self.tokens[sid]), new)

    @precondition(lambda self: self._idle())
    @rule(data=st.data(), back=st.integers(1, 6), new=st.lists(st.integers(30, 31), min_size=1, max_size=6))
    def rewrite(self, data, back: int, new: list[int]) -> None:
        """Overwrite the last tokens (a rejected draft): CoW for shared blocks, unhash private ones."""
        sid = data.draw(st.sampled_from(self._idle()))
        start = max(len(self.tokens[sid]) - back, 0)
        self._allocate(sid, start, new)

    @precondition(lambda self: self._idle())
    @rule(data=st.data())
    def fork(self, data) -> None:
        sid = data.draw(st.sampled_from(self._idle()))
        child = self.next_id
        self.next_id += 1
        self.m.fork(sid, child)
        self.tokens[child] = list(self.tokens[sid])
        self.salt[child] = self.salt[sid]
        if sid in self.swapped_in_now:
            self.swapped_in_now.add(child)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.free(sid)
        del self.tokens[sid], self.salt[sid]
        self.writes.pop(sid, None)
        self.swapped.discard(sid)
        assert not self.m.has_seq(sid)

    def _swappable(self) -> list[int]:
        return sorted(s for s in self.tokens if s not in self.swapped and s not in self.swapped_in_now)

    @precondition(lambda self: self._swappable())
    @rule(data=st.data())
    def swap_out(self, data) -> None:
        """Swap out a group (a request's samples/beams share blocks): all or nothing."""
        group = data.draw(st.lists(st.sampled_from(self._swappable()), min_size=1, max_size=3, unique=True))
        distinct = {b for sid in group for b in self.m.block_table(sid)}
        pairs = self.m.swap_out_group(group) if len(group) > 1 else self.m.swap_out(group[0])
        if pairs is None:
            assert len(distinct) > self.m.num_free_host_blocks
            assert all(not self.m.is_swapped(sid) for sid in group)
            return
        assert len(pairs) == len(distinct)  # shared blocks are copied once
        self.swap_outs += pairs
        for sid in group:
            assert self.m.block_table(sid) == []
            self.swapped.add(sid)
            self.writes.pop(sid, None)  # not computed this step; the engine recomputes after swap-in

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data) -> None:
        group = data.draw(st.lists(st.sampled_from(sorted(self.swapped)), min_size=1, max_size=3, unique=True))
        pairs = self.m.swap_in_group(group) if len(group) > 1 else self.m.swap_in(group[0])
        if pairs is None:
            assert all(self.m.is_swapped(sid) for sid in group)
            return
        self.swap_ins += pairs
        for sid in group:
            self.swapped.discard(sid)
            self.swapped_in_now.add(sid)
            assert len(self.tokens[sid]) <= len(self.m.block_table(sid)) * BS

    @rule(n=st.integers(0, 5))
    def evict(self, n: int) -> None:
        cached = self.m.pool.num_cached_free
        assert self.m.prefix_cache.evict(n) == min(n, cached)

    @rule()
    def run_step(self) -> None:
        """The model runner: swap-outs, swap-ins, CoW copies, then the forward writes."""
        self._copy(self.dev, self.host, self.swap_outs)
        self._copy(self.host, self.dev, self.swap_ins)
        self._copy(self.dev, self.dev, self.m.take_pending_copies())
        self.swap_outs, self.swap_ins = [], []
        self.swapped_in_now.clear()
        for sid, (start, new) in self.writes.items():
            table = self.m.block_table(sid)
            for j, t in enumerate(new):
                pos = start + j
                self.dev[table[pos // BS] * BS + pos % BS] = t
            self.tokens[sid] = self.tokens[sid][:start] + new
        self.writes.clear()
        for sid, toks in self.tokens.items():
            if sid in self.swapped:
                continue
            self.m.cache_full_blocks(sid, toks, self.salt[sid])
            table = self.m.block_table(sid)
            got = [self.dev[table[p // BS] * BS + p % BS] for p in range(len(toks))]
            assert got == toks, f"seq {sid}: KV content {got} != tokens {toks}"

    @invariant()
    def integrity(self) -> None:
        self.m.check_integrity()

    def teardown(self) -> None:
        for sid in list(self.tokens):
            self.m.free(sid)
        self.m.take_pending_copies()
        self.m.check_integrity()
        assert self.m.pool.num_used == 0, "blocks leaked after every sequence ended"
        assert self.m.num_free_host_blocks == NUM_HOST, "host blocks leaked"


KVMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
)
TestKVStateful = KVMachine.TestCase


class ReuseEvictionKVMachine(KVMachine):
    """The same machine with the pool evicting by predicted reuse (its heap checked with the invariants)."""

    eviction = "reuse"


ReuseEvictionKVMachine.TestCase.settings = KVMachine.TestCase.settings
TestKVStatefulReuseEviction = ReuseEvictionKVMachine.TestCase
