"""Where a whole W1 run's step time goes, by part (issue 36, item 4): ``pagedllm bench steptime --w1``.

Every part is timed by wrapping the function that does it, in this process, and charged its **exclusive** wall and CPU
time: a part called inside another (a GEMM inside a decoder layer) counts for itself, not for its caller, so the
parts add up to the steps' time and "other" is what no part covers. Opaque parts (the LM head, the sampler, the
batch-1 fused layers) are timed whole: nothing inside them is split out. The fused calls of several rows
(``models/decode_layer.py``, and ``models/bf16_layers.py`` for gguf-bf16) are turned off while timing, so that their
layers' ops are split: the same ops, with the Python between them that the calls save (~1.5-2 ms of a 36-row decode
step on a Zen 4) counted as glue.

Attention is timed in two calls per layer, the decode rows and then the prefill chunks, through the backend's own
routing (the paged kernel's work items as in the one ``attend_qkv`` call it replaces, SDPA or the AMX kernel for long
chunks over a bf16 pool; the same output; one extra fork/join per layer).
"""

from __future__ import annotations

import importlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import torch

# label -> (module, owner (a class name, or None for a module-level function), attribute, opaque)
STEP = "step (total)"
PARTS: dict[str, tuple[str, str | None, str, bool]] = {
    "schedule": ("pagedllm.core.scheduler", "Scheduler", "schedule", False),
    "core -> worker diff": ("pagedllm.core.engine_core", "EngineCore", "_worker_step", False),
    "worker batch update": ("pagedllm.worker.input_batch", "InputBatch", "apply", False),
    "worker input prep": ("pagedllm.worker.input_batch", "InputBatch", "prepare", False),
    "forward glue (Python)": ("pagedllm.models.llama", "LlamaDecoderLayer", "forward", False),
    "embedding": ("pagedllm.models.llama", "LlamaForCausalLM", "embed_tokens", False),
    "GEMMs (layers)": ("pagedllm.models.llama", None, "linear", False),
    # the gate/up GEMM with silu * up after it (one pass on an AMX copy): a GEMM in the rows table
    "gate/up GEMM + silu (layers)": ("pagedllm.models.llama", None, "linear_silu_mul", False),
    "add + RMSNorm": ("pagedllm.models.llama", None, "add_rms_norm_", False),
    "rotary": ("pagedllm.models.llama", None, "apply_rope_heads_", False),
    "silu * up": ("pagedllm.models.llama", None, "silu_mul", False),
    "batch-1 fused layers": ("pagedllm.models.decode_layer", "FusedDecode", "__call__", True),
    "LM head": ("pagedllm.models.llama", "LlamaForCausalLM", "compute_logits", True),
    "sampler": ("pagedllm.worker.sampler", "Sampler", "__call__", True),
    "runner outputs (gather, to host)": ("pagedllm.worker.model_runner", "ModelRunner", "_outputs", False),
    "core update (stops)": ("pagedllm.core.engine_core", "EngineCore", "_update", False),
    "front end (detokenize)": ("pagedllm.frontend.output_processor", "OutputProcessor", "process", False),
}
GEMM_PARTS = ("GEMMs (layers)", "gate/up GEMM + silu (layers)")  # their rows and flops make the GEMM table
ATTENTION = ("attention, decode rows", "attention, prefill chunks")
# what a row of the table adds up: the step's Python outside the model
HOST_PARTS = ("schedule", "core -> worker diff", "worker batch update", "worker input prep",
              "runner outputs (gather, to host)", "core update (stops)", "front end (detokenize)", "other")
GEMM_ROWS = ((1, 1), (2, 15), (16, 63), (64, 255), (256, 1 << 30))  # row buckets of the GEMM table


class ExclusiveTimers:
    """Exclusive wall and process CPU seconds (every thread's) and calls per label; ``gemm`` holds (wall seconds,
    flops) per GEMM row bucket. The CPU time is what a part costs on a shared machine, where its wall time also
    holds the neighbours' share of the cores."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.gemm: dict[tuple[int, int], list[float]] = {b: [0.0, 0.0, 0.0] for b in GEMM_ROWS}
        self._stack: list[list] = []  # [label, wall start, cpu start, wall and cpu seconds of the parts inside]
        self._opaque = 0  # > 0 inside an opaque part: nothing is timed there

    @contextmanager
    def part(self, label: str, opaque: bool = False) -> Iterator[None]:
        if self._opaque:
            yield
            return
        frame = [label, time.perf_counter(), time.process_time(), 0.0, 0.0]
        self._stack.append(frame)
        self._opaque += opaque
        try:
            yield
        finally:
            self._opaque -= opaque
            self._stack.pop()
            wall, cpu = time.perf_counter() - frame[1], time.process_time() - frame[2]
            self.seconds[label] += wall - frame[3]
            self.cpu[label] += cpu - frame[4]
            self.calls[label] += 1
            if self._stack:
                self._stack[-1][3] += wall
                self._stack[-1][4] += cpu

    def wrap(self, fn: Callable, label: str, opaque: bool) -> Callable:
        def timed(*a, **kw):
            with self.part(label, opaque):
                return fn(*a, **kw)

        return timed

    def wrap_gemm(self, fn: Callable, label: str) -> Callable:
        """``linear(x, w, ...)``: timed as a part, and its seconds and flops added to x's row bucket."""
        def timed(x, w, *a, **kw):
            if self._opaque:
                return fn(x, w, *a, **kw)
            wall, cpu = self.seconds[label], self.cpu[label]
            with self.part(label):
                out = fn(x, w, *a, **kw)
            rows = x.shape[0]
            g = self.gemm[next(b for b in GEMM_ROWS if b[0] <= rows <= b[1])]
            g[0] += self.seconds[label] - wall
            g[1] += self.cpu[label] - cpu
            g[2] += 2.0 * rows * w.shape[0] * w.shape[1]
            return out

        return timed

    def attention_split(self, backend) -> Callable:
        """``forward_qkv`` of the CPU backend as two timed calls of its own routing (``attend``): decode rows, then
        prefill chunks (each on the path the backend picks for it: paged kernel, SDPA or the AMX kernel)."""
        def forward_qkv(qkv, num_heads, k_cache, v_cache, meta, scale):
            from pagedllm.attention.cpu import kernel_args

            T, D, Hkv = qkv.shape[0], k_cache.shape[2], k_cache.shape[0]
            kd, vd, scales = kernel_args(k_cache, v_cache)
            q = qkv[:, : num_heads * D].view(T, num_heads, D)
            k = qkv[:, num_heads * D: (num_heads + Hkv) * D].view(T, Hkv, D)
            v = qkv[:, (num_heads + Hkv) * D:].view(T, Hkv, D)
            out = torch.empty(T, num_heads, D, dtype=qkv.dtype)
            n, nd = meta.num_seqs, meta.num_decodes
            for label, b, e in ((ATTENTION[0], 0, nd), (ATTENTION[1], nd, n)):
                if b == e:
                    continue
                with self.part(label):
                    if b == 0:  # the step's K/V rows go in first, charged to the first kernel call
                        torch.ops.pagedllm.write_kv.default(k, v, kd, vd, meta.slot_mapping,
                                                            block_size=meta.block_size, **scales)
                    backend.attend(q, k_cache, v_cache, out, meta, float(scale), b, e)
            return out.view(T, num_heads * D)

        return forward_qkv


@contextmanager
def timed_parts(timers: ExclusiveTimers, backend) -> Iterator[None]:
    """Every part of ``PARTS`` and the step itself wrapped by ``timers``, the backend's ``forward_qkv`` split
    (a CPU backend's: others keep theirs, timed inside "forward glue"); all restored on exit."""
    with ExitStack() as stack:
        def patch(owner, attr: str, new) -> None:
            old = getattr(owner, attr)
            setattr(owner, attr, new)
            stack.callback(setattr, owner, attr, old)

        for label, (mod, cls, attr, opaque) in PARTS.items():
            module = importlib.import_module(mod)
            owner = module if cls is None else getattr(module, cls)
            fn = getattr(owner, attr)
            patch(owner, attr, timers.wrap_gemm(fn, label) if label in GEMM_PARTS else timers.wrap(fn, label, opaque))
        from pagedllm.frontend.llm_engine import LLMEngine
        from pagedllm.models import bf16_layers, decode_layer

        patch(LLMEngine, "step", timers.wrap(LLMEngine.step, STEP, False))
        patch(bf16_layers, "FUSED", False)
        one_row = decode_layer.FusedDecode.applies
        patch(decode_layer.FusedDecode, "applies", lambda self, h, *a: h.shape[0] == 1 and one_row(self, h, *a))
        if getattr(backend, "name", None) == "cpu" and backend.sdpa_prefill_min_len is None:
            backend.forward_qkv = timers.attention_split(backend)
            stack.callback(delattr, backend, "forward_qkv")  # the class's method again
        yield


def measure_w1(llm, reqs) -> dict:
    """Run ``reqs`` (greedy, ignore_eos) through ``llm`` with every part timed; the run's totals by part."""
    from pagedllm.bench.common import run_engine

    timers = ExclusiveTimers()
    with timed_parts(timers, llm.engine.forward_pass.backend):
        res = run_engine(llm, reqs, system="pagedllm (timed parts)", progress=False)
    seconds, cpu = dict(timers.seconds), dict(timers.cpu)
    seconds["other"], cpu["other"] = seconds.pop(STEP, 0.0), cpu.pop(STEP, 0.0)
    return {
        "steps": res.extra["num_steps"], "output_tokens": res.output_tokens, "elapsed_s": res.elapsed_s,
        "step_s": sum(seconds.values()), "step_cpu_s": sum(cpu.values()), "seconds": seconds, "cpu_s": cpu,
        "calls": dict(timers.calls),
        "gemm": [[lo, hi, *g] for (lo, hi), g in timers.gemm.items()],  # rows, wall s, CPU s, flops
    }


def split_tables(r: dict) -> list:
    """The W1 split (parts by CPU time, with sums of the brief's groups) and the GEMMs by rows."""
    from pagedllm.bench.report import Table

    wall, cpu, steps = r["seconds"], r["cpu_s"], r["steps"]

    def row(label: str, parts) -> list:
        w, c = sum(wall.get(p, 0.0) for p in parts), sum(cpu.get(p, 0.0) for p in parts)
        return [label, w, 100 * w / r["step_s"], c, 100 * c / r["step_cpu_s"], 1000 * w / steps]

    rows = [row(p, [p]) for p in sorted(cpu, key=cpu.get, reverse=True) if wall[p] > 0]
    rows += [row("= attention (both)", ATTENTION),
             row("= norms, rotary, silu", ("add + RMSNorm", "rotary", "silu * up")),
             row("= Python per step (host parts + other)", HOST_PARTS), row(STEP, list(wall))]
    split = Table(["part", "wall s", "% wall", "CPU s", "% CPU", "wall ms / step"], rows,
                  f"W1 step time by part ({steps} steps, {r['output_tokens']} output tokens)", digits=2)
    gemm = [[f"{lo}" if lo == hi else f"{lo}-{hi}" if hi < 1 << 30 else f">= {lo}", w, 100 * w / r["step_s"], c,
             100 * c / r["step_cpu_s"], f / w / 1e9 if w else None, f / c / 1e9 if c else None]
            for lo, hi, w, c, f in r["gemm"]]
    gemms = Table(["GEMM rows (tokens)", "wall s", "% wall", "CPU s", "% CPU", "GFLOP/s (wall)", "GFLOP/s per CPU s"],
                  gemm, "W1 layer GEMMs by rows", digits=2)
    return [split, gemms]
