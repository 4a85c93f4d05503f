"""``pagedllm bench roofline``: the model's bytes and FLOPs are the real ones, the floors follow from the measurements,
and the measured paths run here (their speed is never asserted)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from pagedllm.bench import roofline
from pagedllm.bench.roofline_measure import GemmPath, best_of, gemm_peaks, random_blocks
from pagedllm.models.loader import BLOCKS_FILE, resolve_model_dir
from pagedllm.models.quant import kernel_available


@pytest.fixture(scope="module")
def shape() -> roofline.ModelShape:
    return roofline.model_shape()


def test_step_bytes_are_the_checkpoints_matrices(shape):
    """fp32 / bf16: every 2-D weight of the checkpoint once (the tied LM head is the embedding); gguf: the bytes of
    the blocks file's matrices, as the engine keeps them."""
    from safetensors import safe_open

    path = resolve_model_dir(None)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        params = sum(f.get_slice(k).get_shape()[0] * f.get_slice(k).get_shape()[1] for k in f.keys()  # noqa: SIM118 (safe_open)
                     if len(f.get_slice(k).get_shape()) == 2 and k != "lm_head.weight")
    assert shape.step_bytes("fp32") == 4 * params and shape.step_bytes("bf16") == 2 * params
    with safe_open(os.path.join(path, BLOCKS_FILE), "pt") as f:
        block_bytes = sum(f.get_tensor(k).numel() for k in f.keys())  # noqa: SIM118
    assert shape.step_bytes("gguf") == block_bytes
    assert shape.layer_qtype() == 3  # SmolLM2's layers are Q4_1


def test_workload_flops_match_a_count_per_request(shape):
    c = shape.config
    w = {"prompt_range": (2, 4), "output_range": (1, 3)}
    total, attn, outs = 0.0, 0.0, 0
    pairs = [(p, o) for p in range(2, 5) for o in range(1, 4)]
    for p, o in pairs:
        positions = range(p + o - 1)  # the last output token is sampled, never fed back
        total += sum(2 * shape.layer_params() + 4 * c.num_layers * c.num_heads * c.head_dim * (t + 1)
                     for t in positions) + o * 2 * shape.head_params()
        attn += sum(4 * c.num_layers * c.num_heads * c.head_dim * (t + 1) for t in positions[p:])  # fed-back ones
        outs += o
    cost = roofline.workload_cost(shape, w)
    assert cost.flops == pytest.approx(total) and cost.out_tokens == outs
    assert cost.decode_attn_flops == pytest.approx(attn)


def test_decode_keys_count_each_fed_back_tokens_context():
    w = {"prompt_range": (2, 4), "output_range": (1, 3)}
    pairs = [(p, o) for p in range(2, 5) for o in range(1, 4)]
    # output token i (0-based) is fed back for i < o - 1, at position p + i, and reads p + i + 1 keys
    expected = sum(sum(p + i + 1 for i in range(o - 1)) for p, o in pairs)
    assert roofline.request_decode_keys(*roofline._length_grid(w)).sum() == pytest.approx(expected)


def test_decode_attention_takes_the_longer_of_its_flops_and_its_reads():
    """Not both: an op's loads overlap its arithmetic. Everything else runs at the FLOP rate."""
    cost = roofline.LoadCost(flops=10e9, decode_attn_flops=2e9, decode_keys=1e6, out_tokens=100)
    assert cost.seconds(1.0) == pytest.approx(10.0)  # FLOPs only: the ceiling
    assert cost.seconds(1.0, 1000.0, 1e9) == pytest.approx(8.0 + 2.0)  # reads 1 s < attention's FLOPs 2 s
    assert cost.seconds(1.0, 5000.0, 1e9) == pytest.approx(8.0 + 5.0)  # reads 5 s outlast them


def _floor_s(cost: roofline.LoadCost, gflops: float, kv_s: float) -> float:
    """The floor's seconds spelt out: FLOPs outside decode attention, then the longer of its FLOPs and reads."""
    return (cost.flops - cost.decode_attn_flops) / (gflops * 1e9) + max(cost.decode_attn_flops / (gflops * 1e9), kv_s)


def test_floors_divide_bandwidth_by_bytes_and_flops_by_the_formats_path(shape):
    paths = [GemmPath("a", "fp32", 100.0), GemmPath("b", "int8", 200.0), GemmPath("c", "fp32 on Q4_1", 50.0)]
    w = {"prompt_range": (10, 10), "output_range": (5, 5)}
    cost = roofline.workload_cost(shape, w)
    rows = {r["format"]: r for r in roofline.floors(shape, {"read": 1e10}, paths, cost)}
    flops, outs = cost.flops, cost.out_tokens
    assert rows["bf16"]["b1_tok_s"] == pytest.approx(1e10 / shape.step_bytes("bf16"))
    assert rows["gguf"]["gemm_path"] == "c" and rows["gguf-a8"]["gemm_path"] == "b"
    assert rows["gguf"]["w1_tok_s"] == pytest.approx(outs / (flops / 50e9))
    c = shape.config
    kv_s = cost.decode_keys * 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 / 1e10  # fp32 pool
    assert kv_s > cost.decode_attn_flops / 50e9  # decode attention is bound by its reads here
    assert rows["gguf"]["w1_kv_tok_s"] == pytest.approx(outs / _floor_s(cost, 50.0, kv_s))
    assert rows["gguf"]["w1_kv_tok_s"] < rows["gguf"]["w1_tok_s"]
    assert rows["bf16"]["gemm_path"] is None and rows["bf16"]["w1_tok_s"] is None  # no bf16 path measured
    assert rows["gguf"]["w1_peak_tok_s"] == rows["gguf"]["w1_kv_tok_s"] and rows["gguf"]["peak_gflops"] is None
    # the cores' peak: fp32 FMAs bound the exact GGUF path too; a peak below the best path leaves the path's figure
    peaks = [GemmPath("fma", "fp32", 80.0), GemmPath("vdp", "bf16", 400.0), GemmPath("vnni", "int8", 150.0)]
    rows = {r["format"]: r for r in roofline.floors(shape, {"read": 1e10}, paths, cost, peaks)}
    assert rows["fp32"]["floor_gflops"] == 100.0 and rows["gguf"]["floor_gflops"] == 80.0
    assert rows["gguf"]["peak_gflops"] == 80.0
    assert rows["gguf"]["w1_peak_tok_s"] == pytest.approx(outs / _floor_s(cost, 80.0, kv_s))
    assert rows["fp32"]["w1_peak_tok_s"] == pytest.approx(outs / _floor_s(cost, 100.0, kv_s))  # path 100 > peak 80
    assert rows["gguf-a8"]["w1_peak_tok_s"] == rows["gguf-a8"]["w1_kv_tok_s"]  # path 200 > peak 150
    kv16 = kv_s / 2  # bf16 pool
    assert rows["bf16"]["w1_tok_s"] is None and rows["bf16"]["w1_peak_tok_s"] == pytest.approx(
        outs / _floor_s(cost, 400.0, kv16))
    no_blocks = roofline.ModelShape(shape.config, {}, {})
    assert [r["format"] for r in roofline.floors(no_blocks, {"read": 1e10}, paths, cost)] == ["fp32", "bf16"]


def test_a_loads_floor_is_w1s_floor_when_its_requests_are_w1s_lengths(shape):
    """bench serve's floor of a load of requests is the same arithmetic as W1's over the expected lengths: a load
    holding every (prompt, output) pair once has W1's floor; doubling every output adds its FLOPs and K/V reads."""
    w = {"prompt_range": (10, 13), "output_range": (4, 6)}
    paths, peaks = [GemmPath("a", "bf16", 300.0)], [GemmPath("vdp", "bf16", 400.0)]
    result = {"floors": roofline.floors(shape, {"read": 2e10}, paths, roofline.workload_cost(shape, w), peaks),
              "bandwidth_Bps": {"read": 2e10}}
    pairs = [(p, o) for p in range(10, 14) for o in range(4, 7)]
    prompts, outputs = [p for p, _ in pairs], [o for _, o in pairs]
    floor = roofline.load_floor_tok_s(result, "gguf-bf16", prompts, outputs)
    assert floor == pytest.approx(roofline.floor_for(result, "gguf-bf16")["w1_peak_tok_s"])
    longer = roofline.load_floor_tok_s(result, "gguf-bf16", prompts, [2 * o for o in outputs])
    cost = roofline.load_cost(shape, np.array(prompts, float), np.array([2.0 * o for o in outputs]))
    assert cost.flops == pytest.approx(roofline.request_flops(
        shape, np.array(prompts, float), np.array([2.0 * o for o in outputs])).sum())
    kv_s = cost.decode_keys * roofline.kv_bytes_per_key(shape, "gguf-bf16") / 2e10
    assert longer == pytest.approx(2 * sum(outputs) / _floor_s(cost, 400.0, kv_s))
    assert roofline.load_floor_tok_s(result, "gguf", prompts, outputs) is None  # no fp32 rate measured
    assert roofline.load_floor_tok_s(result, "gguf-bf16", [], []) is None


def test_throughputs_floor_is_that_of_the_requests_it_ran(shape):
    """A sample of W1 has its own share of output tokens: its floor is its requests', not the expected request's."""
    paths, peaks = [GemmPath("a", "bf16", 300.0)], [GemmPath("vdp", "bf16", 400.0)]
    prompts, outputs = [500, 40, 300], [20, 250, 100]
    ran = roofline.floors(shape, {"read": 2e10}, paths, roofline.load_cost(shape, prompts, outputs), peaks)
    expected = roofline.floors(shape, {"read": 2e10}, paths, roofline.workload_cost(shape, roofline.W1), peaks)
    row, exp = roofline.floor_for({"floors": ran}, "bf16"), roofline.floor_for({"floors": expected}, "bf16")
    assert row["w1_peak_tok_s"] == pytest.approx(roofline.load_floor_tok_s(
        {"floors": ran, "bandwidth_Bps": {"read": 2e10}}, "bf16", prompts, outputs))
    assert row["w1_peak_tok_s"] != pytest.approx(exp["w1_peak_tok_s"], rel=1e-3)


@pytest.mark.skipif(not kernel_available(), reason="needs the C++ GEMM kernel (g++ with OpenMP)")
@pytest.mark.parametrize("qtype", [3, 8])
def test_random_blocks_are_valid_matrices(qtype):
    """The benchmark's made-up blocks multiply exactly like their dequantized fp32 matrix."""
    blocks = random_blocks(16, 64, qtype, torch.Generator().manual_seed(1))
    dense = torch.ops.pagedllm.dequantize.default(blocks, qtype, 64)
    assert torch.isfinite(dense).all() and dense.abs().max() > 0
    x = torch.randn(3, 64)
    torch.testing.assert_close(torch.ops.pagedllm.quant_linear.default(x, blocks, qtype, None), x @ dense.T)


def test_gemm_peaks_measure_every_path_or_say_why_not(monkeypatch):
    from pagedllm.bench import roofline_measure

    real = roofline_measure._candidates

    def with_a_refusal(*a):
        def refuse():
            raise RuntimeError("could not create a primitive descriptor\nmore")

        return [*real(*a), ("refused path", "bf16", refuse)]

    monkeypatch.setattr(roofline_measure, "_candidates", with_a_refusal)
    paths, refused = gemm_peaks(8, 64, 32, qtypes=(3,), budget_s=0.0)
    assert refused["refused path"] == "could not create a primitive descriptor"  # (oneDNN bf16 on AVX2 too)
    assert all(p.gflops > 0 for p in paths)
    assert [p.gflops for p in paths] == sorted((p.gflops for p in paths), reverse=True)
    assert best_of(paths, "fp32") is not None and best_of(paths, "nothing") is None


def test_bench_roofline_quick_writes_the_tables(tmp_path, capsys):
    from pagedllm.bench.cli import main

    assert main(["roofline", "--quick", "--out", str(tmp_path)]) == 0
    assert "batch-1 ceiling" in capsys.readouterr().out
    data = json.loads((tmp_path / "roofline.json").read_text())
    r = data["result"]
    assert {f["format"] for f in r["floors"]} >= {"fp32", "bf16"}
    assert r["bandwidth_Bps"]["read"] > 0 and r["gemm"] and r["instruction"]
    assert all(f["w1_peak_tok_s"] >= f["w1_kv_tok_s"] for f in r["floors"] if f["w1_kv_tok_s"])
    assert (tmp_path / "roofline.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(not kernel_available(), reason="needs the C++ GEMM kernel (g++ with OpenMP)")
def test_gemm_shapes_time_the_engines_matrices_beside_onednn(tmp_path):
    """--gemm-shapes: every matrix a step multiplies, in its GGUF format, at each row count and thread count."""
    from pagedllm.bench.cli import main
    from pagedllm.bench.roofline_shapes import engine_matrices

    mats = {name: (w.shape, w.qtype) for name, w in engine_matrices()}
    assert mats == {"qkv": ((960, 576), 3), "o": ((576, 576), 3), "gate_up": ((3072, 576), 3),
                    "down": ((576, 1536), 3), "lm_head": ((49152, 576), 8)}
    assert main(["roofline", "--quick", "--gemm-shapes", "--gemm-threads", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "roofline.json").read_text())["result"]["gemm_shapes"]
    assert {(r["matrix"], r["rows"]) for r in rows} == {(m, n) for m in mats for n in (1, 16, 64)}
    assert all(r["threads"] == 1 and min(r["ours_gflops"], r["v1_gflops"], r["onednn_gflops"], r["peak_gflops"]) > 0
               for r in rows)
    assert "PAGEDLLM_GEMM_V1" not in os.environ
    assert "by matrix and rows" in (tmp_path / "roofline.md").read_text()
