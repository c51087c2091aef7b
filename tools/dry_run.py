"""Dry-run a training layout at full scale with no GPU: trace the real model of every distinct rank
(tp rank x pipeline stage x cp rank x a sparse model's ep rank) at the real shapes in a fake process group of the real world size, and
compare its memory and collectives with the estimator and the communication model
(cplm_dist/profiling/dry_run.py, docs/parallelism.md).

    python tools/dry_run.py --config configs/runs/cplm-70b.yaml --gpus 512 --device h100
    python tools/dry_run.py --config configs/runs/cplm-1.7b.yaml --gpus 16 parallel.tp=2 --json dry.json
    python tools/plan.py --config cplm-7b --gpus 64 --dry-run          # the planner's choice, confirmed
    python tools/dry_run.py --config configs/runs/cplm-1.7b-32k.yaml --gpus 8 --device h100   # cp=2: both cp ranks
    python tools/dry_run.py --config configs/runs/qwen3-30b-a3b.yaml --gpus 64 --device h100   # sparse: ep 8

Exit 0 when every rank fits 90% of the device's memory (the planner's headroom), 1 with one line
naming the heaviest rank when one does not, 2 for a layout that cannot exist. Nothing is
allocated or computed: parameters, activations and collectives are fake tensors (FakeTensorMode).
DeepSpeed's optimizer states, its gradient buffers and the dp collectives are added from the
estimator's arithmetic and marked "modelled". The table and verdict: cplm_dist/profiling/dry_run_report.py.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from cplm_dist.config.cli import config_parser, exit_on_usage_error, load_from_args
from cplm_dist.errors import UsageError
from cplm_dist.profiling.dry_run import dry_run, layout_of
from cplm_dist.profiling.dry_run_report import device_named, gib, report
from cplm_dist.profiling.roofline import DEVICES


def real(cfg, layout, json_path: str | None) -> int:
    """--real: this launch's ranks trace their roles with real tensors (cplm_dist.profiling.real_trace)."""
    import torch

    from cplm_dist.distributed import destroy_distributed, init_distributed
    from cplm_dist.distributed.launch_env import LaunchEnv
    from cplm_dist.profiling.real_trace import real_roles

    if layout.cp > 1:  # its real step reads whole sequences (real_trace.step_peak), not a cp rank's chunks
        raise UsageError(f"--real traces parallel.cp=1 layouts only (this one has cp={layout.cp}): the fake dry run "
                         "traces every cp rank")
    world = LaunchEnv.from_environ(mpi_rendezvous=False).world_size
    if world != layout.world:
        raise UsageError(f"--real runs in a job of --gpus ranks: this launch has {world} (torchrun --nproc-per-node {layout.world})")
    dims = init_distributed(layout.tp, pp_size=layout.pp, ep_size=cfg.parallel.ep, expert_tp_size=cfg.parallel.expert_tp)
    try:
        roles = real_roles(cfg, dims, layout, torch.device("cpu"))
    finally:
        destroy_distributed()
    if roles is not None:
        for r in roles:
            print(f"rank {r['rank']} (tp rank {r['tp_rank']}, stage {r['pp_stage']}): {r['parameters']:,} parameters, "
                  f"traced peak {gib(r['peak_bytes'])} GiB, real step peak {gib(r['step_peak_bytes'])} GiB")
        if json_path:
            Path(json_path).write_text(json.dumps({"world": layout.world, "layout": layout.as_json(), "roles": roles}, indent=1) + "\n")
    return 0


@exit_on_usage_error
def main(argv=None) -> int:
    p = config_parser(__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the job (the world size)")
    p.add_argument("--device", choices=sorted(DEVICES), default="h200", help="the GPU: its memory, peak and bandwidth")
    p.add_argument("--gpu-gb", type=float, help="memory per GPU in GiB (default: the device's)")
    p.add_argument("--json", metavar="FILE", help="write the per-rank figures as JSON")
    p.add_argument("--real", action="store_true",
                   help="in a real job of --gpus ranks (torchrun, CPU): trace each rank for real and run a real step")
    args = p.parse_intermixed_args(argv)
    cfg = load_from_args(args)
    if args.gpus < 1:
        raise UsageError(f"--gpus {args.gpus} must be a positive integer")
    device = device_named(args.device, args.gpu_gb)
    if args.json and not Path(args.json).parent.is_dir():  # found now, not after minutes of tracing
        raise UsageError(f"--json {args.json}: its parent directory {Path(args.json).parent} does not exist")
    layout = layout_of(cfg, args.gpus)  # a layout that cannot exist: one line, before anything is built
    if args.real:
        return real(cfg, layout, args.json)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    result = dry_run(cfg, gpus=args.gpus, device=device, progress=lambda line: print(line, flush=True))
    return report(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
