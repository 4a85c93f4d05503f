"""Architecture switches of the Llama family, read from a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass
class ModelConfig:
    """What our Llama-family implementation needs; Qwen2/3 and Mistral differ only in switches."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelConfig":
        """Read a transformers ``PretrainedConfig``; ValueError for architectures we do not implement."""
        arch = (getattr(hf, "architectures", None) or [""])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; pagedllm implements {', '.join(SUPPORTED_ARCHITECTURES)} "
                "(other causal LMs can run through pagedllm.models.paged_cache.PagedCache)"
            )
        heads = hf.num_attention_heads
        eos = hf.eos_token_id
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        rope_params = getattr(hf, "rope_parameters", None) or {}
        rope_theta = getattr(hf, "rope_theta", None) or rope_params.get("rope_theta", 10000.0)
        rope_scaling = getattr(hf, "rope_scaling", None)
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = dict(rope_params)
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(getattr(hf, "attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=eos_ids,
            bos_token_id=getattr(hf, "bos_token_id", None),
        )
