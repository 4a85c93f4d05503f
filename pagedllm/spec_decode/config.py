"""``SpeculativeConfig``: vLLM's ``speculative_config`` dict, validated, and the proposer it names.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    {"method": "suffix", "num_speculative_tokens": 8}
    {"method": "draft_model", "model": "small.gguf", "num_speculative_tokens": 4}
    {"method": "draft_model", "num_layers": 8, "num_speculative_tokens": 4}   # self-speculative
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from pagedllm.spec_decode.proposer import Proposer

METHODS = ("ngram", "suffix", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None  # ngram: longest n-gram matched (default 4)
    prompt_lookup_min: int | None = None  # ngram: shortest (default 1)
    model: str | None = None  # draft_model: a checkpoint with the target's tokenizer
    num_layers: int | None = None  # draft_model without a model: the target's first num_layers layers
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_min_token_prob: float = 0.1
    draft_num_blocks: int = 1024  # draft_model: 16-token blocks of the draft's own KV pool

    def __post_init__(self) -> None:
        def need_int(name: str, lo: int, optional: bool = False) -> None:
            v = getattr(self, name)
            if optional and v is None:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"speculative_config.{name} must be an int >= {lo}, got {v!r}")

        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {self.method!r}")
        need_int("num_speculative_tokens", 1)
        need_int("prompt_lookup_max", 1, optional=True)
        need_int("prompt_lookup_min", 1, optional=True)
        need_int("num_layers", 1, optional=True)
        need_int("suffix_decoding_max_tree_depth", 2)
        need_int("suffix_decoding_max_cached_requests", 0)
        need_int("draft_num_blocks", 1)
        if not isinstance(self.suffix_decoding_min_token_prob, (int, float)) or not (
                0.0 <= self.suffix_decoding_min_token_prob <= 1.0):
            raise ValueError("speculative_config.suffix_decoding_min_token_prob must be in [0, 1], "
                             f"got {self.suffix_decoding_min_token_prob!r}")
        if self.method != "ngram":
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config.{name} applies to method 'ngram', not {self.method!r}")
        if self.method == "ngram" and self.lookup_range[0] > self.lookup_range[1]:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.lookup_range[0]}) must be <= "
                             f"prompt_lookup_max ({self.lookup_range[1]})")
        if self.method == "draft_model":
            if (self.model is None) == (self.num_layers is None):
                raise ValueError("speculative_config.model or speculative_config.num_layers (self-speculative) "
                                 "must be given for method 'draft_model', not both")
        elif self.model is not None or self.num_layers is not None:
            field_name = "model" if self.model is not None else "num_layers"
            raise ValueError(f"speculative_config.{field_name} applies to method 'draft_model', not {self.method!r}")

    @property
    def lookup_range(self) -> tuple[int, int]:
        """(prompt_lookup_min, prompt_lookup_max) with vLLM's defaults filled in."""
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            return 1, 4
        if lo is None:
            return min(1, hi), hi
        return lo, hi if hi is not None else max(lo, 4)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SpeculativeConfig":
        """Parse vLLM's dict; ValueError names an unknown or missing key."""
        if not isinstance(d, Mapping):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        for name in ("method", "num_speculative_tokens"):
            if name not in d:
                raise ValueError(f"speculative_config.{name} is required")
        return cls(**d)


def make_proposer(config: SpeculativeConfig, target=None, backend=None) -> Proposer:
    """The proposer ``config`` names. ``draft_model`` needs the target ``LlamaForCausalLM`` (its
    layers for self-speculation, its vocabulary to check a separate draft) and an attention backend."""
    if config.method == "ngram":
        from pagedllm.spec_decode.ngram import NgramProposer

        return NgramProposer(*config.lookup_range)
    if config.method == "suffix":
        from pagedllm.spec_decode.suffix import SuffixProposer

        return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                              min_token_prob=config.suffix_decoding_min_token_prob)
    from pagedllm.spec_decode.draft_model import DraftModelProposer, load_draft, self_speculative_draft

    if target is None or backend is None:
        raise ValueError("speculative_config.method 'draft_model' needs the target model and an attention backend")
    if config.model is None:
        draft = self_speculative_draft(target, config.num_layers)
    else:
        draft = load_draft(config.model, target)
    return DraftModelProposer(draft, backend, config.draft_num_blocks)
