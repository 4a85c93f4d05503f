"""LoRA test fixtures: PEFT adapters with random non-zero A and B, and HF + PEFT greedy decoding (the oracle)."""

from __future__ import annotations

import pytest
import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# 8 adapters that differ in rank, alpha, rsLoRA and targets
SPECS = [
    dict(r=8, lora_alpha=16, target_modules=ALL_TARGETS),
    dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    dict(r=16, lora_alpha=8, target_modules=ALL_TARGETS, use_rslora=True),
    dict(r=2, lora_alpha=4, target_modules=["o_proj", "down_proj"]),
    dict(r=8, lora_alpha=32, target_modules=["gate_proj", "up_proj"]),
    dict(r=1, lora_alpha=8, target_modules=["k_proj", "v_proj"]),
    dict(r=12, lora_alpha=6, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], use_rslora=True),
    dict(r=6, lora_alpha=12, target_modules=ALL_TARGETS),
]


def make_adapter(hf_model, path, seed: int, b_scale: float = 1.0, **lora_kwargs) -> str:
    """Save a PEFT LoRA adapter of ``hf_model`` with random A and B (B times ``b_scale``); the model is restored."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(hf_model, LoraConfig(init_lora_weights=False, **lora_kwargs))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(b_scale)
    peft_model.save_pretrained(str(path))
    peft_model.unload()
    return str(path)


def peft_greedy(hf_model, adapter: str | None, prompts: list[list[int]], n: int) -> list[list[int]]:
    """HF transformers (+ PEFT with ``adapter``) greedy continuations, each prompt alone, no EOS stop."""
    from peft import PeftModel

    model = hf_model if adapter is None else PeftModel.from_pretrained(hf_model, adapter)
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=0,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(seq[0, len(p):].tolist())
    if adapter is not None:
        model.unload()
    return outs


@pytest.fixture(scope="session")
def hf_with_adapters(tmp_path_factory):
    """``get(model_dir, seed) -> (HF fp32 model, the 8 SPECS adapters' paths)``, made once per model."""
    from transformers import AutoModelForCausalLM

    made: dict[str, tuple] = {}

    def get(model_dir: str, seed: int):
        if model_dir not in made:
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            root = tmp_path_factory.mktemp("loras")
            made[model_dir] = hf, [make_adapter(hf, root / f"a{i}", seed=seed + i, **spec)
                                   for i, spec in enumerate(SPECS)]
        return made[model_dir]

    return get


@pytest.fixture(scope="session")
def tiny_hf(tiny_model_dir, hf_with_adapters):
    return hf_with_adapters(tiny_model_dir, 100)[0]


@pytest.fixture(scope="session")
def tiny_adapters(tiny_model_dir, hf_with_adapters) -> list[str]:
    return hf_with_adapters(tiny_model_dir, 100)[1]


@pytest.fixture(scope="session")
def bad_adapters(tiny_hf, tiny_adapters, tmp_path_factory) -> dict[str, str]:
    """Adapters the tiny model must refuse: rank 32 (above 16), made for another base model, a broken file."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("bad_loras")
    high = make_adapter(tiny_hf, root / "rank32", seed=1, r=32, lora_alpha=32, target_modules=["q_proj"])
    other = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    wrong = make_adapter(other, root / "other_base", seed=2, r=4, lora_alpha=8, target_modules=ALL_TARGETS)
    broken = root / "broken"
    shutil.copytree(tiny_adapters[0], broken)
    weights = broken / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    return {"rank": high, "shape": wrong, "broken": str(broken)}
