"""The front end's half of a request: token-id deltas from the engine core become text, stop
strings and ``RequestOutput``s.

Text grows incrementally (the tokenizers library's ``DecodeStream``: one token in, the new text
out) and stop strings are searched only in the new text plus the overlap a stop string can
straddle, so the work per token does not grow with the output length. ``tokens_decoded`` and
``chars_scanned`` count that work (a test holds it constant per token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers.decoders import DecodeStream

from pagedllm.protocol.core_io import EngineCoreOutput, SeqDelta
from pagedllm.protocol.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.protocol.sampling_params import SamplingParams


@dataclass
class _SampleState:
    """One sample's text as it grows."""

    stream: DecodeStream
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    scan_from: int | None = None  # stop strings may start at this character or later (min_tokens)
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    samples: dict[int, _SampleState] = field(default_factory=dict)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0
    finished: bool = False


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        self.requests: dict[str, _RequestState] = {}
        self.tokens_decoded = 0
        self.chars_scanned = 0

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float) -> None:
        self.requests[request_id] = _RequestState(
            request_id, prompt, list(prompt_token_ids), params, RequestMetrics(arrival_time=arrival_time),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None)

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def _sample(self, st: _RequestState, index: int) -> _SampleState:
        s = st.samples.get(index)
        if s is None:
            s = st.samples[index] = _SampleState(DecodeStream(skip_special_tokens=st.params.skip_special_tokens),
                                                 logprobs=[] if st.params.logprobs is not None else None)
        return s

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[tuple[str, int, str]]]:
        """Fold the core's deltas in. Returns the updated requests' outputs, and the samples whose
        text hit a stop string as (request id, sample index, stop string): tell the core to finish them."""
        results, stops = [], []
        for out in outputs:
            st = self.requests.get(out.request_id)
            if st is None:
                continue
            if out.metrics is not None:
                st.metrics = out.metrics
            st.num_cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs is not None and st.prompt_logprobs is not None:
                st.prompt_logprobs += out.prompt_logprobs.as_dicts(1 + st.params.prompt_logprobs)
            for d in out.seqs:
                hit = self._apply(st, d)
                if hit is not None:
                    stops.append((st.request_id, d.index, hit))
            width = st.params.best_of or st.params.n
            samples = [s for i, s in sorted(st.samples.items()) if i < width]
            st.finished = out.finished or (len(samples) >= width and all(s.finish_reason for s in samples))
            results.append(self._request_output(st))
            if out.error is not None:
                st.finished = results[-1].finished = True
                results[-1].error = out.error
            if st.finished:
                self.requests.pop(st.request_id, None)
        return results, stops

    def _apply(self, st: _RequestState, d: SeqDelta) -> str | None:
        p = st.params
        s = self._sample(st, d.index)
        s.cumulative_logprob = d.cumulative_logprob
        if d.replace:  # beam search: the whole hypothesis, decoded once
            s.token_ids = list(d.new_token_ids)
            s.text = self.tokenizer.decode(s.token_ids, skip_special_tokens=p.skip_special_tokens)
            s.finish_reason, s.stop_reason = d.finish_reason, d.stop_reason
            return None
        if s.finish_reason is not None:  # finished here on a stop string; the core's late tokens are dropped
            return None
        if d.logprobs is not None and s.logprobs is not None:
            s.logprobs += d.logprobs.as_dicts()
        hit = None
        for tok in d.new_token_ids:
            s.token_ids.append(tok)
            before = len(s.text)
            self.tokens_decoded += 1
            piece = s.stream.step(self._backend, tok)
            if piece:
                s.text += piece
            if p.stop and len(s.token_ids) >= max(p.min_tokens, 1):
                if s.scan_from is None:  # text before the min_tokens-th token is exempt
                    s.scan_from = before
                hit = self._find_stop(s, p, before)
                if hit is not None:
                    break
        if hit is None and d.finish_reason is not None:
            s.finish_reason, s.stop_reason = d.finish_reason, d.stop_reason
            # one whole decode at the end: exactly the tokenizer's text (incomplete UTF-8 included)
            s.text = self.tokenizer.decode(s.token_ids, skip_special_tokens=p.skip_special_tokens)
        return hit

    def _find_stop(self, s: _SampleState, p: SamplingParams, before: int) -> str | None:
        """Search the new text (plus the overlap a stop string can straddle) for the earliest stop."""
        start = max(s.scan_from or 0, before - max(len(x) for x in p.stop) + 1)
        window = s.text[start:]
        self.chars_scanned += len(window)
        hits = [(i, x) for x in p.stop if (i := window.find(x)) >= 0]
        if not hits:
            return None
        pos, stop = min(hits)
        keep = start + pos + (len(stop) if getattr(p, "include_stop_str_in_output", False) else 0)
        s.text = s.text[:keep]
        s.finish_reason, s.stop_reason = "stop", stop
        return stop

    def _request_output(self, st: _RequestState) -> RequestOutput:
        chosen = sorted(st.samples.items())
        if st.params.best_of and st.params.best_of > st.params.n:  # vLLM: the n best of best_of by logprob
            chosen = sorted(chosen, key=lambda kv: -kv[1].cumulative_logprob) if st.finished else chosen
        outs = [CompletionOutput(index=i, text=s.text, token_ids=list(s.token_ids), finish_reason=s.finish_reason,
                                 cumulative_logprob=s.cumulative_logprob,
                                 logprobs=None if s.logprobs is None else list(s.logprobs), stop_reason=s.stop_reason)
                for i, (_, s) in enumerate(chosen[: st.params.n])]
        out = RequestOutput(st.request_id, st.prompt, st.prompt_token_ids, outs, st.finished, st.metrics,
                            num_cached_tokens=st.num_cached_tokens)
        if st.prompt_logprobs is not None:
            out.prompt_logprobs = list(st.prompt_logprobs)
        return out
