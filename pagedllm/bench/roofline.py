"""``pagedllm bench roofline``: the floors this CPU puts under the embedded model, per weight format.

Measured here (``bench/roofline_measure.py``): streaming read bandwidth and the peak GEMM throughput of every path
that runs (ours, oneDNN/MKL through torch, bf16, int8). From those and the model's shapes:

* batch-1 decode ceiling = read bandwidth / the bytes of weights one token streams (every layer matrix and the
  LM head; KV reads are left out: a few hundred KB at W1's lengths against ~100-500 MB of weights);
* W1 ceiling = W1's output tokens / (its linear FLOPs + attention FLOPs) at the peak GEMM throughput of the path
  the format runs on (attention counted at that peak too, so the floor is optimistic);
* W1 floor with KV reads = the same, but decode attention takes the longer of its FLOPs and the time its decode
  steps take to read their K/V from the pool at the read bandwidth (each decode token reads its whole context once
  a layer; prefill chunks, which read theirs once per query tile, left out): still optimistic, but it counts the
  bytes no kernel can skip. The pool holds bf16 under bf16 activations (formats bf16, gguf-bf16), else fp32.
* W1 floor at the cores' peak = the floor with KV reads, its FLOPs at the instruction peak of the format's
  arithmetic (``ops/csrc/peak.cpp``: FMA for fp32 and the exact GGUF path, VDPBF16PS or AMX tiles for bf16,
  VPDPBUSD for int8) where that beats the best GEMM path: the hardware's bound for an engine that runs a step's ops
  one after another, not a library's. ``bench throughput`` takes it for the requests it runs, ``bench serve`` for
  its loads' own requests (:func:`load_floor_tok_s`).

A measured tok/s at or near its ceiling cannot go faster on this machine in that format; the gap to the ceiling is
what the engine's own overheads cost.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.bench.report import Report, Table
from pagedllm.bench.roofline_measure import GemmPath, bandwidth, best_of, gemm_peaks, instruction_peaks
from pagedllm.bench.workloads import W1, W1_QUICK
from pagedllm.models.config import ModelConfig
from pagedllm.ops.gguf_blocks import BLOCK_BYTES, QUANT_NAMES

GEMM_ROWS = 256  # rows of x in the peak measurement: a W1 step's GEMMs run at hundreds of rows


@dataclass(frozen=True)
class ModelShape:
    """The matrices one token multiplies: ``(name, N, K, bytes per format)``, and the attention sizes."""

    config: ModelConfig
    block_bytes: dict[str, int]  # HF matrix name -> bytes of its GGUF blocks (empty: no GGUF)
    block_qtypes: dict[str, int]

    def matrices(self) -> list[tuple[str, int, int]]:
        c = self.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        per_layer = [("self_attn.q_proj", q, c.hidden_size), ("self_attn.k_proj", kv, c.hidden_size),
                     ("self_attn.v_proj", kv, c.hidden_size), ("self_attn.o_proj", c.hidden_size, q),
                     ("mlp.gate_proj", c.intermediate_size, c.hidden_size),
                     ("mlp.up_proj", c.intermediate_size, c.hidden_size),
                     ("mlp.down_proj", c.hidden_size, c.intermediate_size)]
        out = [(f"model.layers.{i}.{name}.weight", n, k) for i in range(c.num_layers) for name, n, k in per_layer]
        head = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
        return out + [(head, c.vocab_size, c.hidden_size)]

    def layer_params(self) -> int:
        return sum(n * k for name, n, k in self.matrices()[:-1])

    def head_params(self) -> int:
        return self.config.vocab_size * self.config.hidden_size

    def step_bytes(self, fmt: str) -> int:
        """Weight bytes one decode step streams in ``fmt`` (fp32, bf16, gguf: the blocks, dense where a matrix has
        none, as the engine keeps it)."""
        if fmt in ("fp32", "bf16"):
            return (4 if fmt == "fp32" else 2) * (self.layer_params() + self.head_params())
        return sum(self.block_bytes.get(name, 4 * n * k) for name, n, k in self.matrices())

    def layer_qtype(self) -> int | None:
        """The block format most layer matrices are in (the one W1's GEMMs run on)."""
        qts = [self.block_qtypes[name] for name, _, _ in self.matrices()[:-1] if name in self.block_qtypes]
        return max(set(qts), key=qts.count) if qts else None


def model_shape(model: str | None = None) -> ModelShape:
    """Shapes of ``model`` (None: the embedded SmolLM2) and, for a GGUF, its block sizes, read from the metadata
    only (no weights loaded)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from pagedllm.models.loader import BLOCKS_FILE, resolve_model_dir

    path = resolve_model_dir(model)
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(path, local_files_only=True))
    sizes, qtypes = {}, {}
    blocks = os.path.join(path, BLOCKS_FILE)
    if os.path.isfile(blocks):
        with safe_open(blocks, "pt") as f:
            for name, spec in (f.metadata() or {}).items():
                qt, n, k = (int(v) for v in spec.split(":"))
                sizes[name], qtypes[name] = n * (k // 32) * BLOCK_BYTES[qt], qt
    return ModelShape(config, sizes, qtypes)


def attention_flops_per_key(shape: ModelShape) -> float:
    """FLOPs one query token spends on one key over every layer: QK and PV, 2 * 2 * heads * head_dim a layer."""
    c = shape.config
    return 4.0 * c.num_layers * c.num_heads * c.head_dim


def request_flops(shape: ModelShape, prompt: np.ndarray, output: np.ndarray) -> np.ndarray:
    """FLOPs of requests with these prompt and output lengths: each prompt token and each output token but the last
    goes through the layers, each output token through the LM head, and the token at position t attends to t + 1
    keys."""
    tokens = prompt + output - 1
    attn = attention_flops_per_key(shape) * tokens * (tokens + 1) / 2
    return 2.0 * shape.layer_params() * tokens + 2.0 * shape.head_params() * output + attn


def request_decode_keys(prompt: np.ndarray, output: np.ndarray) -> np.ndarray:
    """Keys the decode steps of requests with these lengths read in one layer: the output tokens fed back (all but
    the last; the first comes from the prefill) sit at positions p .. p + o - 2 and each reads its t + 1 keys."""
    return (output - 1) * (2 * prompt + output) / 2  # sum of j for j in p + 1 .. p + o - 1


def _length_grid(w: dict) -> tuple[np.ndarray, np.ndarray]:
    """Every (prompt, output) pair of a workload with uniform lengths, as broadcastable columns and rows."""
    p = np.arange(w["prompt_range"][0], w["prompt_range"][1] + 1, dtype=np.float64)[:, None]
    o = np.arange(w["output_range"][0], w["output_range"][1] + 1, dtype=np.float64)[None, :]
    return p, o


@dataclass(frozen=True)
class LoadCost:
    """What a load of requests asks of the hardware, summed over its requests: every FLOP (``flops``), the part of
    them decode attention does, the keys its decode steps read in one layer, and the output tokens."""

    flops: float
    decode_attn_flops: float
    decode_keys: float
    out_tokens: float

    def seconds(self, gflops: float, kv_bytes_per_key: float | None = None, read_Bps: float | None = None) -> float:
        """Its time with every FLOP at ``gflops``; with the K/V bytes a key and the read bandwidth, decode attention
        takes the longer of its FLOPs and its K/V reads instead (an op's loads overlap its arithmetic; a step's
        ops run one after another, so its GEMMs' FLOPs do not hide attention's reads)."""
        rate = gflops * 1e9
        if kv_bytes_per_key is None:
            return self.flops / rate
        attn = max(self.decode_attn_flops / rate, self.decode_keys * kv_bytes_per_key / read_Bps)
        return (self.flops - self.decode_attn_flops) / rate + attn


def load_cost(shape: ModelShape, prompt: np.ndarray, output: np.ndarray) -> LoadCost:
    """The cost of requests with these prompt and output lengths (arrays that broadcast together)."""
    p, o = np.broadcast_arrays(np.asarray(prompt, dtype=np.float64), np.asarray(output, dtype=np.float64))
    keys = request_decode_keys(p, o).sum()
    return LoadCost(float(request_flops(shape, p, o).sum()), attention_flops_per_key(shape) * float(keys),
                    float(keys), float(o.sum()))


def workload_cost(shape: ModelShape, w: dict) -> LoadCost:
    """The cost of a workload with uniform lengths: one request of every (prompt, output) pair, so its tok/s
    figures are those of the expected request."""
    return load_cost(shape, *_length_grid(w))


def kv_bytes_per_key(shape: ModelShape, fmt: str) -> int:
    """K and V bytes of one key over every layer, in the pool dtype the format runs with."""
    c = shape.config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * (2 if fmt in ("bf16", "gguf-bf16") else 4)


# weight format -> the GEMM family its batched steps run on
FORMATS = {"fp32": "fp32", "bf16": "bf16", "gguf": "fp32 on {q}", "gguf-a8": "int8", "gguf-bf16": "bf16"}


def floors(shape: ModelShape, bw: dict[str, float], paths: list[GemmPath], cost: LoadCost,
           peaks: list[GemmPath] = ()) -> list[dict]:
    """Per weight format: bytes per decode step, the batch-1 ceiling, the W1 GEMM path and the ceiling of the load
    that ``cost`` sums (W1's); with the cores' instruction ``peaks``, its floor at them too."""
    qt = shape.layer_qtype()
    rows = []
    for fmt, family in FORMATS.items():
        if fmt.startswith("gguf") and qt is None:
            continue
        path = best_of(paths, family.format(q=QUANT_NAMES.get(qt, "")))
        nbytes = shape.step_bytes(fmt)
        kv = (kv_bytes_per_key(shape, fmt), bw["read"])
        peak = best_of(list(peaks), family.split(" on ")[0])  # the exact GGUF path's arithmetic is fp32 FMAs
        top = max(peak.gflops if peak else 0.0, path.gflops if path else 0.0)
        rows.append({"format": fmt, "step_bytes": nbytes, "b1_tok_s": bw["read"] / nbytes,
                     "gemm_path": path.name if path else None, "gemm_gflops": path.gflops if path else None,
                     "w1_tok_s": cost.out_tokens / cost.seconds(path.gflops) if path else None,
                     "w1_kv_tok_s": cost.out_tokens / cost.seconds(path.gflops, *kv) if path else None,
                     "peak_gflops": peak.gflops if peak else None, "floor_gflops": top or None,
                     "w1_peak_tok_s": cost.out_tokens / cost.seconds(top, *kv) if top else None})
    return rows


def measure(quick: bool, model: str | None = None, w: dict | None = None,
            lengths: tuple[list[int], list[int]] | None = None) -> dict:
    """The whole roofline: bandwidth, GEMM peaks at the model's gate/up shape, and each format's floors for the
    workload ``w`` (W1 by default): its expected request, or with ``lengths`` (prompts, outputs) the requests run."""
    shape = model_shape(model)
    c = shape.config
    bw = bandwidth((32 << 20) if quick else (512 << 20), budget_s=0.1 if quick else 0.5)
    qtypes = tuple(sorted(set(shape.block_qtypes.values())))
    paths, refused = gemm_peaks(32 if quick else GEMM_ROWS, c.hidden_size, 2 * c.intermediate_size, qtypes,
                                budget_s=0.05 if quick else 0.3)
    peaks = instruction_peaks(budget_s=0.02 if quick else 0.2)
    w = w or (W1_QUICK if quick else W1)
    cost = load_cost(shape, *lengths) if lengths else workload_cost(shape, w)
    return {"bandwidth_Bps": bw, "gemm": [p.__dict__ for p in paths], "refused": refused,
            "instruction": [p.__dict__ for p in peaks],
            "gemm_shape": [32 if quick else GEMM_ROWS, c.hidden_size, 2 * c.intermediate_size],
            "floors": floors(shape, bw, paths, cost, peaks), "workload": w, "requests_run": lengths is not None,
            "threads": torch.get_num_threads()}


def format_of(dtype: torch.dtype, quantization: str) -> str:
    """The roofline format an engine runs in (its dtype, unless it keeps GGUF blocks)."""
    if quantization in ("gguf", "gguf-a8", "gguf-bf16"):
        return quantization
    return "bf16" if dtype == torch.bfloat16 else "fp32"


def floor_for(result: dict, fmt: str) -> dict | None:
    return next((f for f in result["floors"] if f["format"] == fmt), None)


def load_floor_tok_s(result: dict, fmt: str, prompts: list[int], outputs: list[int],
                     model: str | None = None) -> float | None:
    """The floor at the cores' peak of any load of these requests in ``fmt`` (a roofline ``result`` of this CPU):
    their output tokens over their FLOPs at the rate W1's floor used, decode attention at its K/V reads where they
    take longer (arrivals left out: a light load's bound is its arrival ceiling). None without that rate."""
    f = floor_for(result, fmt)
    if not f or not f.get("floor_gflops") or not prompts:
        return None
    shape = model_shape(model)
    cost = load_cost(shape, prompts, outputs)
    return cost.out_tokens / cost.seconds(f["floor_gflops"], kv_bytes_per_key(shape, fmt),
                                          result["bandwidth_Bps"]["read"])


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model whose floors to compute (default: the embedded SmolLM2)")
    p.add_argument("--gemm-shapes", action="store_true",
                   help="add the exact GEMM at each of the model's matrices and 1-1024 rows, beside oneDNN (minutes)")
    p.add_argument("--gemm-threads", default="1,2", help="thread counts of the --gemm-shapes table (default 1,2)")


def shapes_report_table(rows: list[dict]) -> Table:
    """The --gemm-shapes measurements as one table."""
    return Table(["threads", "matrix", "format", "N x K", "rows", "ours GFLOP/s", "ours before issue 32",
                  "oneDNN (dequantized fp32)", "ours / oneDNN", "% of in-cache peak"],
                 [[r["threads"], r["matrix"], r["format"], f"{r['N']} x {r['K']}", r["rows"], r["ours_gflops"],
                   r["v1_gflops"], r["onednn_gflops"], r["ours_gflops"] / r["onednn_gflops"],
                   100 * r["ours_gflops"] / r["peak_gflops"]] for r in rows],
                 "Exact GEMM (quant_linear on the GGUF blocks) by matrix and rows", 2)


def run(args) -> Report:
    from pagedllm.config.device import resolve_dtype

    r = measure(args.quick, args.model)
    bw = r["bandwidth_Bps"]
    m, k, n = r["gemm_shape"]
    notes = [(f"{os.cpu_count()} CPUs, {r['threads']} torch threads; best of repeated runs (a shared machine's "
              f"least disturbed run). dtype auto resolves to {resolve_dtype('auto')} here."),
             (f"Bandwidth over {(32 if args.quick else 512)} MB: read {bw['read'] / 1e9:.1f} GB/s, copy (read + "
              f"write) {bw['copy'] / 1e9:.1f} GB/s. GEMMs at [{m} x {k}] @ [{k} x {n}] (the model's gate/up at a "
              "W1-sized step)."),
             (f"W1: {r['workload']['num']} requests, prompt {r['workload']['prompt_range']}, output "
              f"{r['workload']['output_range']} (expected lengths); attention FLOPs counted at the GEMM peak; the "
              "floor with KV reads takes decode attention at the longer of its FLOPs and its K/V reads at the read "
              "bandwidth; the floor at the cores' "
              "peak counts the FLOPs at the instruction peak instead, where it beats every GEMM path (the "
              "instruction peak: every thread running the one instruction on registers, no loads).")]
    notes += [f"not available on this CPU: {name} ({why})" for name, why in r["refused"].items()]
    gemm = Table(["GEMM path", "family", "GFLOP/s"],
                 [[g["name"], g["family"], g["gflops"]] for g in r["gemm"] + r["instruction"]],
                 "Peak throughput: GEMM paths, then the cores' instruction peak", 1)
    fl = Table(["weight format", "MB per decode step", "batch-1 ceiling tok/s", "W1 GEMM path", "GFLOP/s",
                "W1 ceiling output tok/s", "W1 floor with KV reads, output tok/s", "instruction peak GFLOP/s",
                "W1 floor at the cores' peak, output tok/s"],
               [[f["format"], f["step_bytes"] / 1e6, f["b1_tok_s"], f["gemm_path"], f["gemm_gflops"], f["w1_tok_s"],
                 f["w1_kv_tok_s"], f["peak_gflops"], f["w1_peak_tok_s"]] for f in r["floors"]],
               "Floors of the embedded model", 1)
    tables = [gemm, fl]
    if args.gemm_shapes:
        from pagedllm.bench.roofline_shapes import (
            PEAK_SHAPE,
            ROWS,
            ROWS_QUICK,
            shape_table,
        )

        threads = tuple(int(t) for t in args.gemm_threads.split(","))
        r["gemm_shapes"] = shape_table(ROWS_QUICK if args.quick else ROWS, threads,
                                       budget_s=0.02 if args.quick else 0.2, model=args.model)
        notes.append(f"GEMM shapes: ours = the engine's call (one row: gemv.cpp); before issue 32 = PAGEDLLM_GEMM_V1=1, "
                     f"alternating in this process; in-cache peak = gemm.cpp's fp32 panels at {PEAK_SHAPE} (M, K, N).")
        tables.append(shapes_report_table(r["gemm_shapes"]))
    rep = Report("roofline", "Roofline: bandwidth, peak GEMMs and the model's floors per weight format", notes,
                 tables)
    rep.result = r
    return rep


def plot(fig, result: dict) -> None:
    fl = result["floors"]
    ax = fig.add_subplot(121)
    ax.bar([f["format"] for f in fl], [f["b1_tok_s"] for f in fl], color="tab:gray")
    ax.set_ylabel("tok/s")
    ax.set_title(f"batch-1 ceiling ({result['bandwidth_Bps']['read'] / 1e9:.1f} GB/s read)", fontsize=9)
    ax2 = fig.add_subplot(122)
    x = np.arange(len(fl))
    ax2.bar(x - 0.2, [f["w1_tok_s"] or 0 for f in fl], 0.4, color="tab:gray", label="ceiling: best GEMM path")
    ax2.bar(x + 0.2, [f.get("w1_peak_tok_s") or 0 for f in fl], 0.4, color="tab:blue",
            label="floor: cores' peak + K/V reads")
    ax2.set_xticks(x, [f["format"] for f in fl])
    ax2.set_ylabel("output tok/s")
    ax2.legend(fontsize=7)
    ax2.set_title("W1 ceiling (GEMM path), floor (cores' peak)", fontsize=9)
    for a in (ax, ax2):
        a.tick_params(axis="x", labelsize=8, rotation=25)
