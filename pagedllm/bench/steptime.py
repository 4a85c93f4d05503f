"""``pagedllm bench steptime``: where a decode step's host time goes (issue 30, item 1 on the CPU).

Runs greedy and sampled decode at a few batch sizes through ``LLMEngine.step`` with the step's parts
timed by wrapping their methods in this process: scheduling, the core's diff for the worker, the
worker's batch update and input preparation, the forward pass, the LM head, the sampler, folding the
outputs into the core (stop rules), and the front end (detokenization, stop strings). "other" is the
step's time the parts do not cover (Python glue, the executor call, output objects).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from pagedllm.bench.report import Report, Table

PARTS = {  # label -> (module, class, method)
    "schedule": ("pagedllm.core.scheduler", "Scheduler", "schedule"),
    "core -> worker diff": ("pagedllm.core.engine_core", "EngineCore", "_worker_step"),
    "worker batch update": ("pagedllm.worker.input_batch", "InputBatch", "apply"),
    "worker input prep": ("pagedllm.worker.input_batch", "InputBatch", "prepare"),
    "forward (layers)": ("pagedllm.models.forward_pass", "ForwardPass", "forward"),
    "lm head": ("pagedllm.models.llama", "LlamaForCausalLM", "compute_logits"),
    "sampler": ("pagedllm.worker.sampler", "Sampler", "__call__"),
    "core update (stops)": ("pagedllm.core.engine_core", "EngineCore", "_update"),
    "front end (detokenize)": ("pagedllm.frontend.output_processor", "OutputProcessor", "process"),
}


@contextmanager
def timed_parts(totals: dict[str, float]):
    """Wrap each part's method to add its wall time to ``totals[label]``; restored on exit."""
    import importlib

    saved = []
    for label, (mod, cls, meth) in PARTS.items():
        klass = getattr(importlib.import_module(mod), cls)
        orig = getattr(klass, meth)

        def wrapper(*a, _orig=orig, _label=label, **kw):
            t0 = time.perf_counter()
            try:
                return _orig(*a, **kw)
            finally:
                totals[_label] = totals.get(_label, 0.0) + time.perf_counter() - t0

        setattr(klass, meth, wrapper)
        saved.append((klass, meth, orig))
    try:
        yield
    finally:
        for klass, meth, orig in saved:
            setattr(klass, meth, orig)


def _breakdown(llm, batch: int, steps: int, temperature: float) -> dict[str, float]:
    """Mean ms per decode step of each part, over ``steps`` steps of ``batch`` sequences (prefill excluded)."""
    from pagedllm.protocol import SamplingParams

    eng = llm.engine
    params = SamplingParams(temperature=temperature, max_tokens=steps + 2, ignore_eos=True, seed=1 if temperature else None)
    for i in range(batch):
        eng.add_request([100 + i] * 64, params)
    eng.step()  # the prefill
    eng.step()
    totals: dict[str, float] = {}
    with timed_parts(totals):
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        totals["step (total)"] = time.perf_counter() - t0
    while eng.has_unfinished():
        eng.step()
    ms = {k: 1000 * v / steps for k, v in totals.items()}
    ms["other"] = ms["step (total)"] - sum(ms.get(k, 0.0) for k in PARTS)
    return ms


def run(args) -> Report:
    import torch

    from pagedllm.entrypoints.llm import LLM

    sizes = [1, 4] if args.quick else [1, 16, 64]
    steps = 4 if args.quick else 32
    llm = LLM(dtype=args.dtype, seed=args.seed, **{"kv_cache_memory": 256 << 20, **args.engine_args})
    cols, res = [], {}
    for b in sizes:
        for temp in (0.0, 1.0):
            name = f"batch {b} {'greedy' if temp == 0 else 'sampled'}"
            cols.append(name)
            res[name] = _breakdown(llm, b, steps, temp)
    labels = ["step (total)", *PARTS, "other"]
    rows = [[lab] + [res[c].get(lab, 0.0) for c in cols] for lab in labels]
    rows += [[f"{lab} (%)"] + [100 * res[c].get(lab, 0.0) / res[c]["step (total)"] for c in cols]
             for lab in ("sampler", "front end (detokenize)", "schedule", "worker input prep")]
    rep = Report("steptime", "Host time of a decode step by part (ms per step)",
                 [f"SmolLM2-135M, {llm.engine.core.spec.dtype}, 64-token prompts, mean of {steps} decode steps, "
                  f"{torch.get_num_threads()} torch threads; parts timed by wrapping their methods"])
    rep.tables.append(Table(["part"] + cols, rows, digits=2))
    rep.result = {"batch_sizes": sizes, "steps": steps, "ms": res}
    return rep


def plot(fig, result: dict) -> None:
    ax = fig.add_subplot(111)
    cols = list(result["ms"])
    bottom = [0.0] * len(cols)
    for part in [*PARTS, "other"]:
        vals = [result["ms"][c].get(part, 0.0) for c in cols]
        ax.bar(range(len(cols)), vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(cols)), cols, rotation=20, fontsize=7)
    ax.set_ylabel("ms per decode step")
    ax.set_title("Decode step host time by part")
    ax.legend(fontsize=6)
