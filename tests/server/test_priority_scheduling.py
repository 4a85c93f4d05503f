"""vLLM's ``priority`` request field under ``--scheduling-policy priority``: the lowest value is admitted first,
ties in arrival order; when blocks run out the least urgent running request is preempted; the server passes the
field through to the engine core."""

from __future__ import annotations

import pytest
from tests.engine.test_scheduler_no_model import make_core

from pagedllm.protocol.core_io import EngineCoreRequest
from pagedllm.protocol.sampling_params import SamplingParams
from tests.server.conftest import live_server


def admission_order(policy: str, priorities: dict[str, int]) -> list[str]:
    """Requests admitted one at a time (max_num_seqs 1): the order their first tokens come out."""
    core, _ = make_core(max_num_seqs=1, scheduling_policy=policy)
    for i, (rid, prio) in enumerate(priorities.items()):
        core.add_request(EngineCoreRequest(rid, list(range(10 * i, 10 * i + 5)),
                                           SamplingParams(ignore_eos=True, max_tokens=2), priority=prio))
    order: list[str] = []
    while core.has_unfinished():
        for o in core.step():
            if o.request_id not in order:
                order.append(o.request_id)
    assert core.kv.stats()["used"] == 0
    return order


def test_priority_policy_admits_lowest_first_ties_by_arrival():
    prios = {"a": 2, "b": 0, "c": 1, "d": 0}
    assert admission_order("priority", prios) == ["b", "d", "c", "a"]
    assert admission_order("fcfs", prios) == ["a", "b", "c", "d"]  # the field means nothing under fcfs


def first_preempted(policy: str) -> tuple[str, dict[str, int]]:
    """A pool too small for two decodes: "low" (priority 5) is admitted a step before "high" (priority 0).
    Returns the first request preempted and each request's output length at the end."""
    core, _ = make_core(num_blocks=8, max_num_batched_tokens=256, scheduling_policy=policy)
    params = SamplingParams(ignore_eos=True, max_tokens=40)
    lengths = {"low": 0, "high": 0}
    victim = None
    core.add_request(EngineCoreRequest("low", list(range(40)), params, priority=5))
    while core.has_unfinished():
        for o in core.step():
            lengths[o.request_id] += sum(len(d.new_token_ids) for d in o.seqs)
        if lengths["high"] == 0 and "high" not in core.requests:  # the step after "low" was admitted
            core.add_request(EngineCoreRequest("high", list(range(100, 140)), params, priority=0))
        if victim is None and core.scheduler.num_preemptions:
            victim = core.scheduler.waiting[0].request_id  # a recompute victim goes back to the queue's front
    assert core.kv.stats()["used"] == 0
    return victim, lengths


def test_priority_policy_preempts_the_least_urgent_running_request():
    victim, lengths = first_preempted("priority")
    assert victim == "low"  # admitted first, but the least urgent
    assert lengths == {"low": 40, "high": 40}
    assert first_preempted("fcfs")[0] == "high"  # fcfs: the latest admitted


@pytest.mark.slow
def test_server_passes_priority_under_the_priority_policy():
    import httpx

    with live_server({"scheduling_policy": "priority"}) as srv:
        r = httpx.post(f"{srv.url}/v1/completions", headers={"Authorization": f"Bearer {srv.api_key}"}, timeout=120,
                       json={"prompt": "Hi", "max_tokens": 2, "priority": -5})
        assert r.status_code == 200, r.text
