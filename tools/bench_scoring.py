"""Scoring targets, the two ways evaluation can: the gathered (B, T, V) distribution
(`next_token_logprobs`, then gather and argmax) against `CPLM.score` (read at the targets, the
vocabulary never gathered, a block of positions at a time): peak memory above the start, time,
and that both give the same numbers (a benchmark: figures go to the console, never into a test).

    python tools/bench_scoring.py                                   # cplm-135m with 2 layers, 4 x 1024, CPU
    python tools/bench_scoring.py --config cplm-1.7b --layers 4 --batch 8 --seq-len 2048

Each way runs in a fresh process on CPU, so that its peak resident set is its own; on CUDA the
allocator's peak counter is reset instead. Weights are random (the figures do not depend on them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from cplm_dist.config.cli import exit_on_usage_error
from cplm_dist.errors import UsageError

WAYS = ("gathered", "score")


def measure(args, way: str) -> dict:
    from cplm_dist.config import load_config
    from cplm_dist.distributed import init_distributed
    from cplm_dist.model import build_model
    from cplm_dist.profiling.measure import PeakMeter, current_memory_bytes, release_freed_memory_on_cpu

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dims = init_distributed(1)
    cfg = load_config(args.config, [f"model.num_layers={args.layers}", f"model.max_seq_len={max(args.seq_len, 2)}", "seed=0"])
    device = torch.device(args.device)
    model = build_model(cfg, tp_group=dims.tp_group, device=device, activation_checkpointing=False, compile_layers=False,
                        sequence_parallel=False).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.model.vocab_size, (args.batch, args.seq_len + 1), generator=g).to(device)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    release_freed_memory_on_cpu()
    base = current_memory_bytes(device)
    with PeakMeter(device) as meter:
        start = time.perf_counter()
        if way == "gathered":
            logprobs = model.next_token_logprobs(inputs)  # (B, T, V)
            logp = logprobs.gather(-1, targets[..., None]).squeeze(-1)
            greedy = logprobs.argmax(-1) == targets
        else:
            logp, greedy = model.score(inputs, targets)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    return {"way": way, "peak_gb": (meter.peak - base) / 1e9, "seconds": seconds,
            "logp_sum": float(logp.double().sum()), "greedy": int(greedy.sum())}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="cplm-135m")
    p.add_argument("--layers", type=int, default=2, help="model.num_layers (the scoring cost is past the layers)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--port", type=int, default=29533, help="the one-process group's rendezvous port")
    p.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # one way, in a child
    return p


@exit_on_usage_error
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if min(args.layers, args.batch, args.seq_len) < 1:
        raise UsageError("--layers, --batch and --seq-len must be positive integers")
    if args.way:
        print(json.dumps(measure(args, args.way)))
        return 0
    own = list(argv if argv is not None else sys.argv[1:])
    rows = []
    for way in WAYS:
        proc = subprocess.run([sys.executable, __file__, *own, "--way", way], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{way} failed: {proc.stderr.strip()[-500:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"{args.config} ({args.layers} layers), batch {args.batch} x {args.seq_len} tokens, {args.device}")
    print("| way | peak GB | seconds | sum of target log-probs | greedy targets |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['way']} | {r['peak_gb']:.2f} | {r['seconds']:.2f} | {r['logp_sum']:.4f} | {r['greedy']} |")
    gathered, scored = rows
    same = abs(gathered["logp_sum"] - scored["logp_sum"]) <= 1e-5 * abs(gathered["logp_sum"]) and gathered["greedy"] == scored["greedy"]
    print("same numbers" if same else "THE TWO WAYS DIFFER")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
