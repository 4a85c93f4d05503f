"""The front end's adapters by name: each is read and checked once when added (bad ones refused with the
reason, nothing else affected), so a request names a served adapter or gets a clear error before it queues."""

from __future__ import annotations

import itertools
import threading

from pagedllm.lora.adapter import LoRALoadError, LoRAShapes, load_adapter
from pagedllm.lora.sharding import AdapterShard
from pagedllm.protocol.lora_request import LoRARequest


def shapes_for_model(model: str | None, tensor_parallel_size: int = 1) -> LoRAShapes:
    """The dimensions adapters of ``model`` (an engine's ``EngineArgs.model``) must have; reads only its config.
    With ``tensor_parallel_size`` N > 1: those of one rank's shard (``lora.sharding``; the same on every rank)."""
    from transformers import AutoConfig

    from pagedllm.models.config import ModelConfig
    from pagedllm.models.loader import resolve_model_dir

    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(resolve_model_dir(model), local_files_only=True))
    if tensor_parallel_size == 1:
        return LoRAShapes.of(cfg)
    from pagedllm.models.sharding import ShardPlan

    return AdapterShard.of(LoRAShapes.of(cfg), ShardPlan.of(cfg, 0, tensor_parallel_size), cfg.head_dim).shapes


def parse_lora_modules(specs) -> list[tuple[str, str]]:
    """``["name=path", ...]`` (``--lora-modules``) as (name, path) pairs; ValueError names a malformed one."""
    out = []
    for spec in specs or ():
        name, sep, path = str(spec).partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"lora_modules: {spec!r} is not name=path")
        out.append((name.strip(), path.strip()))
    return out


class LoRARegistry:
    """Served adapters: name -> ``LoRARequest``; ids are handed out here when a name is added without one."""

    def __init__(self, shapes: LoRAShapes, max_rank: int) -> None:
        self.shapes, self.max_rank = shapes, max_rank
        self.by_name: dict[str, LoRARequest] = {}
        self._checked: set[LoRARequest] = set()
        self._ids = itertools.count(1)  # never reused: an id names one adapter's KV in the prefix cache
        self._lock = threading.Lock()

    @classmethod
    def from_args(cls, args) -> "LoRARegistry | None":
        """The registry of an engine's ``EngineArgs`` with its ``lora_modules`` added; None without enable_lora."""
        if not args.enable_lora:
            return None
        registry = cls(shapes_for_model(args.model), args.max_lora_rank)
        for name, path in parse_lora_modules(args.lora_modules):
            registry.add(name, path)
        return registry

    def check(self, lora: LoRARequest) -> None:
        """Load ``lora`` once to check it against the base model (LoRALoadError says why it cannot serve)."""
        if lora not in self._checked:
            load_adapter(lora, self.shapes, self.max_rank)
            self._checked.add(lora)

    def add(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter at ``path`` as ``name``; ValueError if the name is taken or the adapter is bad."""
        with self._lock:
            if name in self.by_name:
                raise ValueError(f"adapter {name!r} is already loaded")
            lora = LoRARequest(name, next(self._ids), path)
            self.check(lora)
            self.by_name[name] = lora
            return lora

    def remove(self, name: str) -> LoRARequest:
        """Stop serving ``name``; KeyError if it is not loaded."""
        with self._lock:
            lora = self.by_name.pop(name)
            self._checked.discard(lora)
            return lora

    def get(self, name: str) -> LoRARequest | None:
        return self.by_name.get(name)


def check_lora(registry: LoRARegistry | None, lora: LoRARequest | None) -> None:
    """ValueError unless ``lora`` (None: the base model) can serve on an engine with ``registry`` (None: LoRA off)."""
    if lora is None:
        return
    if registry is None:
        raise ValueError("lora_request: this engine was started without enable_lora")
    registry.check(lora)


__all__ = ["LoRALoadError", "LoRARegistry", "check_lora", "parse_lora_modules", "shapes_for_model"]
