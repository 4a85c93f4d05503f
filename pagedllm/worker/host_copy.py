"""Bring a step's small results (sampled ids, logprobs) back to the host: on an accelerator, through
pinned buffers with non-blocking copies and one event wait for them all, so the host waits for the
step's results once instead of once per tensor (and never for a whole-device sync)."""

from __future__ import annotations

import torch


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors on the CPU (as they are when already there)."""
    if all(t.device.type == "cpu" for t in tensors):
        return list(tensors)
    out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for dst, src in zip(out, tensors):
        dst.copy_(src, non_blocking=True)
    done = torch.cuda.Event() if tensors[0].device.type == "cuda" else None
    if done is not None:
        done.record()
        done.synchronize()
    else:  # another accelerator: its synchronize is the portable wait
        getattr(torch, tensors[0].device.type).synchronize()
    return out
