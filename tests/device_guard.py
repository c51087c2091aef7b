"""Catches, on a CPU-only machine, code that would put tensors on the wrong device on a GPU.

On CPU every tensor is on the model's device, so a path that makes `torch.tensor(ids)` (on the
host) and feeds it to a model on CUDA goes unnoticed until a GPU run fails. `HostTensorGuard`
follows where tensors come from: a factory call (torch.tensor, zeros, arange, ...) without a
`device=` makes a host tensor, as does `.cpu()`; ops on host tensors only make host tensors;
`.to(device)` and factory calls with `device=` make device tensors, as does
everything derived from the model's parameters. An op that mixes a host tensor of one or more
dimensions with a device tensor is what fails on CUDA: each is recorded with the cplm_dist line
that made it. (0-dim host tensors mix freely with CUDA ones, so they are allowed.)
"""

from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.full, torch.empty, torch.arange,
             torch.randint, torch.rand, torch.randn, torch.eye, torch.linspace, torch.randperm, torch.scalar_tensor}
TO_HOST = {torch.Tensor.cpu, torch.Tensor.numpy}


def _device_arg(func, args, kwargs) -> torch.device | None:
    """The device a `.to(...)` call names, if any."""
    for a in list(args[1:]) + [kwargs.get("device")]:
        if isinstance(a, (torch.device, str)):
            try:
                return torch.device(a)
            except RuntimeError:
                continue
        if isinstance(a, torch.Tensor):
            return a.device
    return None


class HostTensorGuard(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.host = WeakIdKeyDictionary()
        self.violations: list[str] = []

    def _where(self) -> str:
        frames = [f for f in traceback.extract_stack()[:-2] if "/cplm_dist/" in f.filename or "/tools/" in f.filename]
        f = frames[-1] if frames else traceback.extract_stack()[-3]
        return f"{f.filename.split('/cplm_dist/')[-1]}:{f.lineno}: {f.line}"

    def _mark(self, out) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.host[t] = True

    def _unmark(self, out) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.host.pop(t, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in FACTORIES:
            if kwargs.get("device") is None:
                self._mark(out)
            return out
        if func in TO_HOST:
            self._mark(out)
            return out
        if func is torch.Tensor.to:
            device = _device_arg(func, args, kwargs)
            if device is not None:  # code writes .to(model_device): the CPU here, the model's device on a GPU
                self._unmark(out)
                return out
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        host = [t for t in tensors if t in self.host]
        if host:
            others = [t for t in tensors if t not in self.host]
            if others and any(t.dim() > 0 for t in host):
                self.violations.append(f"{getattr(func, '__name__', func)} mixes a host tensor with a device tensor at "
                                       f"{self._where()}")
            elif not others:
                self._mark(out)
        return out

