"""A grammar compiles on a thread beside the engine's steps: a spec that takes seconds to compile (four
2,000-character enum strings take ~3-8 s) must not stall every other request's tokens meanwhile. The
compile is held on an event here, so what the tests see does not depend on how fast it runs."""

from __future__ import annotations

import re
import threading

import pytest


@pytest.fixture
def core(tiny_model_dir):
    from pagedllm.config.args import EngineArgs
    from pagedllm.core.engine_core import EngineCore

    core = EngineCore(EngineArgs(model=tiny_model_dir, kv_cache_memory=32 << 20, dtype="float32"))
    yield core
    core.shutdown()


def _held_compile(core, monkeypatch, fail: str | None = None) -> threading.Event:
    """Make the core's compiles wait for the returned event (then fail with ``fail``, if given)."""
    gate = threading.Event()
    real = core.structured.compiler.compile

    def held(params, grammar=None):
        assert gate.wait(60), "the test never released the compile"
        if fail is not None:
            raise ValueError(fail)
        return real(params, grammar)

    monkeypatch.setattr(core.structured.compiler, "compile", held)
    return gate


def _request(rid: str, **params):
    from pagedllm.protocol.core_io import EngineCoreRequest
    from pagedllm.protocol.sampling_params import SamplingParams

    return EngineCoreRequest(rid, [5, 6, 7, 8], SamplingParams(**params))


def _run(core, outputs: dict, until=None, max_steps: int = 200) -> None:
    """Step the core, gathering each request's tokens, finish and error, until ``until()`` or it is idle."""
    for _ in range(max_steps):
        if (until is not None and until()) or not core.has_unfinished():
            return
        for out in core.step():
            entry = outputs.setdefault(out.request_id, {"tokens": [], "finished": False, "error": None})
            for d in out.seqs:
                entry["tokens"] += d.new_token_ids
            entry["finished"] |= out.finished
            entry["error"] = out.error or entry["error"]
    raise AssertionError(f"not done after {max_steps} steps: {outputs}")


def test_other_requests_run_while_a_grammar_compiles_then_it_runs_in_its_grammar(core, monkeypatch):
    from pagedllm.structured import StructuredOutputsParams

    gate = _held_compile(core, monkeypatch)
    core.add_request(_request("s", max_tokens=16, structured_outputs=StructuredOutputsParams(regex="[a-z]{5,10}")))
    core.add_request(_request("p", max_tokens=8, ignore_eos=True))
    outputs: dict = {}
    _run(core, outputs, until=lambda: outputs.get("p", {}).get("finished"))
    assert len(outputs["p"]["tokens"]) == 8
    assert "s" not in outputs and "s" in core.requests  # waiting for its grammar
    assert core.pool_stats()["waiting"] == 1  # and counted as waiting, as vLLM counts WAITING_FOR_FSM
    assert not core.kv.has_seq(core.requests["s"].seqs[0].seq_id)  # and holding no blocks meanwhile
    gate.set()
    _run(core, outputs)
    text = core.structured.tokenizer.decode(outputs["s"]["tokens"], skip_special_tokens=True)
    assert outputs["s"]["finished"] and re.fullmatch("[a-z]{5,10}", text), text
    assert core.structured.states == {}
    core.check_integrity()
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_a_compile_that_fails_ends_its_request_with_the_reason_and_nothing_else(core, monkeypatch):
    from pagedllm.structured import StructuredOutputsParams

    gate = _held_compile(core, monkeypatch, fail="structured_outputs.regex cannot be compiled: held to fail")
    core.add_request(_request("s", max_tokens=16, structured_outputs=StructuredOutputsParams(regex="[0-9]+")))
    core.add_request(_request("p", max_tokens=8, ignore_eos=True))
    gate.set()
    outputs: dict = {}
    _run(core, outputs)
    assert outputs["s"]["finished"] and outputs["s"]["tokens"] == []
    assert outputs["s"]["error"] == "structured_outputs.regex cannot be compiled: held to fail"
    assert outputs["p"]["finished"] and len(outputs["p"]["tokens"]) == 8 and outputs["p"]["error"] is None
    assert core.requests == {} and core.structured.states == {}
    core.check_integrity()
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_a_request_aborted_while_its_grammar_compiles_leaves_nothing_and_spares_its_twin(core, monkeypatch):
    from pagedllm.structured import StructuredOutputsParams

    gate = _held_compile(core, monkeypatch)
    so = StructuredOutputsParams(regex="[a-z]{3}")
    core.add_request(_request("s", max_tokens=16, structured_outputs=so))
    core.add_request(_request("t", max_tokens=16, structured_outputs=so))  # shares the compile with "s"
    core.abort_request("s")
    assert core.has_unfinished() and set(core._compiling) == {"t"}
    gate.set()  # the shared compile finishes after one of its requests is gone
    outputs: dict = {}
    _run(core, outputs)
    assert set(outputs) == {"t"} and outputs["t"]["finished"] and outputs["t"]["error"] is None
    assert re.fullmatch("[a-z]{3}", core.structured.tokenizer.decode(outputs["t"]["tokens"], skip_special_tokens=True))
    assert core.structured.compiler.misses == 1 and core.structured.states == {}
    core.check_integrity()
    assert core.kv.num_free_blocks == core.kv.num_blocks


@pytest.mark.parametrize("spec, field", [({"regex": "(unclosed"}, "regex"),
                                         ({"grammar": "root ::= undefined_rule"}, "grammar"),
                                         ({"json": {"type": "no-such-type"}}, "json")])
def test_a_spec_that_does_not_parse_is_refused_when_added(core, spec, field):
    from pagedllm.structured import StructuredOutputsParams

    with pytest.raises(ValueError, match=f"structured_outputs.{field} cannot be compiled"):
        core.add_request(_request("bad", max_tokens=4, structured_outputs=StructuredOutputsParams(**spec)))
    assert not core.has_unfinished() and core.requests == {}


def test_a_spec_compiled_before_is_scheduled_at_once(core):
    from pagedllm.structured import StructuredOutputsParams

    so = StructuredOutputsParams(choice=["yes", "no"])
    core.structured.compiler.compile(so)
    core.add_request(_request("s", max_tokens=4, structured_outputs=so))
    assert core._compiling == {} and list(core.scheduler.waiting)[0].request_id == "s"
