"""Beam search over forked sequences, with Hugging Face ``generate(num_beams=W, do_sample=False)``
semantics: ``max(2, 1 + #eos) * W`` candidates a step; a candidate ending in EOS (or reaching
``max_tokens``) becomes a hypothesis scored ``sum_logprobs / generated_len ** length_penalty``
only if it ranks in the top W; the W best others continue. ``early_stopping=True`` is used:
search stops once W hypotheses are finished (or HF's no-improvement heuristic says so).

Beams that continue from the same parent fork it (blocks shared, copy-on-write on the partial
block); beams that are dropped release their blocks at once. It works on the worker's per-beam
top-k logprobs (``candidates(req)`` of them: the global top-k over all beams is always inside
the union of each beam's top-k) and talks to the engine core only through ``fork_seq``,
``release_seq``, ``finish`` and ``beam_output``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from pagedllm.core.sequence import Request, Sequence
from pagedllm.protocol.step_io import Logprobs

NEG = -1.0e9


@dataclass
class BeamState:
    slots: list[tuple[float, list[int], float]] = field(default_factory=list)  # (score, tokens, sum logprob)
    improvable: bool = True


class BeamHost(Protocol):
    """What beam search needs of the engine core (and all it may touch there)."""

    eos_token_ids: list[int]
    max_model_len: int
    stats: Any  # its ``generation_tokens`` counts each token beam search emits

    def fork_seq(self, parent: Sequence, index: int) -> Sequence: ...

    def release_seq(self, seq: Sequence, reason: str = "abort") -> None: ...

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None: ...

    def beam_output(self, req: Request, hypotheses: list[tuple[list[int], float]]) -> None: ...


class BeamSearch:
    def __init__(self, core: BeamHost):
        self.core = core
        self.states: dict[str, BeamState] = {}

    def _eos(self, req: Request) -> set[int]:
        return set() if req.params.ignore_eos else set(self.core.eos_token_ids)

    def candidates(self, req: Request) -> int:
        """How many candidates a step keeps (HF: ``max(2, 1 + #eos) * W``): each beam's top that many."""
        return max(2, 1 + len(self._eos(req))) * req.params.beam_width

    def step(self, beams: list[tuple[Sequence, Logprobs]]) -> None:
        """Advance every beam request whose live beams all produced top-k logprobs this step."""
        by_req: dict[str, list[tuple[Sequence, Logprobs]]] = {}
        for seq, lp in beams:
            by_req.setdefault(seq.request.request_id, []).append((seq, lp))
        for group in by_req.values():
            req = group[0][0].request
            ids = torch.cat([lp.token_ids for _, lp in group])
            vals = torch.cat([lp.logprobs for _, lp in group])
            self._advance(req, [s for s, _ in group], ids, vals)
            self.core.beam_output(req, self.outputs(req))

    def _advance(self, req: Request, beams: list[Sequence], ids: torch.Tensor, logprobs: torch.Tensor) -> None:
        core, p = self.core, req.params
        width = p.beam_width
        state = self.states.setdefault(req.request_id, BeamState())
        prompt_len = len(req.prompt_token_ids)
        cur_len = beams[0].num_tokens
        max_len = min(prompt_len + p.max_tokens, core.max_model_len)
        eos = self._eos(req)
        keep = self.candidates(req)
        scores = torch.tensor([b.cumulative_logprob for b in beams])[:, None] + logprobs
        top_vals, top_idx = scores.flatten().topk(min(keep, scores.numel()))
        per_beam = ids.shape[1]
        parents = (top_idx // per_beam).tolist()
        tokens = ids.flatten()[top_idx].tolist()
        vals = top_vals.tolist()
        hits = [t in eos or cur_len + 1 >= max_len for t in tokens]

        # finished hypotheses: merge the top-W candidates that hit a stop with the kept slots
        full = len(state.slots) == width
        if state.improvable and not full:
            gen_len = cur_len + 1 - prompt_len
            for rank, (par, tok, val, hit) in enumerate(zip(parents, tokens, vals, hits)):
                if hit and rank < width:
                    state.slots.append((val / gen_len ** p.length_penalty,
                                        beams[par].output_token_ids + [tok], val))
            state.slots = sorted(state.slots, key=lambda s: -s[0])[:width]

        # the W best candidates that did not stop continue
        running = sorted(range(len(vals)), key=lambda k: -(vals[k] + (NEG if hits[k] else 0.0)))[:width]
        running = [k for k in running if not hits[k]]
        if running:
            best_running = vals[running[0]] / ((cur_len + 1 - prompt_len) ** p.length_penalty)
            worst = min(s[0] for s in state.slots) if len(state.slots) == width else NEG
            state.improvable = state.improvable and best_running > worst
        finished = (not running or not state.improvable or len(state.slots) == width)
        if finished:
            for b in beams:
                core.finish(b, "stop")
            req.seqs = beams
            return
        self._reassign(req, beams, [(parents[k], tokens[k], vals[k]) for k in running])

    def _reassign(self, req: Request, beams: list[Sequence], picks: list[tuple[int, int, float]]) -> None:
        """Turn the surviving candidates into sequences: reuse a parent once, fork it for more."""
        core = self.core
        used: set[int] = set()
        new_beams: list[tuple[Sequence, int, float]] = []
        for par, tok, val in picks:
            parent = beams[par]
            if par in used:
                new_beams.append((core.fork_seq(parent, len(new_beams)), tok, val))
            else:
                used.add(par)
                new_beams.append((parent, tok, val))
        for i, b in enumerate(beams):
            if i not in used:
                core.release_seq(b)
        for i, (seq, tok, val) in enumerate(new_beams):
            seq.index = i
            seq.token_ids.append(tok)
            seq.cumulative_logprob = val
            core.stats.generation_tokens += 1
        req.seqs = [s for s, _, _ in new_beams]

    def outputs(self, req: Request) -> list[tuple[list[int], float]]:
        """The n best hypotheses (finished first by score) as (output ids, sum logprob); the live
        beams while the search runs."""
        state = self.states.get(req.request_id, BeamState())
        if req.finished:
            self.states.pop(req.request_id, None)
        ranked = [(toks, lp) for _, toks, lp in state.slots] or [
            (s.output_token_ids, s.cumulative_logprob) for s in req.seqs]
        return [(list(toks), lp) for toks, lp in ranked[: req.params.n]]
