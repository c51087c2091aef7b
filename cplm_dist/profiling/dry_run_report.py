"""What a dry run (dry_run.py) prints and writes: one table row per traced rank, the verdict
against the device's usable memory, the step time beside the planner's, the JSON; and the device
a --device / --gpu-gb pair names. tools/dry_run.py and tools/plan.py --dry-run both report this way.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cplm_dist.errors import UsageError
from cplm_dist.profiling.dry_run import HEADROOM, DryRun
from cplm_dist.profiling.memory import bubble
from cplm_dist.profiling.roofline import DEVICES, GIB, Device


def gib(x: float) -> str:
    """Bytes as GiB, two decimals."""
    return f"{x / GIB:.2f}"


def _span(ranks: list[int]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def table(result: DryRun) -> str:
    """One row per traced rank (the tp ranks alike to it share it)."""
    ep = result.layout.ep > 1
    head = ["stage", *(["cp rank"] if result.layout.cp > 1 else []), "tp ranks", *(["ep rank"] if ep else []), "parameters",
            "traced peak GiB", "(optimizer, modelled)", "estimate GiB", "error", "tp GB traced", "tp GB modelled",
            *(["cp GB traced"] if result.layout.cp > 1 else []), *(["ep GB traced", "ep GB modelled"] if ep else []),
            "pp GB", "dp GB (modelled)", "roofline s / micro"]
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
        dp = sum(v for k, v in r.modelled["collectives"].items() if k.startswith(("dp/", "edp/", "tied/")))
        ep_traced = sum(v for k, v in t.collectives.items() if k.startswith("ep/"))
        ep_model = sum(v for k, v in r.modelled_collectives.items() if k.startswith("ep/"))
        experts = [f"{t.ep_rank} (of {result.layout.ep}, alike)"] if ep else []
        cells = [str(stage), *([str(cp_rank)] if result.layout.cp > 1 else []), _span([a.tp_rank for a in alike]), *experts,
                 f"{t.parameters / 1e6:,.1f}M", gib(r.peak_bytes),
                 gib(r.modelled["optimizer_states"]), gib(r.estimate_bytes), f"{r.error:+.1%}", f"{tp_traced / 1e9:.2f}",
                 f"{tp_model / 1e9:.2f}", *([f"{cp_traced / 1e9:.2f}"] if result.layout.cp > 1 else []),
                 *([f"{ep_traced / 1e9:.2f}", f"{ep_model / 1e9:.2f}"] if ep else []),
                 f"{sum(t.boundary.values()) / 1e9:.2f}", f"{dp / 1e9:.2f}", f"{t.roofline_s:.3g}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _who(role, layout) -> str:
    return f"tp rank {role.tp_rank}{f' (cp rank {role.cp_rank})' if layout.cp > 1 else ''}"


def summary(result: DryRun) -> str:
    """The verdict, the step time against the planner's, the FLOPs and the layout, a line each."""
    L, heavy, device = result.layout, result.heaviest, result.device
    schedule = result.cfg.parallel.pp_schedule
    usable = HEADROOM * device.memory_bytes
    verdict = (f"fits: the heaviest rank ({_who(heavy, L)} of stage {heavy.pp_stage}) needs {gib(heavy.peak_bytes)} GiB "
               f"of {gib(usable)} GiB usable ({HEADROOM:.0%} of the {device.name}'s {device.memory_gib:g} GiB)")
    return "\n".join([
        verdict if result.fits else "does not fit",
        f"step time: roofline {result.roofline_step_s:.3g} s (a model: every traced eager operator at the {device.name}'s "
        f"peak FLOPs or memory bandwidth; compiled layers fuse the pointwise ones away) against the planner's "
        f"{result.planner_step_s:.3g} s (compute at its measured achievable share of peak); traced in {result.seconds:.0f} s",
        f"FLOPs of a dp replica's step: {result.replica_flops[0] / 1e12:.4g} T traced, "
        f"{result.replica_flops[1] / 1e12:.4g} T by throughput.flops_per_token (what MFU counts)",
        f"layout: world {L.world} = tp {L.tp}{f' x cp {L.cp}' if L.cp > 1 else ''} x pp {L.pp} x dp {L.dp}"
        f"{f' (ep {L.ep} over tp x cp x dp)' if L.ep > 1 else ''}, ZeRO-{L.zero_stage} {L.precision}, "
        f"micro {L.micro_batch} x {L.seq_len} tokens x accumulation {L.accumulation}"
        + (f"; {schedule} bubble {bubble(L.pp, L.accumulation, schedule):.1%}" if L.pp > 1 else "")])


def device_named(name: str, gpu_gb: float | None) -> Device:
    """The DEVICES entry `name`, with `gpu_gb` GiB of memory when given (--device, --gpu-gb)."""
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
    print(f"error: {_who(heavy, result.layout)} of pipeline stage {heavy.pp_stage} needs {gib(heavy.peak_bytes)} GiB (traced), "
          f"more than the {gib(HEADROOM * result.device.memory_bytes)} GiB usable of the {result.device.name}'s "
          f"{result.device.memory_gib:g} GiB: raise tp, pp or cp, turn on train.activation_checkpointing or lower "
          "train.micro_batch_size (tools/plan.py finds a layout that fits)", file=sys.stderr)
    return 1
