"""A worker on one device: it sets the device up (the model, or this rank's shard of it, the KV
tensors sized to the budget, the attention backend, the decode graphs) and hands each step to its
model runner (``worker/model_runner.py``), which executes it."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import torch

from pagedllm.attention import BACKENDS, get_backend
from pagedllm.config.args import EngineArgs
from pagedllm.config.device import DeviceConfig
from pagedllm.protocol.kv_spec import KVCacheSpec
from pagedllm.protocol.step_io import DeferredOutput, ModelRunnerOutput, SchedulerOutput
from pagedllm.kv.kv_cache import KVCache
from pagedllm.lora.adapter import LoRAShapes
from pagedllm.lora.manager import LoRAManager
from pagedllm.lora.pages import page_dtype
from pagedllm.lora.sharding import AdapterShard
from pagedllm.lora.slots import LoRASlots
from pagedllm.models.forward_pass import ForwardPass, SeqChunk
from pagedllm.models.config import ModelConfig
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.loader import has_gguf_blocks, load_checkpoint
from pagedllm.models.quant import kernel_available
from pagedllm.ops import cpu_threads
from pagedllm.worker import cuda_graphs, device_check, memory_profile
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.sampler import Sampler

log = logging.getLogger("pagedllm.worker")


def backend_for(device: torch.device, requested: str) -> str:
    """The attention backend for ``device``: what was asked, or the fastest one that runs there
    (triton on CUDA, the C++ kernel on the CPU, else compiled flex)."""
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "triton" if "triton" in BACKENDS else "flex"
    return "cpu" if "cpu" in BACKENDS else "flex"


class Worker:
    """``tp``: this worker's tensor-parallel group; it then holds its rank's shard of the model and its
    share of every KV block (its kv heads), the block tables being the same on every rank."""

    def __init__(self, args: EngineArgs, tp=None) -> None:
        resolved = DeviceConfig.from_args(args,
                                          gguf_blocks=lambda: has_gguf_blocks(args.model) and kernel_available())
        self.device, dtype, kv_dtype = resolved.device, resolved.dtype, resolved.kv_dtype
        backend = backend_for(self.device, args.attention_backend)
        resolved.check_backend(backend)  # before the weights load: a refused setting costs nothing
        model, cfg, num_kv_heads, eos = self._load_model(args.model, tp, dtype, resolved.quantization)
        dims = (cfg.num_layers, num_kv_heads, cfg.head_dim, args.block_size, kv_dtype)
        max_model_len = min(args.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        forward_pass = device_check.CheckedForwardPass if device_check.enabled() else ForwardPass
        num_blocks = self._num_blocks(args, dims, max_model_len, lambda kv: forward_pass(model, kv, get_backend(backend)))
        lora_plan = self._lora_plan(args, cfg, tp, model.act_dtype) if args.enable_lora else None
        if lora_plan is not None and args.num_blocks is None:  # the adapters' slots come out of the KV budget
            num_blocks -= -(-lora_plan[2] // KVCache.bytes_per_block(*dims))
        if num_blocks < 1:
            raise ValueError("the KV cache budget does not hold a single block; raise --kv-cache-memory")
        num_host_blocks = KVCache.num_blocks_for_budget(args.swap_space, *dims) if args.swap_space else 0
        if args.preemption_mode == "swap" and num_host_blocks == 0:
            raise ValueError("preemption_mode='swap' needs a host tier: set swap_space (bytes)")
        self.kv_cache = KVCache(cfg.num_layers, num_kv_heads, cfg.head_dim, num_blocks, args.block_size,
                                dtype=kv_dtype, num_host_blocks=num_host_blocks, device=self.device)
        self.forward_pass = forward_pass(model, self.kv_cache, get_backend(backend))
        self.forward_pass.threads = cpu_threads.governor_for(args.cpu_thread_policy, self.device, tp is not None)
        lora = None
        if lora_plan is not None:  # resident adapters live in KV pages; the compute slots were taken from the budget
            shapes, shard, _ = lora_plan
            lora = LoRAManager(shapes, args.max_loras, args.max_lora_rank, self.kv_cache, model.act_dtype, self.device,
                               page_dtype(dtype), shard)
        graphs = self._decode_graphs(args, tp, kv_dtype, max_model_len)
        if graphs is not None:
            num_blocks -= 1  # the last block is the graphs' scratch block: the KV manager never hands it out
        self.model_runner = ModelRunner(self.forward_pass, InputBatch(max_model_len, args.block_size, cfg.vocab_size,
                                                                      self.device), Sampler(eos), graphs, lora)
        self.spec = KVCacheSpec(num_blocks, num_host_blocks, args.block_size, max_model_len, cfg.vocab_size, eos,
                                args.model or "SmolLM2-135M-Instruct", model.quantization, str(dtype).split(".")[-1],
                                str(kv_dtype).split(".")[-1], backend, str(self.device),
                                {**self.kv_cache.describe(), "page_bytes": self.kv_cache.page_bytes})

    def _load_model(self, name: str | None, tp, dtype: torch.dtype,
                    quantization: str) -> tuple[LlamaForCausalLM, ModelConfig, int, list[int]]:
        """The model (or this rank's shard of it) on the device, its config, its KV heads on this rank, and the
        EOS ids of the config and the tokenizer together. On the CPU, dense bf16 matrices are prepacked for
        oneDNN where it runs bf16 natively, and the matrices the kernels stream go into one buffer."""
        ckpt = load_checkpoint(name)
        cfg = ckpt.config
        if tp is not None:
            from pagedllm.models.sharding import kv_heads_per_rank, load_shard

            model = load_shard(ckpt, tp, dtype, quantization).to(self.device)
            num_kv_heads = kv_heads_per_rank(cfg.num_kv_heads, tp.world_size)
        else:
            model = LlamaForCausalLM.from_checkpoint(ckpt, dtype, quantization).to(self.device)
            num_kv_heads = cfg.num_kv_heads
        if self.device.type == "cpu":
            model.prepack_bf16()
            model.gather_weights()
        eos = list(cfg.eos_token_ids)
        tok_eos = ckpt.tokenizer.eos_token_id
        if tok_eos is not None and tok_eos not in eos:
            eos.append(tok_eos)
        return model, cfg, num_kv_heads, eos

    def _num_blocks(self, args: EngineArgs, dims: tuple, max_model_len: int,
                    make_runner: Callable[[KVCache], ForwardPass]) -> int:
        """KV blocks before the adapters' slots: as many as asked, or what the budget holds (bytes, a measured
        share of the GPU's memory, or a fraction of the host's)."""
        if args.num_blocks is not None:
            return args.num_blocks
        if args.kv_cache_memory is not None:
            return KVCache.num_blocks_for_budget(args.kv_cache_memory, *dims)
        if (probe := memory_profile.probe_for(self.device)) is not None:
            return self._profiled_num_blocks(args, probe, make_runner, dims, max_model_len)  # on a scratch pool
        return KVCache.num_blocks_for_memory_fraction(args.kv_cache_fraction, *dims)

    @staticmethod
    def _lora_plan(args: EngineArgs, cfg: ModelConfig, tp, act_dtype: torch.dtype) -> tuple[LoRAShapes, AdapterShard | None, int]:
        """The adapters' shapes on this rank (cut like its base weights under TP), the shard, and the bytes their
        compute slots take."""
        shapes, shard = LoRAShapes.of(cfg), None
        if tp is not None:  # this rank pages and computes its shard of each adapter
            from pagedllm.models.sharding import ShardPlan

            shard = AdapterShard.of(shapes, ShardPlan.of(cfg, tp.rank, tp.world_size), cfg.head_dim)
            shapes = shard.shapes
        return shapes, shard, LoRASlots.bytes_for(shapes, args.max_loras, args.max_lora_rank, act_dtype)

    @property
    def model(self) -> LlamaForCausalLM:
        return self.forward_pass.model

    def _profiled_num_blocks(self, args: EngineArgs, probe: memory_profile.MemoryProbe,
                             make_runner: Callable[[KVCache], ForwardPass], dims: tuple, max_model_len: int) -> int:
        """KV blocks that fit in ``gpu_memory_utilization`` of the device once the weights and the peak of a
        forward over the largest step (on a scratch pool just big enough for it) are counted."""
        prompts, need = memory_profile.profile_batch(args.max_num_batched_tokens, args.max_num_seqs, max_model_len,
                                                     args.block_size)
        num_layers, num_kv_heads, head_dim, block_size, kv_dtype = dims
        runner = make_runner(KVCache(num_layers, num_kv_heads, head_dim, need, block_size, dtype=kv_dtype,
                                     device=self.device))
        chunks, first = [], 0
        for p in prompts:
            n = -(-len(p) // block_size)
            chunks.append(SeqChunk(p, 0, list(range(first, first + n))))
            first += n
        scratch_bytes = need * KVCache.bytes_per_block(*dims)  # in the peak, but the real pool replaces it
        budget = memory_profile.profile_kv_budget(probe, args.gpu_memory_utilization,
                                                  functools.partial(runner.execute, chunks), scratch_bytes)
        del runner
        probe.empty_cache()  # the scratch pool's memory goes back before the real pool is allocated
        num_blocks = KVCache.num_blocks_for_budget(budget.kv_bytes, *dims)
        log.info("GPU memory: %s: %d KV blocks, %d tokens", budget.describe(args.gpu_memory_utilization), num_blocks,
                 num_blocks * block_size)
        return num_blocks

    def _decode_graphs(self, args: EngineArgs, tp, kv_dtype: torch.dtype,
                       max_model_len: int) -> cuda_graphs.DecodeGraphs | None:
        """Graphs for decode steps (captured now) where they apply: a device that captures them (CUDA), not
        ``enforce_eager``, a backend whose decode is capturable, one rank (all-reduces inside graphs are not
        set up), a pool whose writes don't wait on the host (int8's block-scale update does) and a spare block."""
        capture = None if args.enforce_eager else cuda_graphs.graph_capture(self.device)
        if capture is None:
            return None
        reasons = [why for why, bad in (
            (f"the {self.forward_pass.backend.name!r} backend", not getattr(self.forward_pass.backend, "graph_safe", False)),
            ("tensor parallelism", tp is not None), ("an int8 KV cache", kv_dtype == torch.int8),
            ("a one-block pool", self.kv_cache.num_blocks < 2)) if bad]
        if reasons:
            log.info("decode steps run eagerly (no CUDA graphs) with %s", ", ".join(reasons))
            return None
        graphs = cuda_graphs.DecodeGraphs(self.forward_pass, args.max_num_seqs, max_model_len,
                                          scratch_block=self.kv_cache.num_blocks - 1, capture=capture)
        t0 = time.perf_counter()
        graphs.capture_all()
        log.info("decode graphs: %d batch sizes (up to %d) captured in %.1f s", len(graphs.sizes), graphs.sizes[-1],
                 time.perf_counter() - t0)
        return graphs

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput | DeferredOutput:
        return self.model_runner.execute_model(so)
