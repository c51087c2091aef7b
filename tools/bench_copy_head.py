"""The copy head alone, its paths (copy.impl: dense, chunked, and flex on CUDA): peak memory and
time of forward + backward per sequence length, and how far each path's outputs and gradients are
from the dense ones (a benchmark: figures go to the console and JSON, never into a test's pass/fail).

    python tools/bench_copy_head.py                                  # T = 1024 2048 4096, CPU
    python tools/bench_copy_head.py --seq-lens 2048 8192 --heads 4 --chunk 512 --json out.json
    python tools/bench_copy_head.py --impls dense chunked flex --check 1e-3     # on a GPU

--check TOL exits 1 when a path's A_t, M_t differ from dense by more than TOL or its gradients by
more than TOL relative (tools/gpu_check.sh checks the fused flex kernel and its backward so);
--record-flex then records a passing flex path (cplm_dist/model/flex_record.py), after which
copy.impl=auto trains flex on CUDA.

Each (T, impl) point runs in a fresh process on CPU, so that its peak resident set is its own; on
CUDA the allocator's peak counter is reset per point instead.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from cplm_dist.config.cli import exit_on_usage_error
from cplm_dist.errors import UsageError
from cplm_dist.model.mixes import MIXES

FIELDS = ("seq_len", "impl", "chunk", "peak_mb", "estimated_mb", "seconds", "max_abs_diff_lse", "max_rel_diff_grad")


def estimated_mb(args, T: int, impl: str) -> float:
    """cplm_dist.profiling.memory's copy-head term for this point (what the training estimate counts), plus
    the gradient with respect to h that this measurement also holds (in training it is counted
    with the layers' gradients)."""
    from cplm_dist.config import Config, CopyConfig
    from cplm_dist.profiling.memory import copy_head_bytes

    cfg = Config(copy=CopyConfig(num_heads=args.heads, head_dim=args.head_dim, impl=impl, chunk_size=args.chunk))
    return (copy_head_bytes(cfg, args.batch, T) + 4 * args.batch * T * args.hidden) / 1e6


def make_head(args, impl: str, device):
    from cplm_dist.config import CopyConfig, ModelConfig
    from cplm_dist.model.copy_head import CopyHead

    torch.manual_seed(0)
    cfg = CopyConfig(num_heads=args.heads, head_dim=args.head_dim, mix=args.mix, paste=args.paste, impl=impl,
                     chunk_size=args.chunk)
    head = CopyHead(ModelConfig(hidden_size=args.hidden), cfg, device=device)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.02)
    return head


def inputs(args, T: int, device):
    g = torch.Generator(device="cpu").manual_seed(1)
    h = torch.randn(args.batch, T, args.hidden, generator=g).to(device).requires_grad_(True)
    ids = torch.randint(0, args.vocab, (args.batch, T), generator=g).to(device)
    labels = torch.randint(0, args.vocab, (args.batch, T), generator=g).to(device)
    return h, ids, labels


def run_head(head, h, ids, labels):
    """Forward and backward of the copy head with a loss that uses A and M; returns (terms, grads)."""
    terms = head(h, ids, labels)
    finite = torch.isfinite(terms.copy_match)
    loss = (terms.copy_match - terms.copy_all).masked_fill(~finite, 0).sum()
    if terms.gate is not None:
        loss = loss + terms.gate.sum()
    grads = torch.autograd.grad(loss, [h, *head.parameters()])
    return terms, grads


def measure(args, T: int, impl: str) -> dict:
    """One point in this process: peak memory above the start, seconds (best of --repeat)."""
    from cplm_dist.profiling.measure import PeakMeter, current_memory_bytes, release_freed_memory_on_cpu

    device = torch.device(args.device)
    release_freed_memory_on_cpu()
    head = make_head(args, impl, device)
    h, ids, labels = inputs(args, T, device)
    run_head(head, h, ids, labels)  # warm-up
    best, peak = float("inf"), 0
    for _ in range(args.repeat):
        with PeakMeter(device) as meter:
            base = current_memory_bytes(device)
            t0 = time.perf_counter()
            run_head(head, h, ids, labels)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        peak = max(peak, meter.peak - base)
    return {"seq_len": T, "impl": impl, "chunk": args.chunk if impl == "chunked" else None,
            "peak_mb": peak / 1e6, "seconds": best}


def agreement(dense, other) -> tuple[float, float]:
    """(max |A, M difference|, max relative gradient difference) of one path's run_head against dense's."""
    (td, gd), (tc, gc) = dense, other
    diff = 0.0
    for a, b in ((td.copy_all, tc.copy_all), (td.copy_match, tc.copy_match)):
        if not torch.equal(torch.isfinite(a), torch.isfinite(b)):
            return float("inf"), float("inf")
        ok = torch.isfinite(a)
        diff = max(diff, (a[ok] - b[ok]).abs().max().item() if ok.any() else 0.0)
    rel = max(((x - y).norm() / y.norm().clamp_min(1e-30)).item() for x, y in zip(gc, gd))
    return diff, rel


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--impls", nargs="+", default=["dense", "chunked"], choices=["dense", "chunked", "flex"])
    p.add_argument("--chunk", type=int, default=256, help="copy.chunk_size of the chunked path")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=576, help="model width feeding the head (cplm-135m: 576)")
    p.add_argument("--vocab", type=int, default=49152, help="ids drawn from this range (matches are rare when large)")
    p.add_argument("--mix", default="gate", choices=list(MIXES))
    p.add_argument("--paste", default="next", choices=["next", "self"])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--check", type=float, metavar="TOL", help="exit 1 if a path differs from dense by more than TOL")
    p.add_argument("--record-flex", action="store_true",
                   help="with --check and flex: when flex passes, write cplm_dist/model/flex_gpu_record.json (or "
                        "$CPLM_FLEX_RECORD), after which copy.impl=auto trains flex on CUDA with this torch")
    p.add_argument("--point", nargs=2, metavar=("T", "IMPL"), help=argparse.SUPPRESS)  # one point, in a child
    return p


@exit_on_usage_error
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.chunk < 1 or min(args.seq_lens) < 2:
        raise UsageError("--chunk must be >= 1 and every --seq-lens value >= 2")
    if "flex" in args.impls and torch.device(args.device).type != "cuda":
        raise UsageError("--impls flex needs a CUDA --device: FlexAttention has no CPU backward")
    if args.record_flex and ("flex" not in args.impls or args.check is None):
        raise UsageError("--record-flex records a checked flex path: give --impls ... flex and --check TOL")
    if args.point:
        print(json.dumps(measure(args, int(args.point[0]), args.point[1])))
        return 0
    rows = []
    own = list(argv if argv is not None else sys.argv[1:])  # a child with --point returns before --json
    for T in args.seq_lens:
        agree = {}
        if len(args.impls) > 1 or args.check is not None:
            device = torch.device(args.device)
            h, ids, labels = inputs(args, T, device)
            dense = run_head(make_head(args, "dense", device), h, ids, labels)
            agree = {impl: agreement(dense, run_head(make_head(args, impl, device), h, ids, labels))
                     for impl in args.impls if impl != "dense"}
            del dense, h
        for impl in args.impls:
            diff, rel = agree.get(impl, (None, None))
            if torch.device(args.device).type == "cpu":
                out = subprocess.run([sys.executable, __file__, *own, "--point", str(T), impl],
                                     capture_output=True, text=True)
                if out.returncode != 0:
                    raise RuntimeError(f"point T={T} {impl} failed: {out.stderr.strip()[-500:]}")
                row = json.loads(out.stdout.strip().splitlines()[-1])
            else:
                row = measure(args, T, impl)
            rows.append({**row, "estimated_mb": estimated_mb(args, T, impl), "max_abs_diff_lse": diff,
                         "max_rel_diff_grad": rel})
    print(f"copy head alone: batch {args.batch}, {args.heads} head(s) x {args.head_dim}, mix {args.mix}, "
          f"paste {args.paste}, device {args.device}")
    print("| T | impl | peak MB | estimated MB | seconds (fwd+bwd) | vs dense: max abs A, M | grad rel. diff |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        impl = r["impl"] + (f" ({r['chunk']})" if r["chunk"] else "")
        fmt = (lambda v: "-" if v is None else f"{v:.1e}")  # noqa: E731
        print(f"| {r['seq_len']} | {impl} | {r['peak_mb']:.1f} | {r['estimated_mb']:.1f} | {r['seconds']:.3f} | {fmt(r['max_abs_diff_lse'])} | {fmt(r['max_rel_diff_grad'])} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.check is not None:
        off = [r for r in rows if r["max_abs_diff_lse"] is not None
               and not (r["max_abs_diff_lse"] <= args.check and r["max_rel_diff_grad"] <= args.check)]
        for r in off:
            print(f"CHECK FAILED: T={r['seq_len']} {r['impl']} differs from dense by {r['max_abs_diff_lse']:.1e} "
                  f"(A, M) and {r['max_rel_diff_grad']:.1e} (gradients, relative) > {args.check}", file=sys.stderr)
        if args.record_flex and not off:
            from cplm_dist.model.flex_record import write_record

            path = write_record([r for r in rows if r["impl"] == "flex"], args.check,
                                torch.cuda.get_device_name(torch.device(args.device)))
            print(f"flex matched dense within {args.check}: recorded in {path} (copy.impl=auto now trains flex on CUDA)",
                  file=sys.stderr)
        return 1 if off else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
