"""Engine fixtures: the embedded model's path."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The embedded GGUF; ``PAGEDLLM_TEST_MODEL_DIR`` (a random-weight model of its shape) where the GGUF cannot
    travel, as for ``smollm2_dir`` (scripts/gpu_check.sh)."""
    if os.environ.get("PAGEDLLM_TEST_MODEL_DIR"):
        return os.environ["PAGEDLLM_TEST_MODEL_DIR"]
    from pagedllm.models.loader import load_checkpoint

    return load_checkpoint(None).path
