"""What a request may ask of this engine, checked before it is scheduled (front end and core alike)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.protocol.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int
    num_blocks: int
    block_size: int
    vocab_size: int

    def blocks_needed(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """Blocks a request can hold at its peak: the first sample's whole table, and for every other
        sample (or beam) its private blocks, the copy of a shared partial prompt block included."""
        bs = self.block_size
        total = min(num_prompt_tokens + params.max_tokens, self.max_model_len)
        width = params.beam_width if params.use_beam_search else (params.best_of or params.n)
        first = -(-total // bs)
        return first + (width - 1) * (first - num_prompt_tokens // bs)

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (naming the field) for anything this engine cannot serve."""
        params.validate()
        if not prompt_ids:
            raise ValueError("prompt must not be empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the context limit (max_model_len) is "
                             f"{self.max_model_len}, leaving no room to generate")
        vocab = self.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {vocab}), got {bad[:5]}")
        bias = getattr(params, "logit_bias", None) or {}
        bad = [t for t in bias if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab}), got {bad[:5]}")
        need = self.blocks_needed(len(prompt_ids), params)
        if need > self.num_blocks:
            raise ValueError(f"request needs up to {need} KV blocks but the pool has {self.num_blocks}; "
                             "shorten the prompt/max_tokens or enlarge the KV cache")
