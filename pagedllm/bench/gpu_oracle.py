"""The HF oracle on one device: greedy tokens of every attention backend x dtype x KV dtype against HF
``generate`` on the same weights, dtype and device.

Where the pool rounds the model's K/V (int8, fp8, or a float dtype other than the model's), HF attends over the
same rounded values (:class:`~pagedllm.models.paged_cache.PagedCache` in a pool of that dtype and block size,
written through the engine's write path), so a row compares kernels, not the pool's rounding: on random weights
e5m2's rounding alone moved first tokens (an H200 row, and 2 of 4 seeds on the CPU). The ``plain`` column is the
agreement with HF over unrounded K/V, what the rounding costs (no verdict on it: ``pagedllm bench kvquant``
measures that on real weights).

The verdict follows the project's stated tolerances: fp32 weights with an fp32 pool must be token-identical to
HF ("exact"); other rows must agree on at least 90% of the tokens, counted per prompt up to its first divergence
("close", the rule of tests/engine/test_kv_quant_engine.py). There, a divergence where HF itself nearly tied (HF's
logit of the engine's token within ``TIE`` of HF's top logit, relative to the largest logit) counts the prompt as
agreeing: random weights of real shapes give flat logits (the ``ties`` column counts them; a row's note gives the
gap of each other divergence). The exact rows excuse nothing. A combination the engine refuses at start by design
(flex over a quantized pool, the C++ kernels on CUDA or with fp16) is listed as refused; any other error fails.
Prints a table, a row as each combination completes (a time-boxed run keeps what it finished), writes the rows as
JSON with ``--json``, and exits 1 when a row fails.

usage: python -m pagedllm.bench.gpu_oracle --model DIR [--device cuda] [--backends reference,flex,triton]
       [--dtypes float32,bfloat16,float16] [--kv-dtypes auto,float32,...] [--prompts 8] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import asdict, dataclass

import torch

from pagedllm.models.paged_cache import hf_cache_kwargs

KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e5m2")
BLOCK_SIZE = 16  # the engine's and the HF pool cache's (int8 scales are per block)
CLOSE = 0.9  # share of tokens that must agree before each prompt's first divergence
TIE = 0.01  # a divergence within 1% of HF's top logit (relative to the largest |logit|) is HF's own near-tie
# refusals that are the design, not a failure (pagedllm/config/device.py: DeviceConfig.check_backend)
EXPECTED_REFUSALS = ("the flex backend reads float pools only", "runs C++ CPU kernels, not on",
                     "the CPU kernels take float32 or bfloat16 activations")


@dataclass
class Row:
    backend: str
    dtype: str
    kv_dtype: str
    agreement: float  # share of tokens equal to HF's before each prompt's first divergence
    first_divergence: int  # the earliest divergence over the prompts (max_tokens: none)
    verdict: str  # exact / close / refused / FAIL
    seconds: float
    note: str = ""
    ties: int = 0  # prompts whose divergence was a near-tie of HF's (counted as agreeing, never for exact rows)
    plain: float = 0.0  # agreement with HF over unrounded K/V (what a lossy pool costs; no verdict on it)


def prompts_for(tokenizer, n: int) -> list[list[int]]:
    """``n`` prompts of different lengths (a few tokens to a few hundred), as token ids."""
    words = "the paged cache keeps every block of keys and values in one pool shared by all sequences".split()
    return [tokenizer.encode(" ".join(words[(i * 5) % len(words):] + words * (i * i % 7)))[:400] or [1]
            for i in range(n)]


def hf_greedy(model, prompts: list[list[int]], max_tokens: int, cache=None) -> list[list[int]]:
    """HF ``generate``'s greedy tokens; ``cache()``, where given, makes each prompt's KV cache (a PagedCache)."""
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=model.device)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                                 **hf_cache_kwargs(model, cache() if cache else None))
            out.append(gen[0, len(p):].tolist())
    return out


def hf_gap(model, context: list[int], token: int, cache=None) -> float:
    """How far HF's logit of ``token`` after ``context`` lies below its top logit, relative to the largest |logit|
    (a near-tie when at most ``TIE``); over ``cache()``'s pool where given."""
    with torch.inference_mode():
        logits = model(torch.tensor([context], device=model.device),
                       **hf_cache_kwargs(model, cache() if cache else None)).logits[0, -1]
    logits = logits.float()
    return float(logits.max() - logits[token]) / float(logits.abs().max())


def engine_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int, backend: str, dtype: str, kv: str,
                  device: str) -> list[list[int]]:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.protocol.sampling_params import SamplingParams

    llm = LLM(model_dir, device=device, attention_backend=backend, dtype=dtype, kv_cache_dtype=kv,
              max_num_seqs=len(prompts), max_num_batched_tokens=2048, kv_cache_memory=1 << 30, block_size=BLOCK_SIZE)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    try:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
    finally:
        llm.engine.shutdown()  # its threads and CUDA memory go now, not at interpreter exit


def first_divergences(ref: list[list[int]], got: list[list[int]]) -> list[int]:
    return [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), min(len(r), len(g))) for r, g in zip(ref, got)]


def agreement(ref: list[list[int]], got: list[list[int]], tied: set[int] = frozenset()) -> tuple[float, int]:
    """(share of tokens equal before each prompt's first divergence, the earliest divergence); the prompts in
    ``tied`` (their divergence was HF's near-tie) count whole."""
    firsts = first_divergences(ref, got)
    total = sum(len(r) for r in ref)
    share = sum(len(r) if k in tied else f for k, (r, f) in enumerate(zip(ref, firsts)))
    return share / max(total, 1), min(firsts, default=0)


def exact_row(dtype: str, kv: str) -> bool:
    return dtype == "float32" and kv in ("auto", "float32")


def verdict(dtype: str, kv: str, share: float) -> str:
    if exact_row(dtype, kv):
        return "exact" if share == 1.0 else "FAIL"
    return "close" if share >= CLOSE else "FAIL"


def pool_cache(model, dtype: str, kv: str, capacity: int):
    """A factory of HF caches in a ``kv`` pool (:class:`~pagedllm.models.paged_cache.PagedCache`, rounding as the
    engine's pool does) where that pool rounds the model's K/V (quantized, or a float dtype other than ``dtype``),
    else None: plain HF is then the same computation."""
    from pagedllm.config.device import DTYPES, resolve_kv_cache_dtype
    from pagedllm.models.paged_cache import PagedCache

    if kv == "auto" or resolve_kv_cache_dtype(kv) == DTYPES[dtype]:
        return None
    return lambda: PagedCache(model.config, num_blocks=-(-capacity // BLOCK_SIZE), block_size=BLOCK_SIZE,
                              dtype=resolve_kv_cache_dtype(kv))


def run(model_dir: str, device: str, backends: list[str], dtypes: list[str], kv_dtypes: list[str], n_prompts: int,
        max_tokens: int, on_row=lambda row: None) -> list[Row]:
    """Every combination's row, each also handed to ``on_row`` as it completes (a time-boxed run keeps them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedllm.config.device import DTYPES

    prompts = prompts_for(AutoTokenizer.from_pretrained(model_dir), n_prompts)
    rows = []
    capacity = max(len(p) for p in prompts) + max_tokens
    for dtype in dtypes:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).to(device).eval()
        plain = hf_greedy(hf, prompts, max_tokens)
        for kv in kv_dtypes:
            cache = pool_cache(hf, dtype, kv, capacity)
            ref = hf_greedy(hf, prompts, max_tokens, cache) if cache else plain
            for backend in backends:
                t0 = time.perf_counter()
                try:
                    got = engine_greedy(model_dir, prompts, max_tokens, backend, dtype, kv, device)
                except (ValueError, RuntimeError) as e:
                    refused = isinstance(e, ValueError) and any(s in str(e) for s in EXPECTED_REFUSALS)
                    rows.append(Row(backend, dtype, kv, 0.0, 0, "refused" if refused else "FAIL",
                                    time.perf_counter() - t0, f"{type(e).__name__}: {e}"[:200]))
                    on_row(rows[-1])
                    continue
                finally:
                    gc.collect()
                    if device.startswith("cuda"):
                        torch.cuda.empty_cache()
                firsts = first_divergences(ref, got)
                gaps = {} if exact_row(dtype, kv) else {k: hf_gap(hf, prompts[k] + ref[k][:f], got[k][f], cache)
                                                        for k, f in enumerate(firsts) if f < len(ref[k])}
                tied = {k for k, g in gaps.items() if g <= TIE}
                share, first = agreement(ref, got, tied)
                # how far past a near-tie the other divergences were: a FAIL says whether it was close
                note = ", ".join(f"prompt {k} at token {firsts[k]}: HF gap {g:.3f}" for k, g in gaps.items()
                                 if k not in tied)
                rows.append(Row(backend, dtype, kv, share, first, verdict(dtype, kv, share), time.perf_counter() - t0,
                                note, ties=len(tied), plain=agreement(plain, got)[0]))
                on_row(rows[-1])
        del hf
    return rows


HEADER = (f"{'backend':<10} {'dtype':<9} {'kv':<9} {'agree':>6} {'first':>5} {'ties':>4} {'plain':>6} {'verdict':<8} "
          f"{'s':>6}  note")


def line(r: Row) -> str:
    return (f"{r.backend:<10} {r.dtype:<9} {r.kv_dtype:<9} {r.agreement:>6.3f} {r.first_divergence:>5} "
            f"{r.ties:>4} {r.plain:>6.3f} {r.verdict:<8} {r.seconds:>6.1f}  {r.note}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedllm.bench.gpu_oracle", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backends", default="reference,flex,triton")
    p.add_argument("--dtypes", default="float32,bfloat16,float16")
    p.add_argument("--kv-dtypes", default=",".join(KV_DTYPES))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args(argv)
    print(HEADER, flush=True)
    rows = run(a.model, a.device, a.backends.split(","), a.dtypes.split(","), a.kv_dtypes.split(","), a.prompts,
               a.max_tokens, on_row=lambda r: print(line(r), flush=True))
    if a.json:
        with open(a.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    failed = [r for r in rows if r.verdict == "FAIL"]
    print(f"oracle: {len(rows) - len(failed)}/{len(rows)} rows pass on {a.device}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
