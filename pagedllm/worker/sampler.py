"""Sampling for the whole batch at once: logit bias, penalties, min_tokens, temperature, top-k/p, min-p,
logprobs, with no host sync.

Every transform is one tensor op over ``[rows, vocab]``; each row's settings are gathered into tensors
once per step (one host-to-device copy) from the host-side ``SamplingParams``, and which rows are
greedy or filtered is decided on the host from those params, never by reading a device tensor back.
The random draw is the exponential race, ``argmax(p / E)`` with ``E ~ Exp(1)``, whose noise is a
counter-based hash of (the row's noise key, the sequence's length, the token id) (:mod:`noise`): a
seeded request's samples depend on its seed, sample index and position only, never on its batch
mates, with no per-row generator and no ``torch.multinomial``. Logprobs come back as tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm import ops
from pagedllm.protocol.logit_bias import apply_logit_bias
from pagedllm.protocol.sampling_params import SamplingParams
from pagedllm.worker.noise import exponential_noise


@dataclass
class SamplingBatch:
    """The settings and histories of the rows being sampled, one entry per logits row."""

    params: list[SamplingParams]
    noise_keys: torch.Tensor  # [R] int64: each row's 32-bit noise key (seed and sample index, or random)
    token_ids: torch.Tensor  # [R, width] prompt + output so far (only read when a penalty is set)
    num_prompt: torch.Tensor  # [R]
    num_tokens: torch.Tensor  # [R]: the sequence's length, also the noise's counter


@dataclass
class SampleResult:
    token_ids: torch.Tensor  # [R] int64
    logprobs: torch.Tensor  # [R] float32: log-probability of each sampled token (raw model distribution)
    top_ids: torch.Tensor | None  # [R, 1 + k]: the sampled token, then the top k (when any row asked)
    top_logprobs: torch.Tensor | None


def row_settings(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Per-row settings as a tensor on ``device``: through pinned memory, without waiting, on an accelerator."""
    t = torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition (prompt + output), presence and frequency (output) penalties, as in vLLM. Only the tokens of a
    row's history (``batch.token_ids``, as wide as the longest) change, so they are gathered, adjusted and scattered
    back; output counts come from one scatter. The same values as adjusting whole ``[rows, vocab]`` masks, which
    took 21-24 ms a step at 64 rows of a 49,152-token vocabulary (Zen 4)."""
    params = batch.params
    if all(p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 for p in params):
        return logits
    dev = logits.device
    toks = batch.token_ids.to(dev)
    if toks.shape[1] == 0:
        return logits
    pos = torch.arange(toks.shape[1], device=dev)[None, :]
    valid = pos < batch.num_tokens.to(dev)[:, None]
    is_out = valid & (pos >= batch.num_prompt.to(dev)[:, None])
    # slots past a row's length repeat its first token, which they write with that token's own adjusted value
    toks = torch.where(valid, toks, toks[:, :1])
    rep, freq, pres = row_settings([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params],
                                   logits.dtype, dev).unbind(1)
    x = logits.gather(1, toks)
    x = torch.where(x > 0, x / rep[:, None], x * rep[:, None])
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        counts = torch.zeros_like(logits).scatter_add_(1, toks, is_out.to(logits.dtype)).gather(1, toks)
        x = x - freq[:, None] * counts - pres[:, None] * (counts > 0).to(logits.dtype)
    return logits.scatter(1, toks, x)


def suppress_stop_tokens(logits: torch.Tensor, batch: SamplingBatch, eos_ids: list[int]) -> torch.Tensor:
    """min_tokens: stop tokens cannot be sampled before a sequence has that many outputs (the count is
    compared on the device; the banned ids of each row are padded with its first)."""
    banned = [sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))) if p.min_tokens else []
              for p in batch.params]
    width = max(map(len, banned))
    if not width:
        return logits
    dev = logits.device
    ids = row_settings([b + (b[:1] or [0]) * (width - len(b)) for b in banned], torch.int64, dev)
    min_tokens = row_settings([p.min_tokens for p in batch.params], torch.int64, dev)
    early = (batch.num_tokens - batch.num_prompt).to(dev) < min_tokens
    vals = logits.gather(1, ids).masked_fill(early[:, None], float("-inf"))
    return logits.scatter(1, ids, vals)


def filter_logits(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens outside top-k, the top-p nucleus and the min-p floor (per-row settings)."""
    sorted_logits, idx = scaled.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    ranks = torch.arange(scaled.shape[1], device=scaled.device)[None, :]
    drop = ranks >= top_k[:, None]
    drop |= (probs.cumsum(-1) - probs) > top_p[:, None]  # the most likely token always stays
    drop |= probs < min_p[:, None] * probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, idx, sorted_logits)


def sample_random(logits: torch.Tensor, params: list[SamplingParams], noise_keys: torch.Tensor,
                  counters: torch.Tensor) -> torch.Tensor:
    """Draw one token per row (all rows have a temperature > 0): temperature, top-k/p and min-p, then
    the exponential race over the row's hashed noise."""
    dev, vocab = logits.device, logits.shape[1]
    temps = row_settings([p.temperature for p in params], torch.float32, dev)
    if not any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
        return exponential_race(logits, temps, noise_keys, counters)
    top_k = row_settings([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], torch.int64, dev)
    top_p, min_p = row_settings([[p.top_p, p.min_p] for p in params], torch.float32, dev).unbind(1)
    # on the CPU the same rules without sorting whole rows (64 rows of 49,152 logits, Zen 4: top-p 0.9 137-158 -> 6 ms,
    # top-k 50 142-148 -> 3.5)
    if _cpu_race(logits):
        return torch.ops.pagedllm.filtered_race.default(logits.contiguous(), temps, top_k, top_p.contiguous(),
                                                        min_p.contiguous(), *_race_keys(noise_keys, counters))
    scaled = filter_logits(logits / temps[:, None], top_k, top_p, min_p)
    return exponential_race(scaled, torch.ones_like(temps), noise_keys, counters)


def _cpu_race(logits: torch.Tensor) -> bool:
    """Whether the races run as ``ops/csrc/sampling.cpp``'s ops: fp32 CPU logits, the kernel built."""
    return logits.is_cpu and logits.dtype == torch.float32 and logits.dim() == 2 and ops.load("sampling")


def _race_keys(noise_keys: torch.Tensor, counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return noise_keys.to(torch.int64).contiguous(), counters.to(torch.int64).contiguous()


def exponential_race(logits: torch.Tensor, temps: torch.Tensor, noise_keys: torch.Tensor,
                     counters: torch.Tensor) -> torch.Tensor:
    """Each row's draw ``argmax(softmax(logits / temps) / E)`` (``temps`` > 0), E the rows' hashed Exp(1) noise.
    On the CPU one C++ op reading each row twice (``ops/csrc/sampling.cpp``: 64 rows of a 49,152-token vocabulary
    14.8 -> 3.0 ms on a Zen 4), else tensor ops; the two draw alike up to rounding in near-ties."""
    if _cpu_race(logits):
        return torch.ops.pagedllm.exponential_race.default(logits.contiguous(), temps.float().contiguous(),
                                                           *_race_keys(noise_keys, counters))
    probs = (logits / temps[:, None]).softmax(-1)
    return (probs / exponential_noise(noise_keys, counters, logits.shape[1])).argmax(-1)


def is_plain(p: SamplingParams) -> bool:
    """Greedy or temperature-only sampling of the chosen token's logprob: what :func:`sample_plain` does
    (no filter, penalty, bias, min_tokens or top logprobs), so it can run inside a decode graph."""
    return (p.top_k <= 0 and p.top_p == 1.0 and p.min_p == 0.0 and p.repetition_penalty == 1.0
            and not p.presence_penalty and not p.frequency_penalty and not p.logit_bias and not p.min_tokens
            and p.logprobs is None)


def greedy_and_normaliser(logits: torch.Tensor, need_all: bool
                          ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Each row's argmax, and either the whole log-softmax (``need_all``: top logprobs were asked for) or only the
    rows' logsumexp, from which a chosen token's logprob is ``logit - lse``. On the CPU the second is one C++ pass
    per row (``ops/csrc/sampling.cpp``) that writes no ``[rows, vocab]`` buffer."""
    if not need_all and logits.is_cpu and logits.dtype == torch.float32 and logits.dim() == 2:
        if ops.load("sampling"):
            tokens, lse = torch.ops.pagedllm.argmax_logsumexp.default(logits.contiguous())
            return tokens, None, lse
    if not need_all:
        return logits.argmax(-1), None, logits.logsumexp(-1)
    return logits.argmax(-1), logits.log_softmax(-1), None


def sample_plain(logits: torch.Tensor, temperature: torch.Tensor, noise_keys: torch.Tensor, counters: torch.Tensor,
                 random: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and their logprobs for rows of plain settings (temperature 0: greedy), by one fixed sequence of
    ops with every setting read from tensors: capturable in a graph. ``random`` False: every row is greedy.
    Draws what :class:`Sampler` draws for the same rows."""
    logits = logits.float()
    tokens, _, lse = greedy_and_normaliser(logits, need_all=False)
    if random:
        t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
        tokens = torch.where(temperature > 0, exponential_race(logits, t, noise_keys, counters), tokens)
    return tokens, logits.gather(1, tokens[:, None])[:, 0] - lse


class Sampler:
    def __init__(self, eos_token_ids: list[int]):
        self.eos_token_ids = list(eos_token_ids)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
        """One token per row of ``logits`` (never written: the model runner passes the step's own)."""
        params = batch.params
        dev = logits.device
        logits = logits.float().clone() if any(p.logit_bias for p in params) else logits.float()
        apply_logit_bias(logits, [p.logit_bias for p in params])
        logits = apply_penalties(logits, batch)
        logits = suppress_stop_tokens(logits, batch, self.eos_token_ids)
        asked = [p.logprobs for p in params if p.logprobs is not None]
        tokens, logprobs_all, lse = greedy_and_normaliser(logits, need_all=bool(asked))
        rand = [i for i, p in enumerate(params) if p.temperature > 0]  # decided on the host, from the params
        if len(rand) == len(params):
            tokens = sample_random(logits, params, batch.noise_keys.to(dev), batch.num_tokens.to(dev))
        elif rand:
            idx = row_settings(rand, torch.int64, dev)
            drawn = sample_random(logits.index_select(0, idx), [params[i] for i in rand],
                                  batch.noise_keys.to(dev).index_select(0, idx),
                                  batch.num_tokens.to(dev).index_select(0, idx))
            tokens = tokens.index_copy(0, idx, drawn)

        if logprobs_all is not None:
            chosen = logprobs_all.gather(1, tokens[:, None])[:, 0]
        else:
            chosen = logits.gather(1, tokens[:, None])[:, 0] - lse
        top_ids = top_vals = None
        if asked:
            k = max(max(asked), 1)
            vals, ids = logprobs_all.topk(k, dim=-1)
            top_ids = torch.cat([tokens[:, None], ids], 1)
            top_vals = torch.cat([chosen[:, None], vals], 1)
        return SampleResult(tokens, chosen, top_ids, top_vals)
