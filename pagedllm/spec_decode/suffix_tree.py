"""A depth-bounded suffix trie with occurrence counts: every suffix of the inserted token streams,
cut at ``max_depth`` tokens, is a path from the root; a node's count is how often its path occurred.
The most frequent continuation of a context is a walk down the heaviest children."""

from __future__ import annotations

from collections.abc import Sequence


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    """Counts of every substring of length <= ``max_depth`` of the streams added to it.

    ``extend`` is incremental: the trie keeps the nodes of the suffixes ending at each stream's last
    token, so appending one token costs ``max_depth`` child steps, not a rebuild. ``remove`` takes a
    whole stream back out (nodes whose count drops to zero are deleted), which bounds memory when
    an LRU of recent streams evicts one.
    """

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node()
        self.num_nodes = 0
        self._frontier: dict[object, list[_Node]] = {}  # stream key -> nodes of its live suffixes

    def extend(self, key: object, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to stream ``key`` (a new stream if unseen)."""
        live = self._frontier.get(key, [])
        for tok in tokens:
            nxt = []
            for node in [self.root, *live[: self.max_depth - 1]]:  # suffix depths 0 .. max_depth - 1
                child = node.children.get(tok)
                if child is None:
                    child = node.children[tok] = _Node()
                    self.num_nodes += 1
                child.count += 1
                nxt.append(child)
            live = nxt  # shortest suffix first
        self._frontier[key] = live

    def close(self, key: object) -> None:
        """Stop extending stream ``key`` (its counts stay)."""
        self._frontier.pop(key, None)

    def remove(self, tokens: Sequence[int]) -> None:
        """Take back one earlier ``extend`` of exactly ``tokens`` (as a whole stream)."""
        n = len(tokens)
        for i in range(n):
            node = self.root
            for tok in tokens[i: i + self.max_depth]:
                child = node.children[tok]
                child.count -= 1
                if child.count == 0:
                    self.num_nodes -= self._size(child)
                    del node.children[tok]
                    break
                node = child

    def _size(self, node: _Node) -> int:
        return 1 + sum(self._size(c) for c in node.children.values())

    def continuation(self, context: Sequence[int], k: int, max_match: int,
                     min_prob: float) -> tuple[list[int], float, int]:
        """``(tokens, score, match_len)``: from the longest tail of ``context`` (<= ``max_match``
        tokens) found in the trie, follow the most frequent child while its conditional frequency
        stays >= ``min_prob``, at most ``k`` tokens. ``score`` sums the path's probabilities (the
        expected number of accepted tokens under the trie's statistics)."""
        for m in range(min(max_match, len(context), self.max_depth - 1), 0, -1):
            node = self.root
            for tok in context[len(context) - m:]:
                node = node.children.get(tok)
                if node is None:
                    break
            if node is None or not node.children:
                continue
            out, score, prob = [], 0.0, 1.0
            while node.children and len(out) < k:
                tok, child = max(node.children.items(), key=lambda kv: kv[1].count)
                prob *= child.count / node.count
                if prob < min_prob:
                    break
                out.append(tok)
                score += prob
                node = child
            if out:
                return out, score, m
        return [], 0.0, 0
