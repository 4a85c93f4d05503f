"""Adapters are checked at load: what cannot be served exactly is refused with the reason, never ignored."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pagedllm.lora.adapter import LoRALoadError, LoRAShapes, load_adapter
from pagedllm.lora.registry import LoRARegistry, parse_lora_modules
from pagedllm.protocol.lora_request import LoRARequest


@pytest.fixture(scope="module")
def shapes(tiny_hf) -> LoRAShapes:
    from pagedllm.models.config import ModelConfig

    return LoRAShapes.of(ModelConfig.from_hf(tiny_hf.config))


def edited(src: str, tmp_path, **changes) -> str:
    dst = tmp_path / "edited"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_scaling_and_weights(tiny_adapters, shapes):
    from safetensors.torch import load_file

    plain = load_adapter(LoRARequest("a", 1, tiny_adapters[0]), shapes, 16)  # r=8, alpha=16
    rs = load_adapter(LoRARequest("b", 3, tiny_adapters[2]), shapes, 16)  # r=16, alpha=8, rsLoRA
    assert (plain.rank, plain.scaling) == (8, 2.0) and (rs.rank, rs.scaling) == (16, 8 / 4)
    assert len(plain.weights) == 2 * 7 and {t for _, t in rs.weights} == {"q_proj", "k_proj", "v_proj", "o_proj",
                                                                          "gate_proj", "up_proj", "down_proj"}
    raw = load_file(f"{tiny_adapters[0]}/adapter_model.safetensors")
    b = raw["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    assert torch.equal(plain.weights[(1, "down_proj")][1], b * 2.0)


@pytest.mark.parametrize("kind,reason", [("rank", "rank 32 is above max_lora_rank 16"),
                                         ("shape", "another base model"), ("broken", "weights file is broken")])
def test_bad_adapters_refused(bad_adapters, shapes, kind, reason):
    with pytest.raises(LoRALoadError, match=reason):
        load_adapter(LoRARequest("x", 1, bad_adapters[kind]), shapes, 16)


@pytest.mark.parametrize("change,reason", [
    (dict(use_dora=True), "DoRA"), (dict(bias="all"), "bias='all'"), (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(alpha_pattern={"q_proj": 3}), "alpha_pattern"), (dict(peft_type="PREFIX_TUNING"), "not LORA"),
    (dict(r=0), "positive int"), (dict(lora_alpha="x"), "lora_alpha")])
def test_unsupported_settings_refused(tiny_adapters, shapes, tmp_path, change, reason):
    with pytest.raises(LoRALoadError, match=reason):
        load_adapter(LoRARequest("x", 1, edited(tiny_adapters[0], tmp_path, **change)), shapes, 16)


def test_missing_files_and_stray_weights(tiny_adapters, shapes, tmp_path):
    with pytest.raises(LoRALoadError, match="not a directory"):
        load_adapter(LoRARequest("x", 1, str(tmp_path / "none")), shapes, 16)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoRALoadError, match="no adapter_config.json"):
        load_adapter(LoRARequest("x", 1, str(tmp_path / "empty")), shapes, 16)
    from safetensors.torch import load_file, save_file

    d = tmp_path / "stray"
    shutil.copytree(tiny_adapters[0], d)
    sd = load_file(d / "adapter_model.safetensors")
    sd["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(2, 3)
    save_file(sd, d / "adapter_model.safetensors")
    with pytest.raises(LoRALoadError, match="is not a LoRA A/B"):
        load_adapter(LoRARequest("x", 1, str(d)), shapes, 16)
    sd.pop("base_model.model.model.embed_tokens.lora_embedding_A")
    sd.pop("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight")
    save_file(sd, d / "adapter_model.safetensors")
    with pytest.raises(LoRALoadError, match="layer 0 q_proj lacks lora_B"):
        load_adapter(LoRARequest("x", 1, str(d)), shapes, 16)


def test_lora_request_and_modules_validation():
    for bad in (("", 1, "p"), ("a", 0, "p"), ("a", True, "p"), ("a", 1, "")):
        with pytest.raises(ValueError):
            LoRARequest(*bad)
    assert parse_lora_modules(["a=/x", " b = /y "]) == [("a", "/x"), ("b", "/y")]
    with pytest.raises(ValueError, match="'nope' is not name=path"):
        parse_lora_modules(["nope"])


def test_registry_ids_never_reused(tiny_adapters, shapes):
    reg = LoRARegistry(shapes, 16)
    first = reg.add("a", tiny_adapters[0])
    reg.remove("a")
    again = reg.add("a", tiny_adapters[1])
    assert again.lora_int_id != first.lora_int_id
    with pytest.raises(ValueError, match="already loaded"):
        reg.add("a", tiny_adapters[0])
    with pytest.raises(KeyError):
        reg.remove("zzz")


def test_cli_flags():
    import argparse

    from pagedllm.config.args import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_namespace(parser.parse_args(
        ["--enable-lora", "--lora-modules", "sql=/a", "chat=/b", "--max-loras", "3", "--max-lora-rank", "64",
         "--max-cpu-loras", "10"]))
    assert (args.enable_lora, args.max_loras, args.max_lora_rank, args.max_cpu_loras) == (True, 3, 64, 10)
    assert parse_lora_modules(args.lora_modules) == [("sql", "/a"), ("chat", "/b")]
