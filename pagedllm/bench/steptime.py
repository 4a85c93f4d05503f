"""``pagedllm bench steptime``: where a decode step's host time goes (issue 30, item 1 on the CPU); with
``--w1``, where a whole W1 run's step time goes, model ops included (issue 36, item 4: ``bench/step_split.py``).

Runs greedy, sampled and filtered decode (temperature 1 with top-k 50, top-p 0.9, repetition and presence
penalties: the settings of many chat clients) at a few batch sizes through ``LLMEngine.step`` with the step's parts
timed by wrapping their methods in this process: scheduling, the core's diff for the worker, the
worker's batch update and input preparation, the forward pass, the LM head, the sampler, folding the
outputs into the core (stop rules), and the front end (detokenization, stop strings). "other" is the
step's time the parts do not cover (Python glue, the executor call, output objects).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from pagedllm.bench.report import Report, Table
from pagedllm.bench.workloads import CHAT_SAMPLING, GREEDY

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


# column -> the requests' sampling settings
SETTINGS = {"greedy": GREEDY, "sampled": {"temperature": 1.0, "seed": 1},
            "filtered": {**CHAT_SAMPLING, "seed": 1}}


def _breakdown(llm, batch: int, steps: int, settings: dict) -> dict[str, float]:
    """Mean ms per decode step of each part, over ``steps`` steps of ``batch`` sequences (prefill excluded)."""
    from pagedllm.protocol import SamplingParams

    eng = llm.engine
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True, **settings)
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


def add_args(p) -> None:
    p.add_argument("--w1", action="store_true",
                   help="time a whole W1 run (64 requests, prompts 32-512, outputs 16-256) by part instead: GEMMs, "
                        "attention (decode / prefill), norms, LM head, sampler, the Python per step")


def run_w1(args) -> Report:
    """W1 (``--quick``: its tiny version) once untimed to warm up, then once with every part timed."""
    import torch

    from pagedllm.bench.common import engine_warmup, make_llm
    from pagedllm.bench.step_split import measure_w1, split_tables
    from pagedllm.bench.workloads import W1, W1_QUICK, random_requests

    w = W1_QUICK if args.quick else W1
    llm = make_llm(args.dtype, seed=args.seed, **args.engine_args)
    reqs = random_requests(llm.engine.tokenizer, w["num"], w["prompt_range"], w["output_range"], seed=args.seed)
    engine_warmup(llm)
    r = measure_w1(llm, reqs)
    model = llm.engine.forward_pass.model
    rep = Report("steptime", "W1 step time by part",
                 [(f"W1: {w['num']} requests, prompts {w['prompt_range']}, outputs {w['output_range']}, greedy, "
                   f"ignore_eos; SmolLM2-135M, {model.act_dtype}, quantization {model.quantization}, "
                   f"{torch.get_num_threads()} torch threads; {r['output_tokens'] / r['elapsed_s']:.1f} out tok/s "
                   "with the timers on; exclusive wall and CPU time per part (a part inside another counts for itself)")])
    rep.tables += split_tables(r)
    rep.result = {"w1": r}
    return rep


def run(args) -> Report:
    import torch

    from pagedllm.entrypoints.llm import LLM

    if getattr(args, "w1", False):
        return run_w1(args)

    sizes = [1, 4] if args.quick else [1, 16, 64]
    steps = 4 if args.quick else 32
    llm = LLM(dtype=args.dtype, seed=args.seed, **{"kv_cache_memory": 256 << 20, **args.engine_args})
    cols, res = [], {}
    for b in sizes:
        for kind, settings in SETTINGS.items():
            name = f"batch {b} {kind}"
            cols.append(name)
            res[name] = _breakdown(llm, b, steps, settings)
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
    if "w1" in result:
        sec = result["w1"]["cpu_s"]
        labels = sorted(sec, key=sec.get)
        ax.barh(range(len(labels)), [100 * sec[k] / result["w1"]["step_cpu_s"] for k in labels])
        ax.set_yticks(range(len(labels)), labels, fontsize=6)
        ax.set_xlabel("% of W1 step CPU time")
        ax.set_title("W1 step time by part")
        return
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
