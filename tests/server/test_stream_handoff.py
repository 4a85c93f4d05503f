"""The reader thread hands a step's outputs to the streams' event loop in one wake-up, each stream's in order."""

from __future__ import annotations

import asyncio

from pagedllm.frontend.async_engine import AsyncEngine
from pagedllm.frontend.core_client import EngineCoreDied
from pagedllm.protocol.outputs import CompletionOutput, RequestMetrics, RequestOutput


class CountingLoop:
    """Stands in for an event loop in another thread: runs each callback at once and counts the wake-ups."""

    def __init__(self) -> None:
        self.wakeups = 0

    def call_soon_threadsafe(self, fn, *args) -> None:
        self.wakeups += 1
        fn(*args)


def output(rid: str, text: str, finished: bool = False, error: str | None = None) -> RequestOutput:
    return RequestOutput(rid, None, [1], [CompletionOutput(0, text, [])], finished, RequestMetrics(0.0), error=error)


def engine_with_streams(loops: dict[str, CountingLoop]) -> AsyncEngine:
    eng = AsyncEngine.__new__(AsyncEngine)  # no core: only the hand-off is under test
    eng._streams = {rid: (loop, asyncio.Queue()) for rid, loop in loops.items()}
    return eng


def drain(q: asyncio.Queue) -> list:
    return [q.get_nowait() for _ in range(q.qsize())]


def test_a_steps_outputs_wake_each_loop_once_and_keep_their_order():
    a, b = CountingLoop(), CountingLoop()
    eng = engine_with_streams({"r1": a, "r2": a, "r3": a, "r4": b})
    queues = {rid: q for rid, (_, q) in eng._streams.items()}
    eng._push_all([("r1", output("r1", "x")), ("r2", output("r2", "y", finished=True)), ("r1", output("r1", "xz")),
                   ("r3", output("r3", "", error="boom")), ("r4", output("r4", "w")), ("gone", output("gone", "v"))])
    assert (a.wakeups, b.wakeups) == (1, 1)
    assert [o.outputs[0].text for o in drain(queues["r1"])] == ["x", "xz"]
    assert [o.finished for o in drain(queues["r2"])] == [True]
    (err,) = drain(queues["r3"])
    assert isinstance(err, RuntimeError) and "boom" in str(err)
    assert [o.outputs[0].text for o in drain(queues["r4"])] == ["w"]
    assert set(eng._streams) == {"r1", "r4"}  # a finished or failed stream is done; an unknown id is dropped


def test_a_dead_core_reaches_every_stream_in_one_wakeup():
    loop = CountingLoop()
    eng = engine_with_streams({"r1": loop, "r2": loop})
    queues = [q for _, q in eng._streams.values()]
    eng._on_error(RuntimeError("killed"))
    assert loop.wakeups == 1 and not eng._streams
    assert all(isinstance(drain(q)[0], EngineCoreDied) for q in queues)
