"""Bring a step's small results (sampled ids, logprobs) back to the host: on an accelerator, through
pinned buffers with non-blocking copies and one event wait for them all, so the host waits for the
step's results once instead of once per tensor (and never for a whole-device sync). ``HostCopy`` splits
the copy's start from its wait, so the host can launch the next step before it waits for this one's."""

from __future__ import annotations

import torch


class HostCopy:
    """Copies of ``tensors`` on their way to the host; ``wait`` returns them once they are there. The
    copies are queued on the device's stream when this is made, so work queued after it (the next step
    writing the same output buffers) cannot change what arrives."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self._event = None
        if all(t.device.type == "cpu" for t in tensors):
            # already here; a clone, since the next step may write these buffers before ``wait``
            self._out = [t.clone() for t in tensors]
            return
        self._out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for dst, src in zip(self._out, tensors):
            dst.copy_(src, non_blocking=True)
        self._device = tensors[0].device
        if self._device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> list[torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
        elif self._out and self._out[0].is_pinned():  # another accelerator: its synchronize is the portable wait
            getattr(torch, self._device.type).synchronize()
        return self._out


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors on the CPU, waited for now (as they are when already there)."""
    if all(t.device.type == "cpu" for t in tensors):
        return list(tensors)
    return HostCopy(*tensors).wait()
