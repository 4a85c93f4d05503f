"""OpenAI's ``logit_bias`` for a whole batch in one scatter: each row's {token: bias} added to its logits."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def apply_logit_bias(logits: torch.Tensor, biases: Sequence[dict[int, float] | None]) -> None:
    """``logits[i, t] += biases[i][t]`` in place for every row with a bias (one ``index_put_``)."""
    rows, cols, vals = [], [], []
    for i, bias in enumerate(biases):
        if bias:
            rows += [i] * len(bias)
            cols += list(bias)
            vals += list(bias.values())
    if not rows:
        return
    index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    logits.index_put_(index, torch.tensor(vals, dtype=logits.dtype, device=logits.device), accumulate=True)
