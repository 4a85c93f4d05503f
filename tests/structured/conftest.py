"""A grammar compiler over the embedded SmolLM2 tokenizer, shared by the module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)


@pytest.fixture(scope="session")
def compiler(tokenizer):
    from pagedllm.structured import GrammarCompiler

    return GrammarCompiler(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[tokenizer.eos_token_id])
