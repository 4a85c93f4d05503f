"""vLLM's ``priority`` request field under ``--scheduling-policy priority``: the lowest value is admitted first,
ties in arrival order; the server passes the field through to the engine core."""

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


@pytest.mark.slow
def test_server_passes_priority_under_the_priority_policy():
    import httpx

    with live_server({"scheduling_policy": "priority"}) as srv:
        r = httpx.post(f"{srv.url}/v1/completions", headers={"Authorization": f"Bearer {srv.api_key}"}, timeout=120,
                       json={"prompt": "Hi", "max_tokens": 2, "priority": -5})
        assert r.status_code == 200, r.text
