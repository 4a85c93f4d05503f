"""Our Llama-family model (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3) over the paged KV pool.

One forward pass runs a flat batch ``[T]`` of tokens from many sequences (decode tokens and
prefill chunks mixed): every matmul, norm and rotary op covers the whole batch, the attention
backend writes the new K/V into the pool through the slot mapping and attends through the block
tables. q/k/v are one fused matmul and gate/up another.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.models.config import ModelConfig
from pagedllm.models.layers import (LOGITS_SKINNY_MAX_ROWS, apply_rope, cpu_has_native_bf16, linear, rms_norm,
                                    rope_cos_sin)


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, act_dtype: torch.dtype, upcast: bool):
        super().__init__()
        H, Hkv, D, E = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = H, Hkv, D
        self.q_size, self.kv_size = H * D, Hkv * D
        self.eps = cfg.rms_norm_eps
        self.upcast = upcast  # low-precision weight matrices, GEMMs computed in fp32
        # matrices in the storage dtype; norms and biases (tiny) in the activation dtype
        self.input_norm = _param(E, dtype=act_dtype)
        self.qkv_weight = _param(self.q_size + 2 * self.kv_size, E, dtype=dtype)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size, dtype=act_dtype) if cfg.attention_bias else None
        self.o_weight = _param(E, self.q_size, dtype=dtype)
        self.o_bias: nn.Parameter | None = None  # Llama with attention_bias has one; set by the loader
        # Qwen3: per-head RMSNorm of q and k, stacked [H + Hkv, D] so one op normalises both
        self.qk_norm = _param(H + Hkv, D, dtype=act_dtype) if cfg.qk_norm else None
        self.post_norm = _param(E, dtype=act_dtype)
        self.gate_up_weight = _param(2 * cfg.intermediate_size, E, dtype=dtype)
        self.down_weight = _param(E, cfg.intermediate_size, dtype=dtype)
        self.intermediate_size = cfg.intermediate_size

    def forward(self, h, cos, sin, k_cache, v_cache, meta, backend, scale):
        up = self.upcast
        T = h.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        x = rms_norm(h, self.input_norm, self.eps)
        qkv = linear(x, self.qkv_weight, self.qkv_bias, up)  # [T, (H + 2 Hkv) D]
        qk = qkv[:, : self.q_size + self.kv_size].view(T, H + Hkv, D)
        v = qkv[:, self.q_size + self.kv_size :].view(T, Hkv, D)
        if self.qk_norm is not None:
            qk = rms_norm(qk, self.qk_norm, self.eps)
        qk = apply_rope(qk, cos, sin)
        attn = backend.forward(qk[:, :H], qk[:, H:], v, k_cache, v_cache, meta, scale)  # [T, H, D]
        h = h + linear(attn.reshape(T, H * D), self.o_weight, self.o_bias, up)
        x = rms_norm(h, self.post_norm, self.eps)
        gate_up = linear(x, self.gate_up_weight, None, up)
        act = F.silu(gate_up[:, : self.intermediate_size])
        act.mul_(gate_up[:, self.intermediate_size :])
        return h + linear(act, self.down_weight, None, up)


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], kv_cache, meta, backend) -> hidden [T, E]`` (final-normed).

    ``dtype`` is the storage dtype of the weight matrices. ``upcast_matmuls`` (default: on for
    bf16/fp16 on a CPU without native bf16, i.e. no AVX512-BF16/AMX, where bf16 GEMMs are emulated
    and ~4-6x slower than fp32): keep the matrices in ``dtype`` (half the memory) but run GEMMs
    and activations in fp32, each matrix upcast as it is used. Off: everything in ``dtype`` like
    HF's bf16 path. The KV cache dtype is the KVCache's own setting (backends cast on write).
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, upcast_matmuls: bool | None = None):
        super().__init__()
        self.config = config
        self.dtype = dtype
        cfg = config
        if upcast_matmuls is None:
            upcast_matmuls = dtype in (torch.bfloat16, torch.float16) and not cpu_has_native_bf16()
        self.upcast_matmuls = bool(upcast_matmuls) and dtype != torch.float32
        self.act_dtype = torch.float32 if self.upcast_matmuls else dtype
        act = self.act_dtype
        self.embed = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, dtype, act, self.upcast_matmuls) for _ in range(cfg.num_layers)
        )
        self.norm = _param(cfg.hidden_size, dtype=act)
        self.lm_head = self.embed if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        cos, sin = rope_cos_sin(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, act)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.scale = cfg.head_dim**-0.5

    # ------------------------------------------------------------------ weights
    @classmethod
    def from_checkpoint(cls, ckpt, dtype: torch.dtype = torch.float32) -> "LlamaForCausalLM":
        """Our model with a loaded ``pagedllm.models.loader.Checkpoint``'s weights."""
        model = cls(ckpt.config, dtype=dtype)
        model.load_hf_state_dict(ckpt.state_dict)
        return model

    def load_hf_state_dict(self, sd: Mapping[str, torch.Tensor]) -> None:
        """Load Hugging Face parameter names (``model.layers.N.self_attn.q_proj.weight`` ...),
        fusing q/k/v and gate/up; casts to the model dtype. KeyError names what is missing."""
        cfg = self.config
        missing: list[str] = []

        def get(name: str, required: bool = True) -> torch.Tensor | None:
            t = sd.get(name)
            if t is None and required:
                missing.append(name)
            return t

        def put(dst: torch.Tensor, *srcs: torch.Tensor | None) -> None:
            if any(s is None for s in srcs):
                return
            src = srcs[0] if len(srcs) == 1 else torch.cat(srcs, 0)
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"weight shape {tuple(src.shape)} does not match the config's {tuple(dst.shape)}")
            dst.copy_(src)

        with torch.no_grad():
            put(self.embed, get("model.embed_tokens.weight"))
            put(self.norm, get("model.norm.weight"))
            if not cfg.tie_word_embeddings:
                put(self.lm_head, get("lm_head.weight"))
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                a = p + "self_attn."
                put(layer.input_norm, get(p + "input_layernorm.weight"))
                put(layer.post_norm, get(p + "post_attention_layernorm.weight"))
                put(layer.qkv_weight, get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight"))
                if layer.qkv_bias is not None:
                    put(layer.qkv_bias, get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias"))
                put(layer.o_weight, get(a + "o_proj.weight"))
                o_bias = sd.get(a + "o_proj.bias")
                if o_bias is not None:
                    layer.o_bias = nn.Parameter(o_bias.detach().to(self.act_dtype).clone(), requires_grad=False)
                if layer.qk_norm is not None:
                    qn, kn = get(a + "q_norm.weight"), get(a + "k_norm.weight")
                    if qn is not None and kn is not None:
                        stacked = torch.cat([qn[None].expand(layer.num_heads, -1), kn[None].expand(layer.num_kv_heads, -1)])
                        put(layer.qk_norm, stacked)
                m = p + "mlp."
                put(layer.gate_up_weight, get(m + "gate_proj.weight"), get(m + "up_proj.weight"))
                put(layer.down_weight, get(m + "down_proj.weight"))
        if missing:
            shown = ", ".join(missing[:6]) + (f" (+{len(missing) - 6} more)" if len(missing) > 6 else "")
            raise KeyError(f"checkpoint lacks {len(missing)} weight(s) the {cfg.architecture} config needs: {shown}")

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_cache,  # pagedllm.kv.kv_cache.KVCache
        meta: AttentionMetadata,
        backend,
    ) -> torch.Tensor:
        """One pass over the flat batch; calls ``backend.prepare(meta)`` once before the layers."""
        backend.prepare(meta)
        h = F.embedding(input_ids, self.embed).to(self.act_dtype)
        cos = self.rope_cos.index_select(0, positions)
        sin = self.rope_sin.index_select(0, positions)
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv_cache.layer(i)
            h = layer(h, cos, sin, k_cache, v_cache, meta, backend, self.scale)
        return rms_norm(h, self.norm, self.config.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[N, vocab]`` of (final-normed) hidden states ``[N, E]``."""
        return linear(hidden.float() if self.upcast_matmuls else hidden, self.lm_head, None,
                      self.upcast_matmuls, skinny_max_rows=LOGITS_SKINNY_MAX_ROWS).float()
