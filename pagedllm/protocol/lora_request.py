"""Which LoRA adapter a request runs with: plain data that crosses every boundary (vLLM's ``LoRARequest``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """``LoRARequest(name, id, path)``: ``lora_int_id`` >= 1 names the adapter inside the engine (0 is the
    base model); ``lora_path`` is a PEFT adapter directory (``adapter_config.json`` + weights)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1 (0 is the base model), got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must be a non-empty string")


def lora_id_of(lora: LoRARequest | None) -> int:
    """The adapter id a request runs with; 0 for the base model."""
    return 0 if lora is None else lora.lora_int_id


@dataclass
class AdapterPages:
    """An adapter the core made resident (issue 32): the worker stores ``payload`` (its packed weights, see
    ``pagedllm.lora.pages``) in KV blocks ``pages`` before the step's forward."""

    lora_id: int
    rank: int
    pages: list[int]
    payload: object  # torch.Tensor (kept untyped: this module imports nothing heavy)
