"""A roofline model of the operators a traced step runs: each aten operator takes the longer of
its FLOPs at the device's dense peak and the bytes it reads and writes at the device's memory
bandwidth (torch's FLOP formulas, torch.utils.flop_counter; an expanded view read as its storage).
Views move nothing; collectives are left to the communication figures. A model, not a
measurement: the figure is a lower bound on the time of this eager operator sequence (no kernel
reaches its roofline), but not on a compiled step's, which fuses the pointwise operators away
(the planner's `achievable` is what a measured compiled step reaches). `by_op` has each
operator's calls, FLOPs, bytes and seconds.

    with Roofline(DEVICES["h200"], "bf16") as roof:   # inside FakeTensorMode: nothing is computed
        loss.backward()
    roof.seconds, roof.flops
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from cplm_dist.training.throughput import PEAK_FLOPS

GIB = 1024**3


@dataclass(frozen=True)
class Device:
    name: str
    memory_gib: float  # what the driver reports (nvidia-smi's MiB / 1024)
    hbm_gbps: float  # memory bandwidth, GB/s (vendor datasheet)
    datasheet: str  # PEAK_FLOPS's key: dense bf16 / TF32 peaks

    def peak_flops(self, precision: str) -> float:
        return PEAK_FLOPS[self.datasheet][precision]

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB


DEVICES = {
    "h200": Device("H200", 140.4, 4800.0, "H200"),  # 143,771 MiB, 4.8 TB/s HBM3e
    "h100": Device("H100", 79.6, 3350.0, "H100"),  # SXM 80 GB: 81,559 MiB, 3.35 TB/s HBM3
    "a100": Device("A100", 80.0, 2039.0, "A100"),  # SXM 80 GB: 81,920 MiB, 2.04 TB/s HBM2e
}


def _cpu_sdpa(*args, out_val=None, **kwargs) -> int:
    q, k, v = args[:3]
    return sdpa_flop_count(q.shape, k.shape, v.shape)


def _cpu_sdpa_backward(*args, out_val=None, **kwargs) -> int:
    grad_out, q, k, v = args[:4]
    return sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape)


# what SDPA runs as on CPU, where a dry run traces (torch counts only the GPU kernels)
FLOPS = {**flop_registry,
         torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa,
         torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward}


def _storages(value) -> dict[int, int]:
    out = {}
    for t in tree_leaves(value):
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()  # an expanded view reads its storage once, not numel elements
            out[st._cdata] = min(t.numel() * t.element_size(), st.nbytes())
    return out


class Roofline(TorchDispatchMode):
    """Sums each operator's roofline time while active (module docstring)."""

    def __init__(self, device: Device, precision: str):
        super().__init__()
        self.peak, self.bandwidth = device.peak_flops(precision), device.hbm_gbps * 1e9
        self.seconds = self.flops = self.bytes = 0.0
        self.by_op: dict[str, list[float]] = {}  # operator: [calls, FLOPs, bytes, seconds]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if func.namespace in ("c10d", "_c10d_functional", "prim") or func.is_view:
            return out
        inputs, outputs = _storages((args, kwargs)), _storages(out)
        if not outputs or (set(outputs) <= set(inputs) and not func._schema.is_mutable):
            return out  # a view by another name (_unsafe_view, alias): nothing is read or written
        flops = FLOPS[packet](*args, **kwargs, out_val=out) if packet in FLOPS else 0
        moved = sum(inputs.values()) + sum(n for key, n in outputs.items() if key not in inputs)
        self.flops += flops
        self.bytes += moved
        seconds = max(flops / self.peak, moved / self.bandwidth)
        self.seconds += seconds
        row = self.by_op.setdefault(str(packet), [0, 0.0, 0.0, 0.0])
        row[0] += 1
        row[1] += flops
        row[2] += moved
        row[3] += seconds
        return out
