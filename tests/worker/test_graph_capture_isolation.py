"""``CudaGraphCapture`` keeps other threads out of a capture: its error mode is ``thread_local`` and Python's GC is
off while it records. On an H200 the default (``global``) mode failed engine start-ups in the test suite with
"operation failed due to a previous error during capture" raised by our own Triton launches: another thread's CUDA
call (or a collection freeing an older engine's CUDA objects) had invalidated the capture."""

from __future__ import annotations

import contextlib
import gc
import threading

import pytest
import torch

from pagedllm.worker import cuda_graphs


def test_capture_pauses_gc_and_isolates_the_thread(monkeypatch):
    """CPU stand-ins for torch.cuda's graph API record how the capture is made."""
    seen = {}

    class FakeGraph:
        def pool(self):
            return "pool"

        def replay(self):
            seen["replayed"] = True

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, capture_error_mode="global"):
        seen["mode"], seen["pool"] = capture_error_mode, pool
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    gc_states = []
    cap = cuda_graphs.CudaGraphCapture()
    replay = cap.capture(lambda: gc_states.append(gc.isenabled()))
    assert gc.isenabled()  # back on after the capture
    assert gc_states == [True, False]  # the warm-up ran with GC on, the recorded step with GC off
    assert seen["mode"] == "thread_local" and seen["pool"] is None and cap.pool == "pool"
    replay()
    assert seen["replayed"]


def test_gc_paused_restores_a_disabled_gc():
    gc.disable()
    try:
        with cuda_graphs.gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # it was off before: stays off
    finally:
        gc.enable()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real CUDA graph capture needs a GPU")
def test_capture_on_cuda_survives_a_copy_thread():
    """A thread doing what the KV tiers' copy thread does (device-to-host copies into pinned memory on its own
    stream, waiting on their events) and allocating fresh device memory all through a capture: the graph is still
    recorded and replays right. (A device-wide synchronize would still break it: that waits on the capturing
    stream itself, and no engine thread does it.)"""
    x = torch.ones(4096, device="cuda")
    y = torch.empty_like(x)
    src = torch.randn(1 << 20, device="cuda")
    dst = torch.empty(1 << 20, pin_memory=True)
    side = torch.cuda.Stream()
    stop, started = threading.Event(), threading.Event()
    calls, kept = [0], []

    def copy_thread() -> None:
        with torch.cuda.stream(side):
            while not stop.is_set():
                dst.copy_(src, non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
                done.synchronize()
                if len(kept) < 64:
                    kept.append(torch.empty((1 << 20) + len(kept), device="cuda"))  # a new segment: cudaMalloc
                calls[0] += 1
                started.set()

    def step() -> None:
        z = x
        for _ in range(300):  # long enough for the other thread to call in the middle of it
            z = z * 1.0 + 0.0
        y.copy_(z * 2 + 1)

    t = threading.Thread(target=copy_thread, daemon=True)
    t.start()
    started.wait(10)
    try:
        before = calls[0]
        replay = cuda_graphs.CudaGraphCapture().capture(step)
        during = calls[0] - before
    finally:
        stop.set()
        t.join()
    assert during > 0  # the thread did run beside the capture
    x.fill_(3.0)
    replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(y, 7.0))
