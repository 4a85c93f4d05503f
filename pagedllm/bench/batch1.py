"""``pagedllm bench batch1``: batch-1 decode of the embedded model, each path of ours against the one it replaced and
against llama.cpp on the same GGUF, in one process, the systems alternating round by round.

Besides wall time it reports the process's CPU time per token (all threads, ``time.process_time``): on a machine shared
with other work the wall time of one run moves by 2x with the neighbours' load, while the CPU time a token costs
moves far less, so the CPU-time ratios are what a loaded machine can still measure (spinning OpenMP threads count
as CPU time: compare CPU times at one thread). Decode time per token = (time of 1 + N tokens - time of 1) / N, so
the prompt's prefill is left out.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import time
from collections.abc import Callable

from pagedllm.bench.report import Report, Table

LLAMA_CPP = "llama.cpp (llama-cpp-python, same GGUF)"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3; quick 1)")
    p.add_argument("--decode-tokens", type=int, default=None, help="decode tokens per run (default 96; quick 4)")


def _systems(args) -> tuple[dict[str, Callable[[int], None]], list[str]]:
    """name -> generate(n tokens) for each system, and notes on the ones skipped."""
    from pagedllm.bench.common import engine_warmup, make_llm
    from pagedllm.bench.workloads import corpus
    from pagedllm.models import decode_layer, quant
    from pagedllm.protocol import SamplingParams

    notes = []
    # the block paths compute in fp32; dtype auto's gguf-bf16 (CPUs with native bf16) decodes one token a step on
    # exactly the gguf path's kernels, so its batch-1 rate is the exact rows'
    dtype = "float32" if args.dtype == "auto" else args.dtype
    engines = {q: make_llm(dtype, num_blocks=64, **{**args.engine_args, "quantization": q})
               for q in ("gguf", "gguf-a8")}
    for llm in engines.values():
        engine_warmup(llm)
    ids = corpus(engines["gguf"].engine.tokenizer, args.seed).window(32, random.Random(args.seed + 1))

    def ours(q: str, factored: bool, fused: bool, one_region: bool = True) -> Callable[[int], None]:
        def run(n: int) -> None:
            quant.FACTORED_GEMV, decode_layer.FUSED, decode_layer.ONE_REGION = factored, fused, one_region
            try:
                engines[q].generate([ids], SamplingParams(max_tokens=n, ignore_eos=True, temperature=0),
                                    use_tqdm=False)
            finally:
                quant.FACTORED_GEMV, decode_layer.FUSED, decode_layer.ONE_REGION = True, True, True
        return run

    systems = {
        "exact (gguf): batch-1 GEMV + one call for the layers, one parallel region": ours("gguf", True, True),
        "exact (gguf): batch-1 GEMV + one call for the layers, a region per op": ours("gguf", True, True, False),
        "exact (gguf): batch-1 GEMV, per-op layer": ours("gguf", True, False),
        "exact (gguf): gemm.cpp bit-exact, per-op layer (before)": ours("gguf", False, False),
        "gguf-a8: one call for the layers, one parallel region": ours("gguf-a8", True, True),
        "gguf-a8: one call for the layers, a region per op": ours("gguf-a8", True, True, False),
        "gguf-a8: per-op layer (before)": ours("gguf-a8", True, False),
    }
    if importlib.util.find_spec("llama_cpp") is None:
        notes.append("llama-cpp-python is not installed: its row is skipped")
    else:
        import torch
        from llama_cpp import Llama

        from pagedllm.models.loader import default_model_path

        nt = torch.get_num_threads()
        lc = Llama(model_path=default_model_path(), n_ctx=512, n_threads=nt, n_threads_batch=nt, n_batch=512,
                   verbose=False, use_extra_bufts=False)

        def llama_cpp(n: int) -> None:
            lc.reset()
            for i, _ in enumerate(lc.generate(ids, temp=0.0, top_k=1, reset=True)):  # never stops by itself
                if i + 1 >= n:
                    break

        systems[LLAMA_CPP] = llama_cpp
        notes.append(f"llama.cpp runs {nt} fixed threads (torch's count when the engines were built); our engines "
                     f"their cpu_thread_policy ({engines['gguf'].engine.args.cpu_thread_policy}).")
    return systems, notes


def _measure(generate: Callable[[int], None], n: int) -> tuple[float, float]:
    """(wall, CPU) ms per decode token."""
    w0, c0 = time.perf_counter(), time.process_time()
    generate(1)
    w1, c1 = time.perf_counter(), time.process_time()
    generate(n + 1)
    w2, c2 = time.perf_counter(), time.process_time()
    return ((w2 - w1) - (w1 - w0)) / n * 1e3, ((c2 - c1) - (c1 - c0)) / n * 1e3


def _median(v: list[float]) -> float:
    s = sorted(v)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def run(args) -> Report:
    import torch

    rounds = args.rounds or (1 if args.quick else 3)
    tokens = args.decode_tokens or (4 if args.quick else 96)
    systems, notes = _systems(args)
    for generate in systems.values():
        generate(2)  # first-call costs
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in systems}
    loads = [os.getloadavg()[0]]
    for r in range(rounds):
        for name in (list(systems) if r % 2 == 0 else list(reversed(systems))):
            runs[name].append(_measure(systems[name], tokens))
        loads.append(os.getloadavg()[0])
    base_cpu = _median([c for _, c in runs[LLAMA_CPP]]) if LLAMA_CPP in runs else None
    rows = []
    for name, v in runs.items():
        wall, cpu = _median([w for w, _ in v]), _median([c for _, c in v])
        rows.append([name, 1e3 / wall, wall, cpu, base_cpu / cpu if base_cpu else "-",
                     " / ".join(f"{w:.1f}" for w, _ in v)])
    notes = [f"torch threads at the end: {torch.get_num_threads()}; {rounds} rounds, the systems alternating; {tokens} decode tokens "
             "after a 32-token prompt, greedy; medians over the rounds.",
             f"1-minute load average at the start and after each round: {', '.join(f'{x:.1f}' for x in loads)}.",
             *notes]
    table = Table(["system", "decode tok/s (wall)", "wall ms/token", "CPU ms/token", "llama.cpp CPU / ours",
                   "wall ms/token per round"], rows, "Batch-1 decode: wall and CPU time per token", 2)
    rep = Report("batch1", "Batch-1 decode: our paths vs the ones they replaced vs llama.cpp", notes, [table])
    rep.result = {"runs": runs, "loadavg": loads, "tokens": tokens, "rounds": rounds,
                  "threads": torch.get_num_threads()}
    return rep


def plot(fig, result: dict) -> None:
    ax = fig.add_subplot(111)
    names = list(result["runs"])
    cpu = [_median([c for _, c in result["runs"][n]]) for n in names]
    ax.barh(range(len(names)), cpu)
    ax.set_yticks(range(len(names)), [n[:48] for n in names], fontsize=6)
    ax.set_xlabel("CPU ms per decode token (lower is better)")
