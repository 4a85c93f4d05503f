"""GGUF -> (transformers config, HF-named float32 state dict, tokenizer).

GGUF stores llama.cpp tensor names, metadata keys and quantized blocks; everything downstream
(our model, the HF oracle, the safetensors cache) speaks Hugging Face names and float32, so
the conversion happens once here.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
import torch
from gguf.quants import dequantize

from pagedllm.models.quant import QuantizedWeight
from pagedllm.ops.gguf_blocks import BLOCK_BYTES

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

# general.architecture -> HF architecture; Mistral GGUFs also say "llama" (same tensors).
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def supported_quant_types() -> set[gguf.GGMLQuantizationType]:
    """Types ``gguf.quants.dequantize`` can decode: F32/F16 natively, plus every quant class it ships."""
    Q = gguf.GGMLQuantizationType
    return {Q.F32, Q.F16} | {
        getattr(gguf.quants, t.name).qtype for t in Q if isinstance(getattr(gguf.quants, t.name, None), type)
    }


def hf_tensor_name(gguf_name: str) -> str:
    """Map a llama.cpp tensor name to the transformers Llama/Qwen parameter name."""
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES and kind == "weight":
        return f"{_GLOBAL_NAMES[base]}.weight"
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Llama/Qwen counterpart; pagedllm cannot place it")


def _unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert permutation of q/k rows: it interleaves each head's two rotary
    halves (rows viewed as [head, 2, d/2] -> [head, d/2, 2]) for its GPT-J style RoPE; HF Llama
    rotates halves, so the view goes back ([head, d/2, 2] -> [head, 2, d/2])."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_rows(arch: str, name: str, w: np.ndarray, heads: int, kv_heads: int) -> np.ndarray:
    """Rows of tensor ``name`` in HF order (llama q/k are permuted; whole rows move, so this works on
    dequantized values and on rows of quantized blocks alike)."""
    if arch == "llama" and name.split(".")[-2] in ("attn_q", "attn_k"):
        return _unpermute_rotary(w, heads if ".attn_q." in name else kv_heads)
    return w


class _Meta:
    """Typed access to GGUF key/value metadata with clear errors for missing keys."""

    def __init__(self, reader: gguf.GGUFReader, path: str):
        self.fields, self.path = reader.fields, path

    def get(self, key: str, default: Any = ...) -> Any:
        field = self.fields.get(key)
        if field is None:
            if default is ...:
                raise ValueError(f"GGUF {self.path} lacks metadata key {key!r}")
            return default
        return field.contents()


def _hf_config(meta: _Meta, arch: str, tied: bool) -> PretrainedConfig:
    """Build the transformers config from ``<arch>.*`` and ``tokenizer.ggml.*`` metadata."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    def a(key: str, default: Any = ...) -> Any:
        return meta.get(f"{arch}.{key}", default)

    def f32(key: str, default: Any = ...) -> float:
        """GGUF floats are float32: take the shortest decimal that rounds to it (9.9999997e-06 -> 1e-05)."""
        return float(str(np.float32(a(key, default))))

    scaling = a("rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported (supported: none, linear)")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": f32("rope.freq_base", 10000.0)}
    if scaling == "linear":
        rope |= {"rope_type": "linear", "factor": f32("rope.scaling.factor")}
    heads = int(a("attention.head_count"))
    hidden = int(a("embedding_length"))
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    return cls(
        architectures=[GGUF_ARCHITECTURES[arch]],
        vocab_size=len(meta.get("tokenizer.ggml.tokens")),
        hidden_size=hidden,
        intermediate_size=int(a("feed_forward_length")),
        num_hidden_layers=int(a("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(a("attention.head_count_kv", heads)),
        head_dim=int(a("attention.key_length", hidden // heads)),
        rms_norm_eps=f32("attention.layer_norm_rms_epsilon"),
        rope_parameters=rope,
        max_position_embeddings=int(a("context_length")),
        tie_word_embeddings=tied,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id", None),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id", None),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id", None),
        dtype="float32",
    )


GGUF_MAGIC = b"GGUF"


def open_gguf(path: str) -> gguf.GGUFReader:
    """The file's reader; a file that is not a GGUF, or is cut short or corrupt, is a ValueError naming
    the file and what is wrong (gguf's own errors name neither)."""
    with open(path, "rb") as f:
        head = f.read(4)
    size = os.path.getsize(path)
    if head != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file: it starts with {head!r}, not the magic {GGUF_MAGIC!r}")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, MemoryError) as e:
        raise ValueError(f"GGUF {path} is truncated or corrupt ({size} bytes): its header, tensor table or "
                         f"tensor data do not fit the file ({type(e).__name__}: {e})") from e
    return reader


def read_gguf(path: str) -> tuple[PretrainedConfig, dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """Dequantize every tensor of a Llama/Qwen2/Qwen3 GGUF to float32 under its HF name; also return the
    matrices stored in a block format the kernels read (Q4_1, Q8_0) still quantized, in HF row order.

    Checks architecture and quantization types before any dequantization so that bad files fail
    in milliseconds, with the supported options in the message.
    """
    reader = open_gguf(path)
    meta = _Meta(reader, path)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} in {path}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    supported = supported_quant_types()
    bad = sorted({t.tensor_type.name for t in reader.tensors if t.tensor_type not in supported})
    if bad:
        raise ValueError(
            f"GGUF {path} uses unsupported quantization type(s) {', '.join(bad)}; "
            f"supported: {', '.join(sorted(t.name for t in supported))}"
        )
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"GGUF {path} carries llama3-style rope_freqs, which pagedllm cannot map; use the HF directory")
    config = _hf_config(meta, arch, tied="output.weight" not in names)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    state: dict[str, torch.Tensor] = {}
    blocks: dict[str, QuantizedWeight] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        w = _hf_rows(arch, t.name, dequantize(t.data, t.tensor_type), heads, kv_heads)
        state[name] = torch.from_numpy(np.require(w, np.float32, ["C", "W"]))  # copies mmap views
        qtype = int(t.tensor_type.value)
        if qtype in BLOCK_BYTES and t.data.ndim == 2:
            rows = np.array(_hf_rows(arch, t.name, t.data, heads, kv_heads), order="C")  # a copy: not the mmap
            blocks[name] = QuantizedWeight(torch.from_numpy(rows), qtype, tuple(w.shape))
    return config, state, blocks


def read_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Tokenizer + chat template rebuilt from ``tokenizer.ggml.*`` metadata by transformers itself."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path), local_files_only=True
    )
