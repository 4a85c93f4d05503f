"""Compiled grammars for one tokenizer, cached by (kind, spec): a schema every request repeats
(a tool's parameters, a response_format) compiles once."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import xgrammar as xgr

from pagedllm.structured.params import StructuredOutputsParams
from pagedllm.structured.state import GrammarState

DEFAULT_CACHE_ENTRIES = 256


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly ``choices`` (JSON string literals are valid EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """xgrammar's compiler over one tokenizer, with an LRU of compiled grammars.

    ``vocab_size`` is the model's logits width (it may exceed the tokenizer's vocabulary);
    ``stop_token_ids`` end a completed grammar (the engine's EOS ids).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int] | None = None,
                 max_entries: int = DEFAULT_CACHE_ENTRIES, max_threads: int = 1):
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.max_entries = max_entries
        self.hits = 0
        self.misses = 0

    def parse(self, params: StructuredOutputsParams) -> xgr.Grammar:
        """The spec as a grammar, without the tokenizer (well under a millisecond even for a spec whose
        compile takes seconds): how a bad spec is refused at once. ValueError naming the field."""
        kind, spec = params.key()
        try:
            if kind == "json":
                return xgr.Grammar.from_json_schema(spec, any_whitespace=False)
            if kind == "json_object":  # OpenAI's json_object promises an object, not any JSON value
                return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return xgr.Grammar.from_regex(spec)
            if kind == "choice":
                return xgr.Grammar.from_ebnf(choice_grammar(json.loads(spec)))
            return xgr.Grammar.from_ebnf(spec)
        except (RuntimeError, ValueError) as e:  # xgrammar reports bad specs as RuntimeError
            raise ValueError(f"structured_outputs.{kind} cannot be compiled: {e}") from e

    def cached(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar | None:
        """The compiled grammar for ``params`` if it is in the cache (counted as a hit), else None."""
        key = params.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.hits += 1
                return self._cache[key]
        return None

    def compile(self, params: StructuredOutputsParams, grammar: xgr.Grammar | None = None) -> xgr.CompiledGrammar:
        """The compiled grammar for ``params`` (``grammar``: its ``parse``, if the caller has it); ValueError
        naming the field if the spec is invalid. xgrammar releases the GIL while it compiles, so this may run
        on a thread beside the engine's steps."""
        compiled = self.cached(params)
        if compiled is not None:
            return compiled
        grammar = grammar if grammar is not None else self.parse(params)
        try:
            compiled = self._compiler.compile_grammar(grammar)
        except RuntimeError as e:
            raise ValueError(f"structured_outputs.{params.kind} cannot be compiled: {e}") from e
        with self._lock:
            self.misses += 1
            self._cache[params.key()] = compiled
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return compiled

    def state(self, params: StructuredOutputsParams) -> GrammarState:
        """A fresh per-sequence matcher for ``params``."""
        return GrammarState(self.compile(params))
