import numpy as np
import pytest

from pagedllm.spec_decode.policy import AcceptanceModel, DraftPolicy, StepCost, allocate


def cost_curve(points: dict[int, float]) -> StepCost:
    c = StepCost()
    for t, sec in points.items():
        c.observe(t, sec)
    return c


def test_allocate_verifies_the_drafts_that_pay_for_their_rows():
    cheap = cost_curve({1: 1.0, 5: 1.4})  # a memory-bound step: 4 more rows cost 40%
    sure, coin = np.array([0.95, 0.9, 0.85, 0.8]), np.array([0.5, 0.25, 0.125, 0.06])
    assert allocate([sure], 1, cheap) == [4]
    assert allocate([coin], 1, cheap) == [2]  # (1 + 0.75) / 1.2 beats (1 + 0.5) / 1.1 and (1 + 0.875) / 1.3
    assert allocate([np.array([0.05])], 1, cheap) == [0]
    # every row costs as much as the step (compute-bound): only certain drafts break even, none gain
    bound = cost_curve({1: 1.0, 2: 2.0, 5: 5.0})
    assert allocate([sure], 1, bound) == [0]
    # a batch: the likeliest drafts go first, whichever sequence they belong to
    batch = cost_curve({4: 1.0, 8: 1.5, 12: 3.0})
    assert allocate([coin, sure, np.array([]), sure[:2]], 4, batch) == [0, 2, 0, 2]  # (4 + 3.7) / 1.5


def test_step_cost_interpolates_extrapolates_and_damps_spikes():
    c = cost_curve({2: 2.0, 6: 4.0})
    assert c.relative(2, 4).tolist() == pytest.approx([1.0, 1.25, 1.5, 1.75, 2.0])
    above = c.relative(6, 6)  # beyond the largest measured step: linear from it
    assert above[0] == 1.0 and np.all(np.diff(above) > 0)
    assert StepCost().relative(4, 4)[-1] > 1.0  # nothing measured yet: rows still cost something
    c.observe(6, 100.0)  # a load spike
    assert c.mean[6] == pytest.approx(4.8)  # counted as at most twice the mean, at weight 0.2
    noisy = cost_curve({1: 10.0, 2: 12.0, 3: 11.0, 4: 16.0})  # 3 tokens measured cheaper than 2: load noise
    assert noisy.curve()[1].tolist() == [10.0, 11.5, 11.5, 16.0]


def test_acceptance_model_learns_per_class_and_position():
    m = AcceptanceModel(num_classes=9, max_drafts=4)
    assert m.cls(0) == 0 and m.cls(3) == 3 and m.cls(20) == 8
    for _ in range(200):
        m.update(8, 4, 4)  # long matches: all kept
        m.update(1, 4, 0)  # 1-gram matches: the first draft wrong
    assert m.survival(8, 4)[-1] > 0.9
    assert m.survival(1, 4)[0] < 0.05
    np.testing.assert_allclose(m.survival(5, 2), [0.5, 0.25])  # unseen: the prior
    m.update(2, 3, 1)  # draft 1 right, draft 2 wrong, draft 3 unseen
    assert m.tries[2].tolist() == [1, 1, 0, 0] and m.hits[2].tolist() == [1, 0, 0, 0]


def test_policy_stops_drafting_for_a_failing_request_and_tries_it_again():
    p = DraftPolicy(max_drafts=4)
    for t, sec in {1: 1.0, 2: 1.18, 5: 1.73}.items():  # SmolLM2's decode step at 1, 2 and 5 rows
        p.observe_step(t, sec)
    for _ in range(50):  # class 4 is reliable for everyone ...
        p.record("other", 4, 4) if p.choose(["other"], [4], [4], 1)[0] else None
    assert p.choose(["bad"], [4], [4], 1) == [4]
    for _ in range(8):  # ... but not for this request
        p.record("bad", 4, 0)
    assert p.choose(["bad"], [4], [4], 1) == [0]
    idle = 0
    while p.choose(["bad"], [4], [4], 1) == [0]:  # its factor drifts back while it gets no drafts
        idle += 1
        assert idle < 100
    assert idle > 5
    p.forget("bad")
    assert "bad" not in p._requests
