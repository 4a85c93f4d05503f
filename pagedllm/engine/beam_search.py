"""Beam search over forked sequences, with Hugging Face ``generate(num_beams=W, do_sample=False)``
semantics: ``max(2, 1 + #eos) * W`` candidates a step; a candidate ending in EOS (or reaching
``max_tokens``) becomes a hypothesis scored ``sum_logprobs / generated_len ** length_penalty``
only if it ranks in the top W; the W best others continue. ``early_stopping=True`` is used:
search stops once W hypotheses are finished (or HF's no-improvement heuristic says so).

Beams that continue from the same parent fork it (blocks shared, copy-on-write on the partial
block); beams that are dropped release their blocks at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagedllm.engine.outputs import CompletionOutput
from pagedllm.engine.sequence import Request, Sequence, SequenceStatus

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine

NEG = -1.0e9


@dataclass
class BeamState:
    slots: list[tuple[float, list[int], float]] = field(default_factory=list)  # (score, tokens, sum logprob)
    improvable: bool = True


class BeamSearch:
    def __init__(self, engine: "LLMEngine"):
        self.engine = engine
        self.states: dict[str, BeamState] = {}

    def step(self, seqs: list[Sequence], logits: torch.Tensor) -> list[Request]:
        """Advance every beam request whose live beams all produced logits this step."""
        by_req: dict[str, list[int]] = {}
        for i, s in enumerate(seqs):
            by_req.setdefault(s.request.request_id, []).append(i)
        done = []
        logprobs = logits.float().log_softmax(-1)
        for rows in by_req.values():
            req = seqs[rows[0]].request
            self._advance(req, [seqs[i] for i in rows], logprobs[rows])
            done.append(req)
        return done

    def _advance(self, req: Request, beams: list[Sequence], logprobs: torch.Tensor) -> None:
        eng, p = self.engine, req.params
        width, vocab = p.beam_width, logprobs.shape[1]
        state = self.states.setdefault(req.request_id, BeamState())
        prompt_len = len(req.prompt_token_ids)
        cur_len = beams[0].num_tokens
        max_len = min(prompt_len + p.max_tokens, eng.max_model_len)
        eos = set() if p.ignore_eos else set(eng.eos_token_ids)
        keep = max(2, 1 + len(eos)) * width
        scores = torch.tensor([b.cumulative_logprob for b in beams])[:, None] + logprobs
        top_vals, top_idx = scores.flatten().topk(min(keep, scores.numel()))
        parents = (top_idx // vocab).tolist()
        tokens = (top_idx % vocab).tolist()
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
                eng.finish(b, "stop")
            req.seqs = beams
            return
        self._reassign(req, beams, [(parents[k], tokens[k], vals[k]) for k in running])

    def _reassign(self, req: Request, beams: list[Sequence], picks: list[tuple[int, int, float]]) -> None:
        """Turn the surviving candidates into sequences: reuse a parent once, fork it for more."""
        eng = self.engine
        used: set[int] = set()
        new_beams: list[tuple[Sequence, int, float]] = []
        for par, tok, val in picks:
            parent = beams[par]
            if par in used:
                child = parent.fork(len(new_beams), None)
                eng.kv.fork(parent.seq_id, child.seq_id)
                new_beams.append((child, tok, val))
            else:
                used.add(par)
                new_beams.append((parent, tok, val))
        for i, b in enumerate(beams):
            if i not in used:
                b.status, b.finish_reason = SequenceStatus.FINISHED, "abort"
                eng.kv.free(b.seq_id)
        for seq, tok, val in new_beams:
            seq.token_ids.append(tok)
            seq.cumulative_logprob = val
            seq.status = SequenceStatus.DECODING
            eng.stats.generation_tokens += 1
        req.seqs = [s for s, _, _ in new_beams]

    def outputs(self, req: Request) -> list[CompletionOutput]:
        """The n best hypotheses (finished first by score), live beams while the search runs."""
        state = self.states.get(req.request_id, BeamState())
        if req.finished:
            self.states.pop(req.request_id, None)
        ranked = [(score, toks, lp) for score, toks, lp in state.slots] or [
            (s.cumulative_logprob, s.output_token_ids, s.cumulative_logprob) for s in req.seqs]
        tok = self.engine.tokenizer
        skip = req.params.skip_special_tokens
        return [CompletionOutput(index=i, text=tok.decode(toks, skip_special_tokens=skip), token_ids=list(toks),
                                 finish_reason="stop" if req.finished else None, cumulative_logprob=lp)
                for i, (score, toks, lp) in enumerate(ranked[: req.params.n])]
