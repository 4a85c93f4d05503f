"""``pagedllm bench lora``: multi-LoRA serving with 1, 8 and 64 adapters (Zipf popularity, mixed batches) against
the base model alone and against HF + PEFT serving one adapter at a time, all in the same run on the same weights.

Adapters (rank ``--rank``, every target) are made with PEFT for the embedded model: the first by PEFT itself, the
others as copies of its files with fresh random A and B. Each request draws its adapter from a Zipf law
(p_i ~ 1 / i^``--zipf``). Our engine runs every request in one ``generate`` (adapters mixed in each batch, at most
``--max-loras`` of them resident at once, the rest paged in on demand); the base model runs the same prompts
without adapters; HF + PEFT loads every adapter into one ``PeftModel`` and runs each adapter's requests as one
left-padded ``generate`` batch after ``set_adapter``. Each round runs all three once, in an order that rotates
from round to round, so a drift in the machine's load falls on every side.
The warm-up reads every adapter the workload uses once (as HF + PEFT preloads them): the timed rounds measure
serving, adapters paged between the KV pool's pages and the compute slots, not first reads from disk.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import time

import torch

from pagedllm.bench.report import Report, Table
from pagedllm.bench.workloads import random_requests


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adapters", default=None, help="comma list of adapter counts (default 1,8,64; --quick 1,8)")
    p.add_argument("--requests", type=int, default=None, help="requests per run (default 32; --quick 6)")
    p.add_argument("--rank", type=int, default=8, help="adapter rank (default 8)")
    p.add_argument("--max-loras", type=int, default=8, help="device adapter slots (default 8)")
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of adapter popularity (default 1.0)")
    p.add_argument("--rounds", type=int, default=None, help="base/LoRA rounds (default 2; --quick 1)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF + PEFT baseline")
    p.add_argument("--hf-dtype", default="auto", help="HF + PEFT's dtype: auto (bf16 on a CPU that computes it "
                   "natively, as an HF user there would run it; else float32), float32, bfloat16")


def make_adapters(model_dir: str, n: int, rank: int, root: str, seed: int) -> list[str]:
    """``n`` PEFT adapter directories of the model at ``model_dir`` (random A and B, every target)."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    first = os.path.join(root, "lora0")
    get_peft_model(hf, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
                   ).save_pretrained(first)
    weights = load_file(os.path.join(first, "adapter_model.safetensors"))
    paths = [first]
    for i in range(1, n):
        d = os.path.join(root, f"lora{i}")
        os.makedirs(d)
        shutil.copy(os.path.join(first, "adapter_config.json"), d)
        save_file({k: torch.empty_like(v).uniform_(-1, 1) * v.abs().max() for k, v in weights.items()},
                  os.path.join(d, "adapter_model.safetensors"))
        paths.append(d)
    return paths


def zipf_choices(n: int, k: int, s: float, seed: int) -> list[int]:
    rng = random.Random(seed)
    return rng.choices(range(n), weights=[1 / (i + 1) ** s for i in range(n)], k=k)


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def hf_peft_model(model_dir: str, paths: list[str], picks: list[int], dtype: torch.dtype = torch.float32):
    """HF + PEFT with every adapter the workload picks loaded once (as a one-adapter-at-a-time server would)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model = PeftModel.from_pretrained(hf, paths[0], adapter_name="a0")
    for i in sorted(set(picks) - {0}):
        model.load_adapter(paths[i], adapter_name=f"a{i}")
    return model


def hf_peft_one_at_a_time(model, prompts: list[list[int]], lens: list[int], picks: list[int]) -> None:
    """HF + PEFT serving one adapter at a time: each adapter's requests as one left-padded batch."""
    for i in sorted(set(picks)):
        rows = [j for j, p in enumerate(picks) if p == i]
        model.set_adapter(f"a{i}")
        width = max(len(prompts[j]) for j in rows)
        ids = torch.tensor([[0] * (width - len(prompts[j])) + prompts[j] for j in rows])
        mask = torch.tensor([[0] * (width - len(prompts[j])) + [1] * len(prompts[j]) for j in rows])
        n = max(lens[j] for j in rows)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)


def kv_blocks(llm) -> tuple[int, int]:
    """The engine's KV pool blocks (LoRA compute slots already taken out) and how many of them resident adapters
    hold as pages: what is left is the KV room that bounds the batch (why LoRA / base drops at a small
    kv_cache_memory: slots and pages come out of the same budget)."""
    sched = llm.engine.core.scheduler
    pager = sched.adapters
    pages = 0 if pager is None else sum(pager.pages_for(rank) for rank in pager.resident.values())
    return sched.kv.num_blocks, pages


def run(args) -> Report:
    from pagedllm.bench.common import make_llm
    from pagedllm.config.device import resolve_dtype
    from pagedllm.models.loader import resolve_model_dir
    from pagedllm.protocol import SamplingParams
    from pagedllm.protocol.lora_request import LoRARequest

    counts = [int(x) for x in (args.adapters or ("1,8" if args.quick else "1,8,64")).split(",")]
    num = args.requests or (6 if args.quick else 32)
    rounds = args.rounds or (1 if args.quick else 2)
    model_dir = resolve_model_dir(None)
    hf_dtype = resolve_dtype(args.hf_dtype)  # HF runs on the CPU here
    engine = {"kv_cache_memory": 512 << 20, **args.engine_args}  # two engines and HF share the machine's memory
    base = make_llm(args.dtype, seed=args.seed, **engine)
    reqs = random_requests(base.engine.tokenizer, num, (8, 48) if args.quick else (32, 256),
                           (4, 16) if args.quick else (32, 64), seed=args.seed)
    prompts, lens = [r.prompt_ids for r in reqs], [r.max_tokens for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    out_tokens = sum(lens)
    root = tempfile.mkdtemp(prefix="pagedllm-bench-lora-")
    rows, raw, loads = [], [], [os.getloadavg()[0]]
    try:
        paths = make_adapters(model_dir, max(counts), args.rank, root, args.seed)
        for n in counts:
            picks = zipf_choices(n, num, args.zipf, args.seed + n)
            loras = [LoRARequest(f"lora{i}", i + 1, paths[i]) for i in picks]
            llm = make_llm(args.dtype, seed=args.seed, **{**engine, "enable_lora": True, "max_lora_rank": args.rank,
                                                          "max_loras": min(args.max_loras, n)})
            first = list({lr.lora_int_id: lr for lr in loras}.values())  # warm up: every adapter read once
            llm.generate([prompts[0]] * len(first), params[0], use_tqdm=False, lora_request=first)
            base.generate(prompts[:2], params[:2], use_tqdm=False)
            hf = None if args.no_hf else hf_peft_model(model_dir, paths, picks, hf_dtype)
            sides = ("base", "lora") + (() if hf is None else ("hf",))
            run_side = {
                "base": lambda: base.generate(prompts, params, use_tqdm=False),
                "lora": lambda: llm.generate(prompts, params, use_tqdm=False, lora_request=loras),
                "hf": lambda: hf_peft_one_at_a_time(hf, prompts, lens, picks)}
            t = dict.fromkeys(sides, 0.0)
            for r in range(rounds):  # every side once a round, the order rotating, so load drifts hit all alike
                for side in sides[r % len(sides):] + sides[:r % len(sides)]:
                    base.reset_prefix_cache()
                    llm.reset_prefix_cache()
                    t[side] += _timed(run_side[side])[0]
            loads.append(os.getloadavg()[0])
            lora_blocks, page_blocks = kv_blocks(llm)
            base_tps, lora_tps = rounds * out_tokens / t["base"], rounds * out_tokens / t["lora"]
            hf_tps = rounds * out_tokens / t["hf"] if "hf" in t else None
            del hf
            llm.engine.shutdown()
            res = {"adapters": n, "distinct_used": len(set(picks)), "base_tok_s": base_tps, "lora_tok_s": lora_tps,
                   "lora_vs_base": lora_tps / base_tps, "hf_peft_tok_s": hf_tps,
                   "lora_vs_hf_peft": None if hf_tps is None else lora_tps / hf_tps,
                   "kv_blocks_base": kv_blocks(base)[0], "kv_blocks_lora": lora_blocks - page_blocks}
            raw.append(res)
            rows.append([n, res["distinct_used"], base_tps, lora_tps, res["lora_vs_base"], hf_tps,
                         res["lora_vs_hf_peft"], res["kv_blocks_base"], res["kv_blocks_lora"]])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rep = Report("lora", "multi-LoRA serving: mixed adapters vs the base model vs HF + PEFT one adapter at a time", [
        f"{num} requests (prompts {'8-48' if args.quick else '32-256'} tokens of real text, "
        f"{'4-16' if args.quick else '32-64'} output tokens, greedy, EOS ignored); adapters of rank {args.rank} on "
        f"every target, Zipf popularity (s={args.zipf}); {min(args.max_loras, max(counts))} device slots at most",
        "tok/s = output tokens / wall time, every adapter read once before (warm-up); base, LoRA and HF + PEFT run "
        f"once a round in rotating order over {rounds} round(s); HF + PEFT: one left-padded generate per adapter, "
        f"adapters preloaded, in {str(hf_dtype).removeprefix('torch.')} (--hf-dtype {args.hf_dtype})",
        "KV blocks: the pool's blocks left for the KV cache at the end (LoRA: the compute slots and the resident "
        "adapters' pages come out of the same kv_cache_memory, so a small budget caps its batch below the base's)",
        f"1-minute load average at the start and after each adapter count: {', '.join(f'{x:.2f}' for x in loads)}"])
    rep.tables.append(Table(["adapters", "used", "base tok/s", "LoRA tok/s", "LoRA / base", "HF+PEFT tok/s",
                             "LoRA / HF+PEFT", "base KV blocks", "LoRA KV blocks"], rows, digits=2))
    rep.result = {"requests": num, "hf_dtype": str(hf_dtype).removeprefix("torch."), "rank": args.rank,
                  "zipf": args.zipf, "rounds": rounds, "loadavg": loads, "runs": raw}
    return rep


def plot(fig, result: dict) -> None:
    ax = fig.add_subplot(111)
    runs = result["runs"]
    x = range(len(runs))
    for k, (key, label) in enumerate((("base_tok_s", "base model"), ("lora_tok_s", "pagedllm, adapters mixed"),
                                      ("hf_peft_tok_s", "HF + PEFT, one adapter at a time"))):
        ax.bar([i + (k - 1) * 0.27 for i in x], [r[key] or 0 for r in runs], width=0.27, label=label)
    ax.set_xticks(list(x), [f"{r['adapters']} adapters\n({r['distinct_used']} used)" for r in runs])
    ax.set_ylabel("output tok/s")
    ax.legend()
    ax.set_title(f"multi-LoRA serving, rank {result['rank']}, Zipf s={result['zipf']}")
