"""Each Triton kernel compiles once per shape bucket, not once per batch size or step: start-up with 512 sequences
captures 67 decode graphs, and a kernel variant per graph (or per step) would cost minutes on a GPU.

Triton compiles a kernel per distinct set of constexprs, argument dtypes and integer specialisations (an int
argument equal to 1 or a multiple of 16, unless listed in ``do_not_specialize``; a pointer aligned to 16 bytes).
These tests record that key at every launch, in Triton's interpreter here and compiled on a GPU, and require one
key per kernel over every decode-graph bucket and over eager steps of changing shapes."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention import triton_decode, triton_prefill, triton_splitk, triton_write
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.bench.attention import make_random_batch
from tests.conftest import TRITON_DEVICE

pytest.importorskip("triton", reason="the test set-up installs triton")  # never skipped in CI: setup installs it

KERNELS = {"decode": (triton_decode, "_paged_decode_kernel"), "splitk": (triton_splitk, "_splitk_decode_kernel"),
           "prefill": (triton_prefill, "_paged_prefill_kernel"), "write": (triton_write, "_write_kv_kernel")}


def _unspecialized(kernel) -> set[str]:
    names = getattr(kernel, "kwargs", {}).get("do_not_specialize")  # the interpreter keeps the decorator's kwargs
    if names is None:  # a compiled JITFunction: indices
        names = [kernel.arg_names[i] if isinstance(i, int) else i for i in getattr(kernel, "do_not_specialize", ())]
    return set(names)


def _key(kernel, args: tuple, kwargs: dict) -> tuple:
    free = _unspecialized(kernel)
    key = []
    for name, a in zip(kernel.arg_names, args):
        if isinstance(a, torch.Tensor):
            key.append((name, a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, int) and not isinstance(a, bool) and name not in free:
            key.append((name, a == 1, a % 16 == 0))
    return tuple(key) + tuple(sorted(kwargs.items()))


@pytest.fixture
def launches(monkeypatch) -> dict[str, set]:
    """Every launch's compile key, per kernel."""
    seen: dict[str, set] = {name: set() for name in KERNELS}

    class Recorder:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen[self.name].add(_key(self.kernel, args, kwargs))
                return self.kernel[grid](*args, **kwargs)

            return launch

    for name, (module, attr) in KERNELS.items():
        monkeypatch.setattr(module, attr, Recorder(name, getattr(module, attr)))
    return seen


def _graph_bucket_meta(size: int, n_max: int, max_model_len: int, block_size: int, tables: torch.Tensor):
    """What DecodeGraphs hands the backend for a bucket: slices of fixed buffers, lists at the bucket's bounds."""
    d = tables.device
    return AttentionMetadata(
        positions=torch.zeros(n_max, dtype=torch.int64, device=d)[:size],
        slot_mapping=torch.zeros(n_max, dtype=torch.int64, device=d)[:size],
        query_start_loc=torch.arange(n_max + 1, dtype=torch.int32, device=d)[: size + 1],
        seq_lens=torch.ones(n_max, dtype=torch.int32, device=d)[:size], block_tables=tables[:size], block_size=block_size,
        num_decodes=size, query_lens_list=[1] * size, seq_lens_list=[max_model_len] * size)


@pytest.mark.parametrize("max_model_len", [512, 2048])  # one-pass decode, and split-K for every bucket <= 64
def test_one_compile_per_kernel_over_every_graph_bucket(launches, max_model_len):
    backend = triton_decode.TritonBackend()
    H, Hkv, D, bs, n_max = 4, 2, 16, 16, 24
    d = TRITON_DEVICE
    tables = torch.zeros((n_max, max_model_len // bs), dtype=torch.int32, device=d)
    k_cache, v_cache = torch.zeros(Hkv, 4 * bs, D, device=d), torch.zeros(Hkv, 4 * bs, D, device=d)
    qkv = torch.randn(n_max, (H + 2 * Hkv) * D, device=d)  # the model's fused projection: q, k, v are views of it
    for size in (1, 2, 4, 8, 16, 24):
        meta = _graph_bucket_meta(size, n_max, max_model_len, bs, tables)
        q = qkv[:size, : H * D].view(size, H, D)
        k = qkv[:size, H * D : (H + Hkv) * D].view(size, Hkv, D)
        v = qkv[:size, (H + Hkv) * D :].view(size, Hkv, D)
        backend.forward(q, k, v, k_cache, v_cache, meta, 0.25)
    used = "splitk" if max_model_len >= backend.splitk_min_len else "decode"
    assert len(launches[used]) == 1 and len(launches["write"]) == 1, launches


def test_eager_steps_of_changing_shapes_reuse_one_compile(launches):
    """Decodes and prefill chunks whose tables, lengths and batch positions change every step."""
    backend = triton_decode.TritonBackend()
    for query_lens, seq_lens in [([1], [5]), ([1, 1, 1], [17, 40, 300]), ([1, 20], [33, 52]), ([7, 16], [7, 64]),
                                 ([1] * 16 + [3], [16 * (i + 1) for i in range(16)] + [20])]:
        b = make_random_batch(query_lens, seq_lens, num_kv_heads=2, group=2, head_dim=16).to(TRITON_DEVICE)
        backend.forward(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, b.scale)
    assert {name: len(keys) for name, keys in launches.items()} == {"decode": 1, "splitk": 0, "prefill": 1, "write": 1}
