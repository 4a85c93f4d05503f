"""A broken GGUF fails with a ValueError naming the file and what is wrong, not a numpy reshape error."""

from __future__ import annotations

import pytest

from pagedllm.models.loader import default_model_path, load_checkpoint


@pytest.fixture(scope="module")
def gguf_bytes() -> bytes:
    with open(default_model_path(), "rb") as f:
        return f.read()


@pytest.mark.parametrize("cut, match", [(100, "truncated or corrupt"), (5_000_000, "truncated or corrupt"),
                                        (0, "not a GGUF file")])
def test_broken_gguf_names_file_and_fault(tmp_path, gguf_bytes, cut, match):
    path = tmp_path / "broken.gguf"
    path.write_bytes(gguf_bytes[:cut] if cut else b"NOTAGGUF" * 64)
    with pytest.raises(ValueError, match=match) as e:
        load_checkpoint(str(path))
    assert str(path) in str(e.value)
