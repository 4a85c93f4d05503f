"""A check that a device step creates no tensor off the worker's device, runnable without a GPU.

On CUDA, a tensor made with ``torch.arange(n)`` (no ``device=``) inside the step lands on the host and the
next op that meets a device tensor fails ("found at least two devices", "index is on cuda:0, different from
other tensors on cpu"). On a CPU every tensor is on the host, so the bug is invisible there. This check makes
it visible on any machine: under :class:`DeviceCheck` (a ``TorchFunctionMode``) every factory call inside the
step must say where its tensor goes (``device=`` the worker's device) or derive it from an input tensor
(``*_like``, ``Tensor.new_*``, ops on tensors), and no tensor may be moved to another device. A call that
breaks the rule raises :class:`DeviceCheckError` naming the call and the line that made it, and is recorded
in :data:`RECORDED` (an engine may turn a failed step into a request error; a test reads the record).

``PAGEDLLM_DEVICE_CHECK=1`` makes every worker of the process (and of its child processes) run its forward
passes under the check (:class:`CheckedForwardPass`); CI runs the engine's main paths that way
(tests/worker/test_device_check.py).
"""

from __future__ import annotations

import os
import sys

import torch
from torch.overrides import TorchFunctionMode

from pagedllm.models.forward_pass import ForwardPass

ENV = "PAGEDLLM_DEVICE_CHECK"

# factories whose tensor lands on the default device (the host) unless they are given device=
_FACTORIES = {
    torch.tensor, torch.as_tensor, torch.arange, torch.zeros, torch.ones, torch.empty, torch.full, torch.rand,
    torch.randn, torch.randint, torch.randperm, torch.eye, torch.linspace, torch.logspace, torch.empty_strided,
    torch.scalar_tensor, torch.tril_indices, torch.triu_indices,
}
_HOST_ONLY = {torch.from_numpy, torch.frombuffer}  # always on the host
_TORCH_DIR = os.path.dirname(torch.__file__)

RECORDED: list[str] = []  # every violation seen in this process, oldest first


class DeviceCheckError(RuntimeError):
    """A tensor was created on, or moved to, a device other than the step's."""


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


def _same(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


def _caller() -> str:
    """``file:line`` of the innermost frame outside torch and this module: the code that made the call."""
    f = sys._getframe(2)
    while f is not None and (f.f_code.co_filename.startswith(_TORCH_DIR) or f.f_code.co_filename == __file__):
        f = f.f_back
    return f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else "<unknown>"


def _target_of_to(args: tuple, kwargs: dict) -> torch.device | None:
    """The device ``Tensor.to(...)`` moves to, or None when it keeps the tensor's device."""
    if "device" in kwargs and kwargs["device"] is not None:
        return torch.device(kwargs["device"])
    for a in args[1:]:
        if isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):
            return torch.device(a)
        if isinstance(a, torch.Tensor):
            return a.device
    return None


class DeviceCheck(TorchFunctionMode):
    """Fails any tensor made on, or moved to, a device other than ``device`` while the mode is active."""

    def __init__(self, device: torch.device | str) -> None:
        super().__init__()
        self.device = torch.device(device)

    def _violation(self, what: str) -> None:
        where = _caller()
        if where.startswith("<"):  # code torch generated (torch.compile's wrappers, e.g. compiled flex on CUDA
            return  # passing a scalar as a host tensor, seen on an H200), not ours to place
        msg = f"{what} at {where} inside a step on {self.device}"
        RECORDED.append(msg)
        raise DeviceCheckError(msg)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not torch.compiler.is_compiling():
            self._inspect(func, args, kwargs)
        return func(*args, **kwargs)

    def _inspect(self, func, args: tuple, kwargs: dict) -> None:
        name = getattr(func, "__name__", str(func))
        if func in _HOST_ONLY:
            self._violation(f"torch.{name} made a host tensor")
        elif func in _FACTORIES:
            if func in (torch.tensor, torch.as_tensor) and args and isinstance(args[0], torch.Tensor):
                dev = kwargs.get("device")
                if dev is not None and not _same(torch.device(dev), self.device):
                    self._violation(f"torch.{name}(..., device={dev}) made a tensor on another device")
                return
            dev = kwargs.get("device")
            if dev is None:
                self._violation(f"torch.{name} without device= made a tensor on the default device (the host)")
            elif not _same(torch.device(dev), self.device):
                self._violation(f"torch.{name}(..., device={dev}) made a tensor on another device")
        elif func is torch.Tensor.to:
            dev = _target_of_to(args, kwargs)
            if dev is not None and not _same(dev, self.device):
                self._violation(f"Tensor.to({dev}) moved a tensor off the device")
        elif func is torch.Tensor.cpu:
            self._violation("Tensor.cpu() moved a tensor to the host (use .tolist() to read values)")
        elif func is torch.Tensor.cuda and self.device.type != "cuda":
            self._violation("Tensor.cuda() moved a tensor off the device")


class CheckedForwardPass(ForwardPass):
    """A :class:`ForwardPass` whose every forward runs under :class:`DeviceCheck` on the pool's device."""

    def forward(self, input_ids: torch.Tensor, meta) -> torch.Tensor:
        with DeviceCheck(self.kv_cache.data.device):
            return super().forward(input_ids, meta)
