"""Random-weight tiny Hugging Face models of each supported architecture, for tests and benchmarks.

``tiny_hf_model("qwen2")`` returns ``(hf_model, ModelConfig)``: the HF model is the oracle, and
``LlamaForCausalLM(cfg).load_hf_state_dict(hf_model.state_dict())`` is ours with the same weights.
"""

from __future__ import annotations

import torch

from pagedllm.models.config import ModelConfig

TINY_ARCHS = ("qwen2", "llama3", "llama_bias", "mistral", "qwen3")


def tiny_hf_config(arch: str = "qwen2", max_positions: int = 2048, vocab: int = 256, kv_heads: int = 2):
    """A small config: 2 layers, hidden 64, 4 heads, ``kv_heads`` KV heads (GQA; 1, 2 or 4), head_dim 16."""
    import transformers as tf

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        initializer_range=0.1,  # larger than default: clear top-1 margins for greedy equality
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "qwen2":  # qkv bias, untied lm_head
        return tf.Qwen2Config(**common, tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"])
    if arch == "qwen3":  # per-head q/k RMSNorm, explicit head_dim
        return tf.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"])
    if arch == "llama3":  # llama3 rope scaling, tied embeddings
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64, "rope_theta": 500000.0}
        return tf.LlamaConfig(**common, rope_parameters=scaling, tie_word_embeddings=True,
                              architectures=["LlamaForCausalLM"])
    if arch == "llama_bias":  # attention_bias: bias on q/k/v and o_proj; linear rope scaling
        return tf.LlamaConfig(**common, attention_bias=True, tie_word_embeddings=False,
                              rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                              architectures=["LlamaForCausalLM"])
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=None, tie_word_embeddings=False,
                                architectures=["MistralForCausalLM"])
    raise ValueError(f"unknown tiny arch {arch!r}; choose one of {', '.join(TINY_ARCHS)}")


def tiny_hf_model(arch: str = "qwen2", seed: int = 0, **kw):
    """``(hf_model in eval mode, fp32, ModelConfig)`` with random weights drawn from ``seed``."""
    from transformers import AutoModelForCausalLM

    hf_cfg = tiny_hf_config(arch, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # HF zero-inits biases and norms: randomise them so they are exercised
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model, ModelConfig.from_hf(hf_cfg)
