"""The engine core keeps a grammar state per structured sequence only while it runs: finished and
aborted sequences (a client that went away) leave none behind (issue 34's soak)."""

from __future__ import annotations


def test_finished_and_aborted_structured_sequences_leave_no_state(tiny_model_dir):
    from pagedllm.config.args import EngineArgs
    from pagedllm.core.engine_core import EngineCore
    from pagedllm.protocol.core_io import EngineCoreRequest
    from pagedllm.protocol.sampling_params import SamplingParams
    from pagedllm.structured import StructuredOutputsParams

    core = EngineCore(EngineArgs(model=tiny_model_dir, kv_cache_memory=32 << 20, dtype="float32"))
    try:
        so = StructuredOutputsParams(regex="[a-z]{20,40}")
        for i in range(4):
            core.add_request(EngineCoreRequest(f"r{i}", [5, 6, 7, 8], SamplingParams(max_tokens=64, n=1 + i % 2,
                                                                                     structured_outputs=so)))
        while core._compiling:  # their grammar compiles beside the steps (once: they share the spec)
            core.step()
        core.step()
        core.step()
        assert len(core.structured.states) == 6  # 4 requests, two of them with 2 samples
        core.abort_request("r0")
        core.abort_request("r1")
        assert len(core.structured.states) == 3
        while core.has_unfinished():
            core.step()
        assert core.structured.states == {}
    finally:
        core.shutdown()
