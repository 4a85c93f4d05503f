"""How many drafts to verify each step: those whose expected gain pays for their rows.

Draft j of a sequence is kept with probability ``s_j = f p_1 * ... * f p_j``: ``p_l`` is the learned
chance that draft l is right given that the drafts before it were, per confidence class (the proposer's
context match length: SmolLM2 continues a 1-gram match a quarter to a third of the time, an 8-gram 97%;
proposers without one share class 0), and ``f`` the request's own recent record against that
expectation (a request whose drafts keep failing stops getting them, and is tried again later). A
step over T tokens costs ``c(T)``, learned from the engine's own decode steps. Of all offered drafts
the step verifies the ``m`` likeliest that maximise expected tokens per unit of time,
``(B + s_(1) + ... + s_(m)) / c(B + m)`` for B sequences. So on a memory-bound batch, where a verify
row costs a fraction of a step, confident drafts are verified many at a time; where every row costs
about as much as the step's fixed part (a compute-bound CPU batch) only near-certain ones are; and
with low acceptance none are, so speculation costs only the proposer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PRIOR_P, PRIOR_WEIGHT = 0.5, 2.0  # an unseen (class, position) starts at p = 0.5, worth 2 observations
DECAY = 0.995  # forgetting per observation of a (class, position): the last few hundred steps count
COST_ALPHA = 0.2  # weight of a new step time in its token count's running mean
PRIOR_ROW_COST = 0.25  # extrapolated cost of a token beyond the largest measured step, in mean tokens' cost
# a request's factor f = (accepted + w) / (expected + w), both decayed sums: per verify, and per step without
# drafts (so a request left out is tried again some tens of steps later)
REQUEST_PRIOR, REQUEST_DECAY, REQUEST_IDLE_DECAY = 2.0, 0.9, 0.95


class AcceptanceModel:
    """``p[c, j]``: chance that draft j + 1 of confidence class c is right when drafts 1..j were."""

    def __init__(self, num_classes: int, max_drafts: int):
        self.num_classes = num_classes
        self.hits = np.zeros((num_classes, max_drafts))
        self.tries = np.zeros((num_classes, max_drafts))

    def cls(self, match_len: int) -> int:
        return min(max(match_len, 0), self.num_classes - 1)

    def right(self, cls: int, n: int) -> np.ndarray:
        """``[n]``: ``p[cls, :n]``."""
        return (self.hits[cls, :n] + PRIOR_P * PRIOR_WEIGHT) / (self.tries[cls, :n] + PRIOR_WEIGHT)

    def survival(self, cls: int, n: int) -> np.ndarray:
        """``[n]``: chance that drafts 1..j + 1 are all right, j < n."""
        return np.cumprod(self.right(cls, n))

    def update(self, cls: int, num_drafts: int, num_accepted: int) -> None:
        """Drafts 1..a were right, draft a + 1 (if drafted) wrong; later ones tell nothing."""
        seen = min(num_accepted + 1, num_drafts)
        self.hits[cls, :seen] *= DECAY
        self.tries[cls, :seen] *= DECAY
        self.hits[cls, :num_accepted] += 1
        self.tries[cls, :seen] += 1


class StepCost:
    """Wall time of a decode step by the number of tokens it computes: a running mean per count, made
    non-decreasing (a step over more tokens never costs less: noise from the machine's load is pooled
    away), interpolated between measured counts and extrapolated linearly beyond them."""

    def __init__(self) -> None:
        self.mean: dict[int, float] = {}
        self.count: dict[int, int] = {}

    def observe(self, num_tokens: int, seconds: float) -> None:
        old = self.mean.get(num_tokens)
        if old is None:
            self.mean[num_tokens] = seconds
        else:  # a load spike moves the mean by at most COST_ALPHA of itself
            self.mean[num_tokens] = old + COST_ALPHA * (min(seconds, 2 * old) - old)
        self.count[num_tokens] = self.count.get(num_tokens, 0) + 1

    def curve(self) -> tuple[np.ndarray, np.ndarray]:
        """(token counts, costs): the means, pooled into a non-decreasing sequence weighted by how often
        each was measured (pool adjacent violators)."""
        ts = sorted(self.mean)
        blocks: list[list[float]] = []  # [weighted sum, weight, number of counts]
        for t in ts:
            w = min(self.count[t], 16)
            blocks.append([self.mean[t] * w, w, 1])
            while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                s, w, n = blocks.pop()
                blocks[-1] = [blocks[-1][0] + s, blocks[-1][1] + w, blocks[-1][2] + n]
        cost = np.repeat([b[0] / b[1] for b in blocks], [b[2] for b in blocks])
        return np.array(ts, dtype=np.float64), cost

    def relative(self, base: int, extra: int) -> np.ndarray:
        """``[extra + 1]``: ``c(base + m) / c(base)`` for m = 0..extra."""
        t = np.arange(base, base + extra + 1, dtype=np.float64)
        if not self.mean:
            return 1 + PRIOR_ROW_COST * (t - base) / base
        known, cost = self.curve()
        c = np.interp(t, known, cost)
        lo, hi = known[0], known[-1]
        c = np.where(t > hi, cost[-1] * (1 + PRIOR_ROW_COST * (t - hi) / hi), c)
        c = np.where(t < lo, cost[0] * (1 - PRIOR_ROW_COST * (lo - t) / lo), c)
        return c / c[0]


def allocate(survival: Sequence[np.ndarray], base: int, cost: StepCost) -> list[int]:
    """How many of each sequence's drafts to verify: ``survival[i][j]`` is the chance that its drafts
    1..j + 1 are all kept; ``base`` the tokens the step computes without drafts."""
    counts = [len(s) for s in survival]
    if not any(counts):
        return counts
    gains = np.concatenate([s for s in survival if len(s)])
    owner = np.repeat(np.arange(len(survival)), counts)
    order = np.argsort(-gains, kind="stable")  # a sequence's drafts stay in order (survival never rises)
    value = (base + np.concatenate([[0.0], np.cumsum(gains[order])])) / cost.relative(base, len(gains))
    m = int(np.argmax(value))  # ties: the fewest drafts
    return np.bincount(owner[order[:m]], minlength=len(survival)).tolist()


@dataclass
class _Request:
    accepted: float = 0.0  # decayed sums of its accepted drafts and of what the class model expected
    expected: float = 0.0
    cls: int = 0  # confidence class of its drafts in flight

    @property
    def factor(self) -> float:
        return (self.accepted + REQUEST_PRIOR) / (self.expected + REQUEST_PRIOR)


class DraftPolicy:
    """The acceptance model, the step cost curve and each request's record, behind three calls:
    ``choose`` before a step, ``record`` after its verification, ``observe_step`` with its time."""

    def __init__(self, max_drafts: int, num_classes: int = 9):
        self.acceptance = AcceptanceModel(num_classes, max_drafts)
        self.cost = StepCost()
        self._requests: dict[str, _Request] = {}

    def choose(self, req_ids: Sequence[str], match_lens: Sequence[int], lengths: Sequence[int], base: int) -> list[int]:
        """How many of ``lengths[i]`` offered drafts request i verifies this step (``match_lens[i]``: the
        proposer's match length, 0 if it reports none); ``base``: the step's tokens without drafts."""
        reqs = [self._requests.setdefault(r, _Request()) for r in req_ids]
        survival = []
        for req, n, k in zip(reqs, match_lens, lengths):
            req.cls = self.acceptance.cls(n)
            survival.append(np.cumprod(np.minimum(1.0, req.factor * self.acceptance.right(req.cls, k))))
        keep = allocate(survival, base, self.cost)
        for req, k in zip(reqs, keep):
            if not k:  # left out: its record fades, so it is tried again later
                req.accepted *= REQUEST_IDLE_DECAY
                req.expected *= REQUEST_IDLE_DECAY
        return keep

    def record(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        req = self._requests.setdefault(req_id, _Request())
        req.expected = REQUEST_DECAY * req.expected + float(self.acceptance.survival(req.cls, num_drafts).sum())
        req.accepted = REQUEST_DECAY * req.accepted + num_accepted
        self.acceptance.update(req.cls, num_drafts, num_accepted)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """The wall time of a step that only decoded (with or without drafts)."""
        self.cost.observe(num_tokens, seconds)

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
