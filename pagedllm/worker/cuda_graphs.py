"""CUDA graphs for decode steps (vLLM's and nano-vllm's scheme): one graph per batch-size bucket, captured
once over fixed input buffers and replayed each step, so a decode step costs one graph launch instead of
hundreds of kernel launches from Python. Prefill and mixed steps, and batches above the largest bucket, run
eagerly; ``EngineArgs.enforce_eager`` turns graphs off.

A bucket has three graphs (``VARIANTS``): the forward alone (hidden states out; the runner samples eagerly),
and the whole decode step, forward, LM head and the sampler (``sampler.sample_plain``: greedy, or temperature
draws from hashed noise, no host sync), with only the sampled ids and their logprobs out; steps whose rows
all have plain settings use those (``ModelRunner``).

Everything the captured forward reads lives in this object's buffers (input ids, positions, slot mapping,
block tables, sequence lengths, query starts), padded to the bucket: a step copies its rows in and sets the
padded rows to a request of one token at position 0 that writes and reads only ``scratch_block``, a pool block
the KV manager never hands out, so padding touches no sequence's cache. The hidden states come back from the
fixed output buffer. The attention metadata of a bucket is built once; its host-side lists are the bucket's
shape and upper bounds (``seq_lens_list`` holds ``max_model_len``), so a backend sizes its launch grids from
the bucket, never from a step's values (``TritonBackend`` then picks split-K or not once per bucket). Only
backends whose decode reads every per-step value from the metadata's tensors (``graph_safe``) can be captured.

Graphs hold the addresses of the model's weights and the KV pool: a new pool or model (another object, or a
pool tensor moved) drops them and captures again (:meth:`DecodeGraphs.invalidate` for weights swapped in
place of others).

The capture itself is a :class:`GraphCapture`: :class:`CudaGraphCapture` (``torch.cuda.CUDAGraph``, every graph
in one memory pool, largest bucket first) on CUDA; ``scripts/gpu_check.sh`` runs it on a GPU. The runner's logic
(buckets, padding, buffer updates, replay, output slicing, eager fallback, invalidation) is also tested on the CPU
with a capture that replays by re-running the captured step on the same buffers (tests/worker/test_cuda_graphs.py).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.models.forward_pass import ForwardPass, StepStats
from pagedllm.worker.sampler import row_settings, sample_plain

log = logging.getLogger("pagedllm.worker")

VARIANTS = ("hidden", "greedy", "sample")  # what a graph ends with: hidden states; + LM head and argmax; + draws
MAX_CAPTURE_SIZE = 512  # vLLM's default: larger decode batches are compute-bound, launches no longer matter


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch-size buckets (vLLM's): 1, 2, 4, every multiple of 8 to 256, then of 16, up to ``max_num_seqs``
    (at most 512)."""
    top = max(1, min(max_num_seqs, MAX_CAPTURE_SIZE))
    sizes = [s for s in (1, 2, 4) if s < top] + list(range(8, min(top, 256) + 1, 8)) + list(range(272, top + 1, 16))
    return sizes if sizes and sizes[-1] == top else sizes + [top]


class GraphCapture(Protocol):
    def capture(self, step: Callable[[], None]) -> Callable[[], None]:
        """Capture ``step`` (which reads and writes fixed buffers only); returns what replays it."""
        ...


class CudaGraphCapture:
    """``torch.cuda.CUDAGraph`` captures sharing one memory pool (capture the largest batch first: the smaller
    graphs then fit in its memory). Not run here (no GPU): see the module docstring."""

    def __init__(self) -> None:
        self.pool = None

    def capture(self, step: Callable[[], None]) -> Callable[[], None]:
        """Other threads keep running during a capture (the KV tiers' copy threads, an earlier engine's): their
        allocations and event waits on their own streams are not this capture's business (``thread_local``; the
        default ``global`` mode let them invalidate it; a device-wide synchronize would still break it, and no
        engine thread makes one), and Python's cyclic GC is off, so that no thread's collection frees an older
        engine's CUDA memory or graphs in the middle of it (torch.cuda.graph collects just before)."""
        step()  # warm-up: Triton compiles its kernels and lazy allocations happen outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with gc_paused(), torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            step()
        if self.pool is None:
            self.pool = graph.pool()
        torch.cuda.synchronize()
        return graph.replay


@contextmanager
def gc_paused() -> Iterator[None]:
    """Automatic garbage collection off (for every thread) inside the block; an explicit ``gc.collect()`` still runs."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def graph_capture(device: torch.device) -> GraphCapture | None:
    """The capture for ``device``: CUDA graphs on CUDA, none elsewhere (the CPU runs decode steps eagerly)."""
    return CudaGraphCapture() if device.type == "cuda" else None


class DecodeGraphs:
    """Decode steps of ``runner`` through graphs captured per bucket over this object's buffers."""

    def __init__(self, runner: ForwardPass, max_num_seqs: int, max_model_len: int, scratch_block: int,
                 capture: GraphCapture) -> None:
        kv = runner.kv_cache
        if not 0 <= scratch_block < kv.num_blocks:
            raise ValueError(f"scratch_block {scratch_block} is not a block of the {kv.num_blocks}-block pool")
        self.runner = runner
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.scratch_block = scratch_block
        self.capture = capture
        n, dev, bs = self.sizes[-1], kv.data.device, kv.block_size
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)  # one query per sequence
        self.block_tables = torch.zeros((n, -(-max_model_len // bs)), dtype=torch.int32, device=dev)
        model = runner.model
        self.hidden = torch.zeros((n, model.config.hidden_size), dtype=model.act_dtype, device=dev)
        self.temperature = torch.zeros(n, dtype=torch.float32, device=dev)  # the sampling graphs' settings ...
        self.noise_key = torch.zeros(n, dtype=torch.int64, device=dev)
        self.counters = torch.zeros(n, dtype=torch.int64, device=dev)
        self.sampled = torch.zeros(n, dtype=torch.int64, device=dev)  # ... and results
        self.logprobs = torch.zeros(n, dtype=torch.float32, device=dev)
        self._replays: dict[tuple[int, str], Callable[[], None]] = {}
        self.capture_seconds = 0.0
        self._signature: tuple = ()
        self.num_captures = 0  # buckets captured so far (each: one graph per variant)
        self.replays = dict.fromkeys(self.sizes, 0)  # replays per bucket
        self.variant_replays = dict.fromkeys(VARIANTS, 0)

    def can_run(self, meta: AttentionMetadata) -> bool:
        """A decode-only step no larger than the largest bucket."""
        return meta.num_decodes == meta.num_seqs and 0 < meta.num_seqs <= self.sizes[-1]

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``ForwardPass.forward``: hidden states ``[T, E]``, from a graph for decode steps that fit one (a view
        of the output buffer, valid until the next step), else eagerly."""
        if not self.can_run(meta):
            return self.runner.forward(input_ids, meta)
        b = self._load(input_ids, meta)
        self._replay(b, "hidden")
        return self.hidden[:b]

    def forward_sample(self, input_ids: torch.Tensor, meta: AttentionMetadata, temperature: list[float],
                       noise_key: torch.Tensor, counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole decode step in one graph: forward, LM head and ``sample_plain`` (rows of plain settings,
        ``can_run(meta)`` holds). Returns the sampled ids and their logprobs on the device (views of the output
        buffers, valid until the next step)."""
        b = self._load(input_ids, meta)
        self.temperature[:b].copy_(row_settings(temperature, torch.float32, self.temperature.device), non_blocking=True)
        self.noise_key[:b].copy_(noise_key, non_blocking=True)
        self.counters[:b].copy_(counters, non_blocking=True)
        self._replay(b, "sample" if any(t > 0 for t in temperature) else "greedy")
        return self.sampled[:b], self.logprobs[:b]

    def _load(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> int:
        """Copy a decode step's inputs into the buffers (capturing first if the model or pool changed)."""
        if self._signature != self._current_signature():  # first step, or a new model / pool since the capture
            self.capture_all()
        b = meta.num_seqs
        self.input_ids[:b].copy_(input_ids, non_blocking=True)
        self.positions[:b].copy_(meta.positions, non_blocking=True)
        self.slot_mapping[:b].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:b].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:b, : meta.block_tables.shape[1]].copy_(meta.block_tables, non_blocking=True)
        return b

    def _replay(self, b: int, variant: str) -> None:
        size = next(s for s in self.sizes if s >= b)
        self._pad(b, size)
        self._replays[size, variant]()
        self.replays[size] += 1
        self.variant_replays[variant] += 1
        self.runner.last_step = StepStats(b, b, b)

    def capture_all(self) -> None:
        """Capture every bucket's graphs, largest first."""
        self._signature = self._current_signature()
        t0 = time.perf_counter()
        for size in reversed(self.sizes):
            self._pad(0, size)  # a capture runs on padding rows only: it writes nothing but the scratch block
            for variant in VARIANTS:
                self._replays[size, variant] = self.capture.capture(self._step(size, variant))
            self.num_captures += 1
        self.capture_seconds = time.perf_counter() - t0
        log.info("captured decode graphs (%s) for batch sizes %s in %.2f s", "/".join(VARIANTS), self.sizes,
                 self.capture_seconds)

    def invalidate(self) -> None:
        """Drop every graph; the next decode step captures again. For weights replaced by other tensors in the
        same model (a new model or pool is noticed without it: checking every weight's address each step would
        cost more than a graph saves at batch 1)."""
        self._replays.clear()
        self._signature = ()

    def _current_signature(self) -> tuple:
        r = self.runner
        return id(r.model), id(r.backend), id(r.kv_cache), r.kv_cache.data.data_ptr()

    def _pad(self, b: int, size: int) -> None:
        """Rows ``[b, size)``: one token at position 0 writing and attending the scratch block's first slot."""
        if b < size:
            self.input_ids[b:size].zero_()
            self.positions[b:size].zero_()
            self.slot_mapping[b:size].fill_(self.scratch_block * self.runner.kv_cache.block_size)
            self.seq_lens[b:size].fill_(1)
            self.block_tables[b:size, 0].fill_(self.scratch_block)
            self.temperature[b:size].zero_()  # padding rows decode greedily

    def _step(self, size: int, variant: str) -> Callable[[], None]:
        """The forward over the first ``size`` rows of the buffers, into the output buffer; ``variant`` past
        "hidden": then the LM head and the sampler (greedy only, or with draws), into the sample buffers."""
        r = self.runner
        meta = AttentionMetadata(
            positions=self.positions[:size], slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1], seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size], block_size=r.kv_cache.block_size, num_decodes=size,
            query_lens_list=[1] * size, seq_lens_list=[self.max_model_len] * size)
        ids, out = self.input_ids[:size], self.hidden[:size]
        model, kv_cache, backend = r.model, r.kv_cache, r.backend  # what a graph holds: fixed at capture
        temps, keys, counters = self.temperature[:size], self.noise_key[:size], self.counters[:size]
        sampled, logprobs = self.sampled[:size], self.logprobs[:size]

        def step() -> None:
            hidden = model(ids, meta.positions, kv_cache, meta, backend)
            out.copy_(hidden)
            if variant != "hidden":
                tokens, lps = sample_plain(model.compute_logits(hidden), temps, keys, counters, variant == "sample")
                sampled.copy_(tokens)
                logprobs.copy_(lps)

        return step
