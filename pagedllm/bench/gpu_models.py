"""Random-weight Hugging Face checkpoints of real shapes, made where the GPU check runs (no weights travel; the
embedded model's tokenizer does). Throughput and the engine's agreement with HF on the same weights do not
depend on trained weights.

usage: python -m pagedllm.bench.gpu_models OUT_DIR --tokenizer DIR [--shapes llama-1b,qwen2-bias] [--device cuda]
"""

from __future__ import annotations

import argparse
import os

import torch

# name -> (architecture, config overrides); vocab and special tokens come from the tokenizer
SHAPES: dict[str, tuple[str, dict]] = {
    # issue 30's Llama shape: 1.07 B parameters
    "llama-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                               num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=True)),
    # a small Qwen2: q/k/v projections with biases, GQA group 4
    "qwen2-bias": ("qwen2", dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                                 num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True)),
    # SmolLM2-135M's shape: what the test suite's smollm2 fixtures load where the embedded GGUF is absent
    "smollm2-shape": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                                    tie_word_embeddings=True, rope_theta=100000.0)),
    # two layers: the dry run on a CPU
    "tiny": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True)),
}


def make_model(shape: str, tokenizer_dir: str, out_dir: str, device: str = "cpu", seed: int = 0) -> str:
    """Save a random-weight checkpoint of ``shape`` (bf16 on a GPU, fp32 on the CPU) with the tokenizer beside
    it; returns its directory."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    arch, overrides = SHAPES[shape]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    cfg = config_cls(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **overrides)
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    with torch.device(device):
        model = model_cls(cfg).to(dtype)
    path = os.path.join(out_dir, shape)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pagedllm.bench.gpu_models", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--tokenizer", required=True, help="directory of the tokenizer the models use")
    p.add_argument("--shapes", default="llama-1b,qwen2-bias,smollm2-shape")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    for shape in a.shapes.split(","):
        print(make_model(shape, a.tokenizer, a.out_dir, a.device), flush=True)


if __name__ == "__main__":
    main()
