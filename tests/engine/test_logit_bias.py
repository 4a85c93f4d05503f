"""logit_bias applied to a batch in one scatter."""

from __future__ import annotations

import torch


def test_logit_bias_batched():
    from pagedllm.protocol.logit_bias import apply_logit_bias

    logits = torch.zeros(3, 8)
    apply_logit_bias(logits, [{1: 2.0, 7: -100.0}, None, {0: 0.5}])
    expected = torch.zeros(3, 8)
    expected[0, 1], expected[0, 7], expected[2, 0] = 2.0, -100.0, 0.5
    assert torch.equal(logits, expected)
