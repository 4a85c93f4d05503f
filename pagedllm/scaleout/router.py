"""Which replica serves a request: prefix affinity first, the least-loaded replica otherwise.

Like SGLang's cache-aware router and Ray Serve LLM's prefix-aware router, the router keeps an
approximate map of what each replica has cached: the chain hashes of the first blocks of every
prompt it sent there (bounded, least recently used forgotten first). A new prompt goes to the
replica holding its longest prefix, unless that replica is busier than the least-loaded one by
more than ``balance_threshold`` requests: then the least-loaded replica takes it, and the route
names the holder so the new replica can fetch the prefix's blocks from it instead of computing
them (when the prefix is at least ``min_fetch_blocks`` long).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pagedllm.kv.prefix_cache import extra_keys_for, hash_block_chain

POLICIES = ("prefix", "least-loaded")


@dataclass(frozen=True)
class Route:
    replica: int  # the replica that serves the request
    fetch_from: int | None = None  # a peer holding the prompt's first ``matched_blocks`` blocks
    matched_blocks: int = 0  # leading blocks the router believes ``replica`` (or fetch_from) holds


class PrefixRouter:
    def __init__(self, num_replicas: int, block_size: int, policy: str = "prefix", max_blocks: int = 64,
                 max_entries: int = 1 << 16, balance_threshold: int = 8, min_fetch_blocks: int = 2) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.policy = policy
        self.max_blocks = max_blocks  # only a prompt's first blocks are hashed and remembered
        self.max_entries = max_entries
        self.balance_threshold = balance_threshold
        self.min_fetch_blocks = min_fetch_blocks
        self.load = [0] * num_replicas  # requests in flight per replica
        self.down: set[int] = set()  # replicas restarting: nothing is routed there
        self._where: OrderedDict[int, set[int]] = OrderedDict()  # block hash -> replicas holding it
        self._next = 0  # round-robin tie break among equally loaded replicas

    def hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[int]:
        """Chain hashes of the prompt's first full blocks (the routing key)."""
        n = min(len(token_ids) // self.block_size, self.max_blocks) * self.block_size
        return hash_block_chain(None, token_ids[:n], self.block_size, extra_keys_for(cache_salt))

    def route(self, token_ids: Sequence[int], cache_salt: str | None = None,
              candidates: Sequence[int] | None = None) -> Route:
        """Pick a replica among ``candidates`` (default: all up) and count the request on it."""
        pool = [r for r in (range(self.num_replicas) if candidates is None else candidates) if r not in self.down]
        if not pool:
            raise RuntimeError("no replica is up")
        hashes = self.hashes(token_ids, cache_salt)
        route = self._choose(hashes, pool)
        self.load[route.replica] += 1
        for h in hashes:
            self._remember(h, route.replica)
        return route

    def _choose(self, hashes: list[int], pool: list[int]) -> Route:
        least = self._least_loaded(pool)
        if self.policy != "prefix":
            return Route(least)
        holders, matched = set(pool), 0
        for h in hashes:
            have = self._where.get(h, set()) & holders
            if not have:
                break
            holders, matched = have, matched + 1
        if not matched:
            return Route(least)
        owner = self._least_loaded(sorted(holders))
        if owner == least or self.load[owner] - self.load[least] <= self.balance_threshold:
            return Route(owner, matched_blocks=matched)
        fetch = owner if matched >= self.min_fetch_blocks else None
        return Route(least, fetch, matched)

    def _least_loaded(self, pool: Sequence[int]) -> int:
        n = self.num_replicas
        best = min(pool, key=lambda r: (self.load[r], (r - self._next) % n))
        self._next = (best + 1) % n
        return best

    def _remember(self, h: int, replica: int) -> None:
        where = self._where.get(h)
        if where is None:
            where = self._where[h] = set()
            if len(self._where) > self.max_entries:
                self._where.popitem(last=False)
        else:
            self._where.move_to_end(h)
        where.add(replica)

    def done(self, replica: int) -> None:
        """A request on ``replica`` finished (or failed)."""
        self.load[replica] = max(self.load[replica] - 1, 0)

    def forget(self, replica: int) -> None:
        """``replica`` restarted with an empty cache and no requests."""
        self.load[replica] = 0
        for where in self._where.values():
            where.discard(replica)
