"""The card's own ceilings, measured: dense bf16 matrix products and device-to-device copy bandwidth,
so MFU can be read against the datasheet peak (cplm_dist.training.throughput) and against what the
card delivers. Needs a CUDA device.

    python tools/gpu_ceiling.py            # e.g. 'bf16 matmul 8192^3: 780.1 TFLOP/s; copy: 4290 GB/s (read + write)'
"""

from __future__ import annotations

import sys

import torch


def timed_ms(fn, repeat: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_ceiling: no CUDA device; run it on a GPU machine", file=sys.stderr)
        return 2
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = timed_ms(lambda: a @ b)
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = timed_ms(lambda: dst.copy_(src))
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}: bf16 matmul {n}^3: {2 * n**3 / ms / 1e9:.1f} TFLOP/s; "
          f"copy: {2 * src.numel() / copy_ms / 1e6:.0f} GB/s (read + write)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
