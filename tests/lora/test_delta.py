"""The batched LoRA delta equals each token's own adapter applied alone (``y + scaling * B A x``), for the torch
paths (masked and segmented), the C++ gathered kernel and the Triton BGMV kernels (in Triton's interpreter here, on
CUDA where one is at hand)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import ops
from pagedllm.lora.adapter import LoRAAdapter, LoRAShapes
from pagedllm.lora.delta import LoRAStep, add_masked_
from pagedllm.lora.slots import GROUPS, LoRASlots

SHAPES = LoRAShapes(2, {"q_proj": (32, 24), "k_proj": (16, 24), "v_proj": (16, 24), "o_proj": (24, 32),
                        "gate_proj": (40, 24), "up_proj": (40, 24), "down_proj": (24, 40)})


def random_adapter(lora_id: int, rank: int, targets, seed: int) -> LoRAAdapter:
    g = torch.Generator().manual_seed(seed)
    ad = LoRAAdapter(lora_id, f"a{lora_id}", rank, 1.0)
    for layer in range(SHAPES.num_layers):
        for t in targets:
            o, i = SHAPES.shapes[t]
            ad.weights[(layer, t)] = (torch.randn(rank, i, generator=g), torch.randn(o, rank, generator=g))
    return ad


def reference(y, x, adapters_of_token, layer, group):
    """Token by token, target by target: the definition."""
    out = y.clone()
    lo = 0
    for target in GROUPS[group]:
        o = SHAPES.shapes[target][0]
        for tok, ad in enumerate(adapters_of_token):
            if ad is not None and (layer, target) in ad.weights:
                a, b = ad.weights[(layer, target)]
                out[tok, lo:lo + o] += b @ (a @ x[tok])
        lo += o
    return out


@pytest.fixture(scope="module")
def setup():
    adapters = [random_adapter(1, 4, ["q_proj", "v_proj", "gate_proj", "down_proj"], 1),
                random_adapter(2, 8, list(SHAPES.shapes), 2), random_adapter(3, 1, ["o_proj", "up_proj"], 3)]
    slots = LoRASlots(SHAPES, 4, 8)
    slot_ids = [2, 0, 3]  # not in order: a step reads the leading k slots
    for s, ad in zip(slot_ids, adapters):
        slots.write(s, ad)
    pick = [None, 0, 1, 2, 1, None, 0, 2, 2]  # a mixed batch, base tokens included
    slot_of_token = torch.tensor([-1 if p is None else slot_ids[p] for p in pick])
    return slots, [None if p is None else adapters[p] for p in pick], slot_of_token


def inputs(group: str, T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    targets = GROUPS[group]
    out = sum(SHAPES.shapes[t][0] for t in targets)
    return torch.randn(T, out, generator=g), torch.randn(T, SHAPES.shapes[targets[0]][1], generator=g)


needs_kernel = pytest.mark.skipif(not ops.load("lora_bgmv"), reason="no C++ compiler / AVX2 here")
PATHS = ["masked", "segmented", pytest.param("gathered", marks=needs_kernel)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("layer", [0, 1])
def test_cpu_paths_match_definition(setup, group, layer, path):
    slots, per_token, slot_of_token = setup
    y, x = inputs(group, len(per_token), layer)
    step = LoRAStep.build(slots, slot_of_token, torch.float32, min_segment=1 if path == "segmented" else 10**9,
                          gathered=path == "gathered")
    assert (step.runs is not None, step.gathered) == (path == "segmented", path == "gathered")
    want = reference(y, x, per_token, layer, group)
    step.add_(layer, group, y, x)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-4)
    base = [i for i, a in enumerate(per_token) if a is None]
    assert torch.equal(y[base], inputs(group, len(per_token), layer)[0][base])  # base rows untouched, bit for bit


def test_no_adapter_token_means_no_step(setup):
    slots, _, _ = setup
    assert LoRAStep.build(slots, torch.tensor([-1, -1]), torch.float32) is None


@pytest.mark.parametrize("group", list(GROUPS))
def test_triton_bgmv_matches_torch_path(setup, group):
    from pagedllm.lora.slots import GroupWeights
    from pagedllm.lora.triton_bgmv import bgmv_add_  # triton is in the test extra: CI runs this

    slots, per_token, slot_of_token = setup
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: Triton's interpreter (tests/conftest.py)
    y, x = inputs(group, len(per_token), 7)
    want = y.clone()
    step = LoRAStep.build(slots, slot_of_token, torch.float32, min_segment=10**9, gathered=False)
    add_masked_(want, x, slots.layers[1][group], step.mask, step.k)
    w = slots.layers[1][group]
    wd = GroupWeights(w.a.to(dev), [b.to(dev) for b in w.b], w.bounds)
    yd = y.to(dev)
    bgmv_add_(yd, x.to(dev), wd, slot_of_token.to(dev))
    torch.testing.assert_close(yd.cpu(), want, rtol=1e-5, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("T", [1, 7])
def test_gathered_kernel_odd_shapes(T):
    """Widths, ranks and inputs that are no multiple of the kernel's 8 lanes or 4 rows: the tails are exact too,
    and a strided ``y`` (a slice of a wider output) gets only its own columns."""
    g = torch.Generator().manual_seed(T)
    S, n, R, K, widths = 3, 3, 3, 21, [13, 5, 9]
    a = torch.randn(S, n, R, K, generator=g)
    bs = [torch.randn(S, R, w, generator=g) for w in widths]
    los = [2, 15, 20]
    x = torch.randn(T, K, generator=g)
    wide = torch.randn(T, 40, generator=g)
    slots = torch.randint(-1, S, (T,), generator=g)
    want = wide.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            for i, (lo, w) in enumerate(zip(los, widths)):
                want[t, 1 + lo:1 + lo + w] += (a[s, i] @ x[t]) @ bs[i][s]
    torch.ops.pagedllm.lora_bgmv.default(wide[:, 1:], x, a, bs, los, slots)
    torch.testing.assert_close(wide, want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_gathered_kernel_refuses_a_slot_out_of_range(setup):
    slots, per_token, _ = setup
    y, x = inputs("o", 2, 0)
    w = slots.layers[0]["o"]
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.pagedllm.lora_bgmv.default(y, x, w.a, w.b, [0], torch.tensor([0, 4]))
