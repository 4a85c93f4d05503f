"""Structured outputs (JSON schema, JSON object, regex, choice, EBNF grammar) on xgrammar.

``StructuredOutputsParams`` says what the output must match; ``GrammarCompiler`` turns it into a
compiled grammar (cached by kind and spec); a ``GrammarState`` per sequence fills that sequence's
row of the step's token bitmask and advances on every accepted token; ``apply_bitmask`` masks the
batch's logits in place before sampling.
"""

from pagedllm.structured.compiler import GrammarCompiler
from pagedllm.structured.params import StructuredOutputsParams
from pagedllm.structured.state import GrammarState, allocate_bitmask, apply_bitmask

__all__ = ["GrammarCompiler", "GrammarState", "StructuredOutputsParams", "allocate_bitmask", "apply_bitmask"]
