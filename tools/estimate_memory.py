"""Per-device memory of a training step for a config and layout, and what fits on a GPU.

    python tools/estimate_memory.py --config cplm-1.7b --dp 16 --micro-batch 8 --seq-len 2048
    python tools/estimate_memory.py --config cplm-70b --tp 8 --dp 64 --zero 3 --seq-len 4096 --gpu-gb 80
    python tools/estimate_memory.py --config configs/runs/cplm-7b.yaml --dp 32     # layout fields from the config
    python tools/estimate_memory.py --config cplm-70b --tp 8 --pp 4 --dp 16 --seq-len 4096 --accumulation 16

At --pp > 1 (default: parallel.pp) the figures are the heaviest pipeline stage's, every stage's total
listed below them; the micro-batches in flight depend on the accumulation (default:
train.global_batch_size / (micro-batch x dp)).

The formulas (cplm_dist/profiling/memory.py, docs/performance.md): model states by ZeRO stage and precision,
activations per layer of our block with and without checkpointing, the copy head's scores, the
[tokens, V/tp] softmax buffer, the larger of the two transient peaks, and per pipeline stage its
own layers, the 1F1B schedule's micro-batches in flight and the pipe buffers.
"""

from __future__ import annotations

import sys

from cplm_dist.config.cli import config_parser, exit_on_usage_error, load_from_args
from cplm_dist.errors import UsageError
from cplm_dist.profiling.memory import GIB, largest_micro_batch, stage_estimates


@exit_on_usage_error
def main(argv=None) -> int:
    p = config_parser(__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, help="default: parallel.tp")
    p.add_argument("--pp", type=int, help="pipeline stages (default: parallel.pp)")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--accumulation", type=int,
                   help="micro-batches a step, at --pp > 1 (default: train.global_batch_size / (micro-batch x dp))")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], help="default: train.zero_stage")
    p.add_argument("--precision", choices=["fp32", "bf16"], help="default: train.precision")
    p.add_argument("--micro-batch", type=int, help="default: train.micro_batch_size")
    p.add_argument("--seq-len", type=int, help="default: data.seq_length")
    p.add_argument("--ckpt", choices=["on", "off"], help="activation checkpointing (default: the config's)")
    p.add_argument("--gpu-gb", type=float, default=80.0, help="device memory for the 'largest micro-batch' line (GiB)")
    args = p.parse_intermixed_args(argv)
    cfg = load_from_args(args)
    tp = args.tp or cfg.parallel.tp
    if cfg.model.num_heads % tp or cfg.model.num_kv_heads % tp:
        raise UsageError(f"--tp {tp} does not divide model.num_heads={cfg.model.num_heads} / num_kv_heads={cfg.model.num_kv_heads}")
    pp = args.pp or cfg.parallel.pp
    if pp < 1 or pp > cfg.model.num_layers:
        raise UsageError(f"--pp {pp} must be between 1 and model.num_layers={cfg.model.num_layers}")
    zero = cfg.train.zero_stage if args.zero is None else args.zero
    if pp > 1 and zero > 1:
        raise UsageError(f"ZeRO-{zero} with --pp {pp}: DeepSpeed's pipeline engine trains with ZeRO 0-1 only (training "
                         "refuses this layout); use --zero 1 or --pp 1")
    if args.accumulation is not None and args.accumulation < 1:
        raise UsageError(f"--accumulation {args.accumulation} must be a positive integer")
    kw = {"zero": args.zero, "precision": args.precision,
          "activation_checkpointing": None if args.ckpt is None else args.ckpt == "on", "pp": pp,
          "accumulation": args.accumulation}
    micro = args.micro_batch or cfg.train.micro_batch_size
    seq = args.seq_len or cfg.data.seq_length
    stages = stage_estimates(cfg, tp=tp, dp=args.dp, micro_batch=micro, seq_len=seq, **kw)
    heaviest = max(range(len(stages)), key=lambda s: stages[s].total)
    est = stages[heaviest]
    precision = args.precision or cfg.train.precision
    ckpt = cfg.train.activation_checkpointing if args.ckpt is None else args.ckpt == "on"
    accumulation = args.accumulation or max(1, cfg.train.global_batch_size // (micro * args.dp))
    staged = f" pp={pp} (stage {heaviest}, the heaviest; {accumulation} micro-batches a step)" if pp > 1 else ""
    print(f"{cfg.model.name}: tp={tp}{staged} dp={args.dp} ZeRO-{zero} {precision}, micro-batch {micro} x {seq} tokens, "
          f"activation checkpointing {'on' if ckpt else 'off'} -- GiB per device")
    for key, value in est.as_dict().items():
        print(f"  {key:<20} {value / GIB:10.3f}")
    if pp > 1:
        print("  per stage (total)    " + " ".join(f"{e.total / GIB:.3f}" for e in stages))
    device = args.gpu_gb * GIB
    for label, on in (("without", False), ("with", True)):
        fits = largest_micro_batch(cfg, device, tp=tp, dp=args.dp, seq_len=seq, zero=args.zero,
                                   precision=args.precision, activation_checkpointing=on, pp=pp,
                                   accumulation=args.accumulation)
        print(f"largest micro-batch on {args.gpu_gb:g} GiB (90% used) {label} checkpointing: {fits}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
