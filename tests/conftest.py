"""Shared fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """HF-format directory of the embedded SmolLM2-135M-Instruct (converted from its GGUF once,
    then cached): the oracle's path for ``AutoModelForCausalLM/AutoTokenizer.from_pretrained``."""
    from pagedllm.models import load_checkpoint

    return load_checkpoint(None).path
