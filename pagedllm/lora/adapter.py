"""PEFT LoRA adapters read from disk and checked against the base model before anything serves them.

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` (or ``.bin``). Each
target projection gets ``A [r, in]`` and ``B [out, r]``; the delta of a row ``x`` is ``scaling * B A x`` with
``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA). Anything we cannot serve exactly (DoRA,
biases, extra trained modules, per-module alpha) is refused with the reason, never ignored.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from pagedllm.protocol.lora_request import LoRARequest

# PEFT's module names, in the order the model's fused projections hold them
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the model's fused projections and the PEFT targets each holds, in output order
GROUPS: dict[str, tuple[str, ...]] = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
                                      "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRALoadError(ValueError):
    """An adapter that cannot be served; the message says why."""


@dataclass(frozen=True)
class LoRAShapes:
    """The base model's dimensions an adapter must match: ``(out, in)`` of every target."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, cfg) -> "LoRAShapes":
        """From a model config (``pagedllm.models.config.ModelConfig`` or anything with its fields)."""
        e, i = cfg.hidden_size, cfg.intermediate_size
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return cls(cfg.num_layers, {"q_proj": (q, e), "k_proj": (kv, e), "v_proj": (kv, e), "o_proj": (e, q),
                                    "gate_proj": (i, e), "up_proj": (i, e), "down_proj": (e, i)})


@dataclass
class LoRAAdapter:
    """One adapter's weights: ``weights[(layer, target)] = (A [r, in], B [out, r] * scaling)`` in float32."""

    lora_id: int
    name: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def read_config(path: str) -> dict:
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise LoRALoadError(f"adapter {path!r}: no adapter_config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRALoadError(f"adapter {path!r}: adapter_config.json is not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise LoRALoadError(f"adapter {path!r}: adapter_config.json is not a JSON object")
    return cfg


def _scaling(path: str, cfg: dict, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) after refusing every setting whose output we would not reproduce exactly."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRALoadError(f"adapter {path!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out weights"),
                     ("modules_to_save", "extra trained modules (modules_to_save)"),
                     ("alpha_pattern", "per-module lora_alpha (alpha_pattern)"),
                     ("layers_pattern", "layers_pattern")):
        if cfg.get(key):
            raise LoRALoadError(f"adapter {path!r}: {why} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRALoadError(f"adapter {path!r}: bias={cfg['bias']!r} is not supported (only 'none')")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    ranks = [r, *(cfg.get("rank_pattern") or {}).values()]
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in ranks):
        raise LoRALoadError(f"adapter {path!r}: rank r must be a positive int, got {r!r}")
    if max(ranks) > max_rank:
        raise LoRALoadError(f"adapter {path!r}: rank {max(ranks)} is above max_lora_rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRALoadError(f"adapter {path!r}: lora_alpha must be a number, got {alpha!r}")
    return r, alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st, binf = os.path.join(path, "adapter_model.safetensors"), os.path.join(path, "adapter_model.bin")
    try:
        if os.path.isfile(st):
            from safetensors.torch import load_file

            return load_file(st)
        if os.path.isfile(binf):
            return torch.load(binf, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any broken file is refused with its reason
        raise LoRALoadError(f"adapter {path!r}: weights file is broken ({type(e).__name__}: {e})") from None
    raise LoRALoadError(f"adapter {path!r}: no adapter_model.safetensors or adapter_model.bin")


def load_adapter(lora: LoRARequest, shapes: LoRAShapes, max_rank: int) -> LoRAAdapter:
    """Read and check ``lora.lora_path`` against the base model; LoRALoadError names what is wrong."""
    path = lora.lora_path
    if not os.path.isdir(path):
        raise LoRALoadError(f"adapter {path!r}: not a directory")
    cfg = read_config(path)
    r, scaling = _scaling(path, cfg, max_rank)
    rank_pattern = cfg.get("rank_pattern") or {}
    alpha = cfg.get("lora_alpha", r)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in _read_tensors(path).items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in TARGETS:
            raise LoRALoadError(f"adapter {path!r}: weight {key!r} is not a LoRA A/B of {', '.join(TARGETS)}")
        layer = int(m.group(1))
        if layer >= shapes.num_layers:
            raise LoRALoadError(f"adapter {path!r}: weight {key!r} is for layer {layer}; the base model has "
                                f"{shapes.num_layers} (an adapter for another base model?)")
        pairs.setdefault((layer, m.group(2)), {})[m.group(3)] = t
    if not pairs:
        raise LoRALoadError(f"adapter {path!r}: holds no LoRA weights")
    out = LoRAAdapter(lora.lora_int_id, lora.lora_name, r, scaling)
    for (layer, target), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRALoadError(f"adapter {path!r}: layer {layer} {target} lacks lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"].float(), ab["B"].float()
        o, i = shapes.shapes[target]
        rr = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != i or b.shape[0] != o or b.shape[1] != rr:
            raise LoRALoadError(f"adapter {path!r}: layer {layer} {target} has A {tuple(a.shape)} and B "
                                f"{tuple(b.shape)}; the base model needs A [r, {i}] and B [{o}, r] "
                                "(an adapter for another base model?)")
        if rr > max_rank:
            raise LoRALoadError(f"adapter {path!r}: rank {rr} is above max_lora_rank {max_rank}")
        s = scaling
        if rank_pattern and rr != r:  # a per-module rank keeps the global alpha
            s = alpha / math.sqrt(rr) if cfg.get("use_rslora") else alpha / rr
        out.weights[(layer, target)] = (a.contiguous(), (b * s).contiguous())
    out.rank = max(a.shape[0] for a, _ in out.weights.values())
    return out
