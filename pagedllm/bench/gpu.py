"""``pagedllm bench gpu``: issue 30's GPU workloads on a Llama-shaped 1.07 B model with random weights
(hidden 2048, 16 layers, 32/8 heads, intermediate 8192, SmolLM2's 49152-token vocabulary; throughput does not
depend on the weights), our engine and HF side by side in the same run on the same device:

* ``256 requests``: prompts 64-512 tokens, outputs 64-256, ignore_eos;
* ``W1 x 1024``: W1's length distribution (prompts 32-512, outputs 16-256) at 1,024 requests;
* ``batch-1 decode``: ms per token of one sequence, with the roofline: weight bytes over the device's measured
  copy bandwidth (the least time a step that reads every weight once can take).

HF runs ``generate`` in left-padded batches of 64 and ``generate_batch`` (continuous batching). ``--quick``
shrinks the model and the workloads to a CPU smoke test (numbers not meaningful).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time

import torch

from pagedllm.bench import baselines as bl
from pagedllm.bench.report import Report, Table
from pagedllm.bench.workloads import W1, BenchRequest

SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8)
QUICK_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hf-batch", type=int, default=64, help="HF generate's padded batch size (default 64)")
    p.add_argument("--no-hf", action="store_true", help="our engine only")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the embedded SmolLM2's; "
                   "a machine without the embedded GGUF, such as scripts/gpu_check.sh's, passes one)")


def make_model_dir(quick: bool, dtype: torch.dtype, out: str, tokenizer: str | None = None) -> str:
    """A random-weight Llama of the issue's shape (tiny with ``quick``) with SmolLM2's tokenizer (or the one in
    ``tokenizer``), saved to ``out``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pagedllm.models.loader import load_checkpoint

    tok = AutoTokenizer.from_pretrained(tokenizer or load_checkpoint(None).path)
    cfg = LlamaConfig(vocab_size=len(tok), max_position_embeddings=2048, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      **(QUICK_SHAPE if quick else SHAPE))
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(dtype).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def requests(num: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int,
             seed: int) -> list[BenchRequest]:
    """Random token prompts (random weights: the text does not matter) with uniform lengths."""
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(100, vocab) for _ in range(rng.randint(*prompt_range))],
                         rng.randint(*output_range)) for _ in range(num)]


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy (read + write counted), best of 5."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def ours(llm, reqs: list[BenchRequest]) -> float:
    """Output tokens per second of our engine over ``reqs`` (greedy, ignore_eos)."""
    from pagedllm.protocol import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt_ids for r in reqs], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def hf_padded(model, tok, reqs: list[BenchRequest], batch: int) -> float:
    """HF ``generate`` in arrival-order left-padded batches; only the tokens each request asked for count."""
    dev = model.device
    useful, t0 = 0, time.perf_counter()
    for i in range(0, len(reqs), batch):
        b = reqs[i:i + batch]
        ids, mask = bl.left_pad([r.prompt_ids for r in b], bl.pad_id(tok))
        new = max(r.max_tokens for r in b)
        model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=bl.pad_id(tok))
        useful += sum(r.max_tokens for r in b)
    return useful / (time.perf_counter() - t0)


def hf_generate_batch(model, tok, reqs: list[BenchRequest], max_batch_tokens: int) -> float | str:
    """HF ``generate_batch`` (continuous batching): output tok/s, or why it did not run."""
    from transformers import GenerationConfig

    if not bl.hf_cb_available(model):
        return "this transformers has no generate_batch"
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = 32  # a pool sized to the workload (its default sizes one from free memory)
    cbc = ContinuousBatchingConfig(page_size=page, num_blocks=sum(-(-(len(r.prompt_ids) + r.max_tokens + 1) // page)
                                                                  for r in reqs) + 8,
                                   max_batch_tokens=max_batch_tokens, max_requests_per_batch=min(256, len(reqs)))
    gc = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in reqs), eos_token_id=-1,
                          pad_token_id=bl.pad_id(tok))
    try:
        t0 = time.perf_counter()
        outs = model.generate_batch([r.prompt_ids for r in reqs], generation_config=gc,
                                    continuous_batching_config=cbc, progress_bar=False)
        dt = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - an experimental API: report, don't crash the bench
        return f"failed: {type(e).__name__}: {str(e)[:120]}"
    return sum(min(len(o.generated_tokens), r.max_tokens) for o, r in zip(outs.values(), reqs)) / dt


def decode_ms(llm, tokens: int, vocab: int, seed: int) -> float:
    """Batch-1 decode ms per token: (finish - first token) / (tokens - 1) of one 32-token prompt."""
    from pagedllm.protocol import SamplingParams

    req = requests(1, (32, 32), (tokens, tokens), vocab, seed)[0]
    eng = llm.engine
    eng.add_request(req.prompt_ids, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    first = None
    while eng.has_unfinished():
        outs = eng.step()
        if first is None and any(o.outputs[0].token_ids for o in outs):
            first = time.perf_counter()
    return 1000 * (time.perf_counter() - first) / (tokens - 1)


def _progress(line: str) -> None:
    """Each figure on stderr as it is measured: a time-boxed run (scripts/gpu_check.sh) keeps what it finished."""
    print(f"bench gpu: {line}", file=sys.stderr, flush=True)


def run(args) -> Report:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedllm.entrypoints.llm import LLM
    from pagedllm.config.device import resolve_dtype

    quick = args.quick
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(args.dtype) if args.dtype != "auto" or device.type == "cpu" else torch.bfloat16
    loads = {"256 requests": (8, (8, 48), (4, 16)) if quick else (256, (64, 512), (64, 256)),
             "W1 x 1024": (8, (8, 48), (4, 16)) if quick else (1024, W1["prompt_range"], W1["output_range"])}
    with tempfile.TemporaryDirectory(prefix="pagedllm-gpu-bench-") as tmp:
        path = make_model_dir(quick, dtype, tmp, args.tokenizer)
        _progress("model written; starting the engine (CUDA graphs are captured at start)")
        engine = {"kv_cache_memory": 256 << 20} if quick else {}
        llm = LLM(path, dtype=str(dtype).split(".")[-1], seed=args.seed, **{**engine, **args.engine_args})
        vocab = llm.engine.core.spec.vocab_size
        work = {name: requests(n, pr, orr, vocab, args.seed) for name, (n, pr, orr) in loads.items()}
        ours(llm, work["256 requests"][:2])  # warm-up: first-call costs (and graph capture) stay out of the timings
        rows, result = [], {"device": str(device), "dtype": str(dtype), "quick": quick, "tok_s": {}}
        for name, reqs in work.items():
            result["tok_s"][name] = {"pagedllm": ours(llm, reqs)}
            _progress(f"{name}: pagedllm {result['tok_s'][name]['pagedllm']:.0f} out tok/s")
        tokens = 16 if quick else 256
        ms = decode_ms(llm, tokens, vocab, args.seed)
        _progress(f"batch-1 decode: pagedllm {ms:.3f} ms/token")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        bw = copy_bandwidth(device, (64 << 20) if quick else (1 << 30))
        roof_ms = 1000 * weight_bytes / bw
        _progress(f"roofline {roof_ms:.3f} ms/token ({bw / 1e9:.0f} GB/s copy): {100 * roof_ms / ms:.0f}% of it")
        if not args.no_hf:
            tok = AutoTokenizer.from_pretrained(path)
            for name, reqs in work.items():
                result["tok_s"][name][f"HF generate, padded {args.hf_batch}"] = hf_padded(model, tok, reqs,
                                                                                         args.hf_batch)
                result["tok_s"][name]["HF generate_batch"] = hf_generate_batch(
                    model, tok, reqs, llm.engine.args.max_num_batched_tokens)
                _progress(f"{name}: HF {result['tok_s'][name]}")
        del model
    systems = list(dict.fromkeys(s for v in result["tok_s"].values() for s in v))
    for s in systems:
        rows.append([s] + [result["tok_s"][w].get(s) for w in work])
    result.update(decode_ms=ms, roofline_ms=roof_ms, weight_bytes=weight_bytes, copy_bandwidth_Bps=bw,
                  roofline_fraction=roof_ms / ms)
    rep = Report("gpu", "GPU workloads: output tok/s (our engine and HF on the same device, same run)",
                 [f"{device}, {dtype}, random-weight Llama {'(tiny: --quick)' if quick else '1.07 B'}; "
                  f"targets (H100, bf16): 256 requests >= 15,000 out tok/s and >= 20x HF padded, batch-1 decode "
                  f"<= 1.2 ms/token (>= 60% of the roofline)"])
    rep.tables.append(Table(["system"] + list(work), rows))
    rep.tables.append(Table(["batch-1 decode", "ms/token", "tok/s", "roofline ms/token", "% of roofline"],
                            [["pagedllm", ms, 1000 / ms, roof_ms, 100 * roof_ms / ms]], digits=3,
                            title=f"weights {weight_bytes / 1e9:.3f} GB, copy bandwidth {bw / 1e9:.1f} GB/s"))
    rep.result = result
    return rep


def plot(fig, result: dict) -> None:
    ax = fig.add_subplot(121)
    loads = list(result["tok_s"])
    systems = list(dict.fromkeys(s for v in result["tok_s"].values() for s in v))
    width = 0.8 / len(systems)
    for i, s in enumerate(systems):
        vals = [result["tok_s"][w].get(s) for w in loads]
        ax.bar([j + i * width for j in range(len(loads))], [v if isinstance(v, float) else 0 for v in vals],
               width, label=s)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(loads))], loads, fontsize=7)
    ax.set_ylabel("output tok/s")
    ax.legend(fontsize=6)
    ax2 = fig.add_subplot(122)
    ax2.bar(["pagedllm", "roofline"], [result["decode_ms"], result["roofline_ms"]], color=["tab:blue", "tab:gray"])
    ax2.set_ylabel("batch-1 ms/token")
