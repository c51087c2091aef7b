"""FLOPs per token, MFU and peak memory: one formula for training logs and the profiler.

Convention (docs/performance.md): a training step costs 3x its forward (forward + backward of
activations + backward of weights). Forward FLOPs per token:

    2 * N_matmul                               every weight matrix, once per token
  + 4 * L * T * d_attn                         QK^T and AV over all T keys (not halved for causality)
  + 2 * T * H_c * d_c                          the copy head's scores (no AV: it only needs A_t, M_t)

d_attn = num_heads x model.head_dim, the width of q (hidden_size unless model.head_dim says
otherwise: Qwen3's 16 x 128 beside hidden 1024). N_matmul counts every parameter that multiplies
an activation: QKV, attention output, MLP, the LM head (V x D, tied or not) and the copy head's q,
k and gate; not the embedding lookup or the norms. In a sparse layer (model.moe) a token meets
the router, top_k of the E experts and the shared expert: N_matmul counts those (active
parameters, cplm_dist.model.counting), so MFU is on the FLOPs a token costs. The attention term is PaLM's (Chowdhery et al.
2022, appendix B) and Megatron's: the full T x T product, although causal kernels skip about half
of it; MFU by this convention is comparable with their published figures. So per token: 6 * N_matmul + 12 * L * T * d_attn + 6 * T * H_c * d_c.

MFU = achieved FLOP/s per device / the device's dense peak for the training precision, from
`PEAK_FLOPS` (vendor datasheets, dense, no sparsity). No MFU on CPU: there is no honest peak.
"""

from __future__ import annotations

import re
import resource
import sys

import torch

from cplm_dist.config import Config
from cplm_dist.model.counting import matmul_parameters

# Dense peak FLOP/s per device by (name fragment, precision); bf16 and TF32 tensor cores.
PEAK_FLOPS = {
    "H200": {"bf16": 989e12, "fp32": 494.5e12},
    "H100 PCIe": {"bf16": 756e12, "fp32": 378e12},
    "H100 NVL": {"bf16": 835e12, "fp32": 417.5e12},
    "H100": {"bf16": 989e12, "fp32": 494.5e12},  # SXM
    "GH200": {"bf16": 989e12, "fp32": 494.5e12},
    "B200": {"bf16": 2250e12, "fp32": 1100e12},
    "A100": {"bf16": 312e12, "fp32": 156e12},
    "A10G": {"bf16": 70e12, "fp32": 35e12},
    "L40S": {"bf16": 362e12, "fp32": 183e12},
    "L40": {"bf16": 181e12, "fp32": 90.5e12},
    "L4": {"bf16": 121e12, "fp32": 60e12},
    "MI300X": {"bf16": 1307e12, "fp32": 653.7e12},
}


def forward_flops(cfg: Config, seq_len: int, *, layers: int | None = None, heads: bool = True) -> int:
    """Forward FLOPs per token (the module docstring's formula) of `layers` transformer layers
    (default all) and, with `heads`, the LM head and the copy head: the whole model, a pipeline
    stage (cplm_dist.profiling.planner) or the layers alone (what checkpointing recomputes)."""
    m, c = cfg.model, cfg.copy
    n = m.num_layers if layers is None else layers
    forward = 2 * matmul_parameters(cfg, layers=n, heads=heads) + 4 * n * seq_len * m.num_heads * m.head_dim
    if heads and c.enabled:
        forward += 2 * seq_len * c.num_heads * c.head_dim
    return forward


def flops_per_token(cfg: Config, seq_len: int) -> float:
    """Training FLOPs per token at sequence length `seq_len` (forward x 3)."""
    return 3.0 * forward_flops(cfg, seq_len)


def device_peak_flops(precision: str, device: torch.device | None = None) -> float | None:
    """The dense peak of this rank's accelerator for `precision`, or None (CPU, unknown GPU)."""
    if not torch.cuda.is_available() or (device is not None and device.type != "cuda"):
        return None
    return peak_for_name(torch.cuda.get_device_name(device), precision)


def peak_for_name(name: str, precision: str) -> float | None:
    """The PEAK_FLOPS entry whose fragment appears in `name` as whole words, longest fragment
    first: "NVIDIA L40" is not an L4, "NVIDIA H100 NVL" not an H100 SXM, "NVIDIA GH200" not an H200."""
    for fragment in sorted(PEAK_FLOPS, key=len, reverse=True):
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(fragment)}(?![A-Za-z0-9])", name):
            return PEAK_FLOPS[fragment][precision]
    return None


def peak_memory_bytes(device: torch.device) -> int:
    """Max allocated accelerator memory, or this process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB
