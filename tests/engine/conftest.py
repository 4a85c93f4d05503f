"""Engine fixtures: the embedded model and a tiny random Llama sharing its tokenizer."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from pagedllm.models.loader import load_checkpoint

    return load_checkpoint(None).path
