"""Our Llama-family model (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3) over the paged KV pool.

One forward pass runs a flat batch ``[T]`` of tokens from many sequences (decode tokens and
prefill chunks mixed): every matmul, norm and rotary op covers the whole batch, the attention
backend writes the new K/V into the pool through the slot mapping and attends through the block
tables. q/k/v are one fused matmul and gate/up another.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.models.bf16_gemm import PackedBF16, onednn_bf16_available
from pagedllm.models.config import ModelConfig
from pagedllm.config.device import cpu_has_native_bf16
from pagedllm.models import weight_arena
from pagedllm.models.bf16_layers import FusedBF16Layers
from pagedllm.models.decode_layer import FusedDecode
from pagedllm.models.layers import (add_rms_norm_, apply_rope_, apply_rope_heads_, bf16_gemm_rows, linear,
                                    linear_silu_mul, rms_norm, rope_cos_sin, rope_widened, silu_mul)
from pagedllm.models.quant import (MATRICES, QUANTIZATIONS, QuantizedWeight, kernel_available, load_blocks,
                                   resolve_auto)

if TYPE_CHECKING:
    from pagedllm.distributed.parallel_state import TPGroup
    from pagedllm.lora.delta import LoRAStep


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, act_dtype: torch.dtype, upcast: bool, index: int = 0):
        super().__init__()
        self.index = index  # which layer: selects this layer's LoRA weights
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
        # tensor parallelism (pagedllm.models.sharding): the group summing the row-parallel outputs of
        # o and down; None when unsharded
        self.tp: TPGroup | None = None

    def forward(self, h: torch.Tensor, delta: torch.Tensor | None, cos, sin, k_cache, v_cache, meta, backend,
                scale: float, lora: LoRAStep | None = None) -> torch.Tensor:
        """One layer over the residual stream ``h [T, E]``, updated in place; returns the MLP output.

        Each residual add is fused into the norm that follows it (vLLM style), so ``delta`` is the
        previous layer's MLP output (None at the first layer) and the caller adds the one returned
        here in the next layer's input norm or the final norm. ``lora``: each token's adapter delta is added
        to the q/k/v, o, gate/up and down outputs (before rope and the activation).
        """
        up = self.upcast
        T = h.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        lowp = self._bf16_inputs(h, lora)
        x = add_rms_norm_(h, delta, self.input_norm, self.eps, lowp)
        fused = getattr(backend, "forward_qkv", None)
        rope_fused = getattr(backend, "forward_qkv_rope", None)
        # a bf16 GEMM's qkv widened as rotary reads it, in one pass (bias-free: a bias is added in the output dtype)
        widen_late = (lowp is not None and self.qkv_bias is None and self.qk_norm is None and rope_fused is None
                      and fused is not None)
        qkv = linear(x, self.qkv_weight, self.qkv_bias, up, lowp if widen_late else h.dtype)  # [T, (H + 2 Hkv) D]
        if lora is not None:
            lora.add_(self.index, "qkv", qkv, x)
        if rope_fused is not None and self.qk_norm is None:  # rotary + K/V write in one launch (triton)
            attn = rope_fused(qkv, H, cos, sin, k_cache, v_cache, meta, scale)
        elif fused is not None and self.qk_norm is None:  # no head views: ~40 us less a layer at batch 1
            if widen_late:
                qkv = rope_widened(qkv, H + Hkv, cos, sin)
            else:
                apply_rope_heads_(qkv, H + Hkv, cos, sin)
            attn = fused(qkv, H, k_cache, v_cache, meta, scale)  # [T, H * D]
        else:
            qk = qkv[:, : self.q_size + self.kv_size].view(T, H + Hkv, D)
            v = qkv[:, self.q_size + self.kv_size :].view(T, Hkv, D)
            if self.qk_norm is not None:
                qk = rms_norm(qk, self.qk_norm, self.eps)
            apply_rope_(qk, cos, sin)
            attn = backend.forward(qk[:, :H], qk[:, H:], v, k_cache, v_cache, meta, scale).reshape(T, H * D)
        o = linear(attn, self.o_weight, self.o_bias, up, lowp if self.o_bias is None else None)
        if lora is not None:
            lora.add_(self.index, "o", o, attn)
        if self.tp is not None:
            self.tp.all_reduce(o)
        x = add_rms_norm_(h, o, self.post_norm, self.eps, lowp)
        if lora is None:
            act = linear_silu_mul(x, self.gate_up_weight, up, lowp)
        else:
            gate_up = linear(x, self.gate_up_weight, None, up)
            lora.add_(self.index, "gate_up", gate_up, x)
            act = silu_mul(gate_up, lowp)
        down = linear(act, self.down_weight, None, up)
        if lora is not None:
            lora.add_(self.index, "down", down, act)
        return down if self.tp is None else self.tp.all_reduce(down)

    def _bf16_inputs(self, h: torch.Tensor, lora: LoRAStep | None) -> torch.dtype | None:
        """bf16 when this step's GEMMs run on bf16 copies of the weights under fp32 activations (gguf-bf16 from 8
        rows): the norms and the activation then write bf16 for them, and o, gate/up and down hand their bf16
        results on unwidened (the residual add and the activation widen them as they read), the same values as
        casting at each GEMM without the casts. Not with adapters or shards, whose adds and sums want fp32."""
        if (h.dtype != torch.float32 or lora is not None or self.tp is not None
                or not bf16_gemm_rows(self.qkv_weight, h.shape[0])):
            return None
        return torch.bfloat16


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
            LlamaDecoderLayer(cfg, dtype, act, self.upcast_matmuls, i) for i in range(cfg.num_layers)
        )
        self.norm = _param(cfg.hidden_size, dtype=act)
        self.lm_head = self.embed if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        cos, sin = rope_cos_sin(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, act)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.scale = cfg.head_dim**-0.5
        self.quantization = "none"  # "gguf" / "gguf-a8" once use_gguf_blocks swapped the matrices in
        # tensor parallelism: this rank's vocab rows [start, end) of embed / lm_head, and the group that
        # assembles the full embedding rows and logits (None when unsharded); see pagedllm.models.sharding
        self.vocab_range = (0, cfg.vocab_size)
        self.tp: TPGroup | None = None

    # ------------------------------------------------------------------ weights
    @classmethod
    def from_checkpoint(cls, ckpt, dtype: torch.dtype = torch.float32, quantization: str = "auto",
                        pack: bool = True) -> "LlamaForCausalLM":
        """Our model with a loaded ``pagedllm.models.loader.Checkpoint``'s weights; ``quantization="gguf"``
        keeps the GGUF's Q4_1/Q8_0 matrices in their blocks (see ``models/quant.py``; "auto" does where it can).
        ``pack=False`` leaves gguf-a8 and gguf-bf16's runtime layouts to :meth:`pack_blocks` (after sharding)."""
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {quantization!r}; choose {', '.join(QUANTIZATIONS)}")
        model = cls(ckpt.config, dtype=dtype)
        model.load_hf_state_dict(ckpt.state_dict)
        quantization = resolve_auto(quantization, ckpt.blocks_path is not None, model.act_dtype)
        if quantization in ("gguf", "gguf-a8", "gguf-bf16"):
            if ckpt.blocks_path is None:
                raise ValueError(f"quantization={quantization!r} needs a GGUF checkpoint with Q4_1/Q8_0 matrices; "
                                 "this model has none")
            a8 = quantization == "gguf-a8"
            if model.act_dtype != torch.float32 and not a8:  # gguf-a8's activations are int8 in either dtype
                raise ValueError(f"quantization={quantization!r} computes in float32: use dtype float32 (or bfloat16 "
                                 "on a CPU without native bf16), or quantization='gguf-a8'")
            if a8 and not kernel_available(int8_activations=True):
                raise ValueError("quantization='gguf-a8' needs its C++ kernel (g++ with OpenMP, an AVX2 CPU); "
                                 "use quantization='gguf'")
            model.use_gguf_blocks(load_blocks(ckpt.blocks_path))
            if pack:
                model.pack_blocks(quantization)
        return model

    def pack_blocks(self, quantization: str) -> None:
        """Give the block matrices their runtime layout for ``quantization``, once (after sharding: packed
        layouts can no longer be sliced): gguf-a8's int8 layout, or gguf-bf16's prepacked bf16 copies."""
        if quantization == "gguf-a8":
            self.pack_for_int8_activations()
        elif quantization == "gguf-bf16":
            self.add_bf16_copies()

    def use_gguf_blocks(self, blocks: Mapping[str, QuantizedWeight]) -> None:
        """Swap each matrix whose HF parts are all in ``blocks`` (one block format) for its block form,
        freeing the dense copy. Biases and norms stay dense."""

        def swap(module: nn.Module, attr: str, *names: str) -> int:
            parts = [blocks.get(n) for n in names]
            if any(p is None for p in parts) or len({p.qtype for p in parts}) != 1:
                return 0
            fused = parts[0] if len(parts) == 1 else QuantizedWeight.cat(parts)
            if fused.shape != tuple(getattr(module, attr).shape):
                raise ValueError(f"GGUF blocks {fused.shape} do not match {attr} {tuple(getattr(module, attr).shape)}")
            delattr(module, attr)
            setattr(module, attr, fused)
            return 1

        n = swap(self, "embed", "model.embed_tokens.weight")
        if self.config.tie_word_embeddings and n:
            delattr(self, "lm_head")
            self.lm_head = self.embed
        elif not self.config.tie_word_embeddings:
            n += swap(self, "lm_head", "lm_head.weight")
        for i, layer in enumerate(self.layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            n += swap(layer, "qkv_weight", a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight")
            n += swap(layer, "o_weight", a + "o_proj.weight")
            n += swap(layer, "gate_up_weight", m + "gate_proj.weight", m + "up_proj.weight")
            n += swap(layer, "down_weight", m + "down_proj.weight")
        if n:
            self.quantization = "gguf"

    def pack_for_int8_activations(self) -> None:
        """Make every block matrix multiply int8-rounded activations (``quantization="gguf-a8"``), packed once
        here into that kernel's layout, which replaces the blocks. Embedding lookups stay exact on the blocks
        (a tied LM head gets its own packed copy). A tensor-parallel shard packs after sharding: packed
        matrices can no longer be sliced."""
        self._map_matrices(QuantizedWeight, QuantizedWeight.pack_a8)
        self.quantization = "gguf-a8"

    def add_bf16_copies(self) -> None:
        """``quantization="gguf-bf16"``: every block matrix, the LM head included, gets a prepacked bf16 copy for GEMMs
        of ``BF16_MIN_ROWS`` rows or more (embedding lookups keep the blocks)."""
        self._map_matrices(QuantizedWeight, QuantizedWeight.with_bf16)
        self.quantization = "gguf-bf16"

    def prepack_bf16(self) -> bool:
        """Dense bf16 matrices (bf16 activations, a CPU with native bf16) prepacked for oneDNN once, instead of
        reordered by every ``F.linear`` call; False (nothing changed) where that does not apply. Call it on the CPU
        model, after sharding: a prepacked matrix can be neither moved nor sliced."""
        if self.act_dtype != torch.bfloat16 or not onednn_bf16_available():
            return False
        self._map_matrices(torch.Tensor, PackedBF16.of)
        return True

    def gather_weights(self) -> int:
        """On the CPU: the matrices the kernels stream each step moved into one buffer on 2 MB pages
        (``models/weight_arena.py``), after every packing. Returns the bytes moved."""
        return weight_arena.gather_matrices([(self, "embed"), *self._matrix_slots()])

    def _map_matrices(self, kind: type, fn: Callable) -> None:
        """Replace the LM head and each layer matrix that is a ``kind`` by ``fn`` of it. The embedding, tied or not,
        keeps its rows for lookups."""
        for module, attr in self._matrix_slots():
            w = getattr(module, attr)
            if isinstance(w, kind):
                delattr(module, attr)  # a registered parameter can only be replaced by another one
                setattr(module, attr, fn(w))

    def _matrix_slots(self) -> list[tuple[nn.Module, str]]:
        """Where the LM head and each layer matrix are held: (module, attribute)."""
        return [(self, "lm_head"), *((layer, a) for layer in self.layers for a in MATRICES)]

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
        lora: LoRAStep | None = None,
    ) -> torch.Tensor:
        """One pass over the flat batch; calls ``backend.prepare(meta)`` once before the layers. ``lora``: the
        step's per-token adapters (None: the base model for every token)."""
        backend.prepare(meta)
        h = self.embed_tokens(input_ids)  # a fresh tensor: the layers update it in place
        cos = self.rope_cos.index_select(0, positions)
        sin = self.rope_sin.index_select(0, positions)
        delta = None
        if lora is None and self.fused_decode.applies(h, backend, kv_cache, meta):  # every layer in one C++ call
            delta = self.fused_decode(h, delta, cos, sin, kv_cache, meta, backend, self.scale)
        elif lora is None and self.fused_layers.applies(h, backend, kv_cache, meta):  # gguf-bf16 rows: the same
            delta = self.fused_layers(h, cos, sin, kv_cache, meta, backend, self.scale)
        else:
            for i, layer in enumerate(self.layers):
                k_cache, v_cache = kv_cache.layer(i)
                delta = layer.forward(h, delta, cos, sin, k_cache, v_cache, meta, backend, self.scale, lora)  # no hooks
        return add_rms_norm_(h, delta, self.norm, self.config.rms_norm_eps)

    @functools.cached_property
    def fused_decode(self) -> FusedDecode:
        """The layers as the fused decode call takes them, gathered at the first step that asks (weights loaded)."""
        return FusedDecode(self.layers)

    @functools.cached_property
    def fused_layers(self) -> FusedBF16Layers:
        """The layers as the fused call of several gguf-bf16 rows takes them, gathered at the first step that asks."""
        return FusedBF16Layers(self.layers)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows ``[T, E]`` in the activation dtype (a new tensor). Vocab-parallel: each rank looks up
        the ids in its slice, zeroes the others, and the sum over ranks is every row (exactly)."""
        if self.tp is None:
            return self._embed_rows(input_ids)
        start, end = self.vocab_range
        mine = (input_ids >= start) & (input_ids < end)
        rows = self._embed_rows(torch.where(mine, input_ids - start, 0))
        return self.tp.all_reduce(rows.masked_fill_(~mine[:, None], 0))

    def _embed_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, QuantizedWeight):
            return self.embed.dequantize(input_ids).to(self.act_dtype)
        return F.embedding(input_ids, self.embed).to(self.act_dtype)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits ``[N, vocab]`` of (final-normed) hidden states ``[N, E]``. Vocab-parallel: each rank's
        slice, padded to the largest slice, gathered in rank order. ``out``: a contiguous float32 ``[>= N, vocab]``
        buffer the caller reuses every step, written (its first N rows returned) where a bf16 GEMM's result is
        widened, unsharded: a fresh float32 ``[64, 49152]`` page-faults on every CPU step (6 ms of a 70 ms W1
        decode step on a 2-core Xeon, against 0.4 ms into a warm buffer)."""
        if out is not None and self.tp is None and not self.upcast_matmuls and bf16_gemm_rows(self.lm_head,
                                                                                              hidden.shape[0]):
            return out[: hidden.shape[0]].copy_(linear(hidden, self.lm_head, None, False, torch.bfloat16))
        logits = linear(hidden.float() if self.upcast_matmuls else hidden, self.lm_head, None, self.upcast_matmuls).float()
        if self.tp is None:
            return logits
        per_rank = -(-self.config.vocab_size // self.tp.world_size)
        gathered = self.tp.all_gather(F.pad(logits, (0, per_rank - logits.shape[1])), dim=1)
        return gathered[:, : self.config.vocab_size].contiguous()
