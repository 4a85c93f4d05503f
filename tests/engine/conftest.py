"""Engine fixtures: the embedded model's path."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from pagedllm.models.loader import load_checkpoint

    return load_checkpoint(None).path
