"""Dry-run a training layout at full scale with no GPU: trace the real model of every distinct rank
(tp rank x pipeline stage x cp rank) at the real shapes in a fake process group of the real world size, and
compare its memory and collectives with the estimator and the communication model
(cplm_dist/profiling/dry_run.py, docs/parallelism.md).

    python tools/dry_run.py --config configs/runs/cplm-70b.yaml --gpus 512 --device h100
    python tools/dry_run.py --config configs/runs/cplm-1.7b.yaml --gpus 16 parallel.tp=2 --json dry.json
    python tools/plan.py --config cplm-7b --gpus 64 --dry-run          # the planner's choice, confirmed
    python tools/dry_run.py --config configs/runs/cplm-1.7b-32k.yaml --gpus 8 --device h100   # cp=2: both cp ranks

Exit 0 when every rank fits 90% of the device's memory (the planner's headroom), 1 with one line
naming the heaviest rank when one does not, 2 for a layout that cannot exist. Nothing is
allocated or computed: parameters, activations and collectives are fake tensors (FakeTensorMode).
DeepSpeed's optimizer states, its gradient buffers and the dp collectives are added from the
estimator's arithmetic and marked "modelled".
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from cplm_dist.config.cli import config_parser, exit_on_usage_error, load_from_args
from cplm_dist.errors import UsageError
from cplm_dist.profiling.dry_run import HEADROOM, DryRun, dry_run, layout_of
from cplm_dist.profiling.roofline import DEVICES, GIB, Device


def _gb(x: float) -> str:
    return f"{x / GIB:.2f}"


def _span(ranks: list[int]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def table(result: DryRun) -> str:
    """One row per traced rank (the tp ranks alike to it share it)."""
    head = ["stage", *(["cp rank"] if result.layout.cp > 1 else []), "tp ranks", "parameters", "traced peak GiB", "(optimizer, modelled)", "estimate GiB", "error",
            "tp GB traced", "tp GB modelled", *(["cp GB traced"] if result.layout.cp > 1 else []), "pp GB", "dp GB (modelled)", "roofline s / micro"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    traced = {}
    for role in result.roles:
        traced.setdefault((role.pp_stage, role.cp_rank, role.traced_as), []).append(role)
    for (stage, cp_rank, _), alike in traced.items():
        r = alike[0]
        t = r.trace
        tp_traced = sum(v for k, v in t.collectives.items() if k.startswith("tp/"))
        tp_model = sum(v for k, v in r.modelled_collectives.items() if k.startswith("tp/"))
        cp_traced = sum(v for k, v in t.collectives.items() if k.startswith("cp/"))
        dp = sum(v for k, v in r.modelled["collectives"].items() if k.startswith(("dp/", "tied/")))
        cells = [str(stage), *([str(cp_rank)] if result.layout.cp > 1 else []), _span([a.tp_rank for a in alike]), f"{t.parameters / 1e6:,.1f}M", _gb(r.peak_bytes),
                 _gb(r.modelled["optimizer_states"]), _gb(r.estimate_bytes), f"{r.error:+.1%}", f"{tp_traced / 1e9:.2f}",
                 f"{tp_model / 1e9:.2f}", *([f"{cp_traced / 1e9:.2f}"] if result.layout.cp > 1 else []),
                 f"{sum(t.boundary.values()) / 1e9:.2f}", f"{dp / 1e9:.2f}", f"{t.roofline_s:.3g}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _who(role, layout) -> str:
    return f"tp rank {role.tp_rank}{f' (cp rank {role.cp_rank})' if layout.cp > 1 else ''}"


def summary(result: DryRun) -> str:
    L, heavy, device = result.layout, result.heaviest, result.device
    usable = HEADROOM * device.memory_bytes
    verdict = (f"fits: the heaviest rank ({_who(heavy, L)} of stage {heavy.pp_stage}) needs {_gb(heavy.peak_bytes)} GiB "
               f"of {_gb(usable)} GiB usable ({HEADROOM:.0%} of the {device.name}'s {device.memory_gib:g} GiB)")
    return "\n".join([
        verdict if result.fits else "does not fit",
        f"step time: roofline {result.roofline_step_s:.3g} s (a model: every traced eager operator at the {device.name}'s "
        f"peak FLOPs or memory bandwidth; compiled layers fuse the pointwise ones away) against the planner's "
        f"{result.planner_step_s:.3g} s (compute at its measured achievable share of peak); traced in {result.seconds:.0f} s",
        f"FLOPs of a dp replica's step: {result.replica_flops[0] / 1e12:.4g} T traced, "
        f"{result.replica_flops[1] / 1e12:.4g} T by throughput.flops_per_token (what MFU counts)",
        f"layout: world {L.world} = tp {L.tp}{f' x cp {L.cp}' if L.cp > 1 else ''} x pp {L.pp} x dp {L.dp}, ZeRO-{L.zero_stage} {L.precision}, "
        f"micro {L.micro_batch} x {L.seq_len} tokens x accumulation {L.accumulation}"])


def device_of(name: str, gpu_gb: float | None) -> Device:
    device = DEVICES[name]
    if gpu_gb is None:
        return device
    if gpu_gb <= 0:
        raise UsageError(f"--gpu-gb {gpu_gb:g} must be positive")
    return Device(device.name, gpu_gb, device.hbm_gbps, device.datasheet)


def report(result: DryRun, json_path: str | None, out=print) -> int:
    """Print the table and verdict, write the JSON; the exit code (0 fits, 1 does not)."""
    out(table(result))
    out(summary(result))
    if json_path:
        Path(json_path).write_text(json.dumps(result.as_json(), indent=1) + "\n")
        out(f"wrote {json_path}")
    if result.fits:
        return 0
    heavy = result.heaviest
    print(f"error: {_who(heavy, result.layout)} of pipeline stage {heavy.pp_stage} needs {_gb(heavy.peak_bytes)} GiB (traced), "
          f"more than the {_gb(HEADROOM * result.device.memory_bytes)} GiB usable of the {result.device.name}'s "
          f"{result.device.memory_gib:g} GiB: raise tp, pp or cp, turn on train.activation_checkpointing or lower "
          "train.micro_batch_size (tools/plan.py finds a layout that fits)", file=sys.stderr)
    return 1


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
    dims = init_distributed(layout.tp, pp_size=layout.pp)
    try:
        roles = real_roles(cfg, dims, layout, torch.device("cpu"))
    finally:
        destroy_distributed()
    if roles is not None:
        for r in roles:
            print(f"rank {r['rank']} (tp rank {r['tp_rank']}, stage {r['pp_stage']}): {r['parameters']:,} parameters, "
                  f"traced peak {_gb(r['peak_bytes'])} GiB, real step peak {_gb(r['step_peak_bytes'])} GiB")
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
    device = device_of(args.device, args.gpu_gb)
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
