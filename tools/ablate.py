"""One command for the question "does the copy head help?": matched training runs (copy off
against each mix mode) at several sizes with the same data order, seeds and token budget, each
evaluated on the copy / retrieval suite and the gradient bottleneck, summarised in a report.

    python tools/ablate.py                                  # CPU default: tiny and small, copy off and every mix, 1 seed
    python tools/ablate.py --sizes tiny --variants off gate --seeds 1 2 3 --steps 400
    python tools/ablate.py --sizes tiny --variants off gate --seeds 1 2 3 --optimizers adamw muon \
        --lr-grid adamw=1.5e-3,3e-3,6e-3 muon=3e-3,6e-3,1.2e-2    # does Muon change what the copy head buys?
    python tools/ablate.py --sizes tiny --variants off gate --seeds 1 2 3 --backbones dense sparse \
        --skip bottleneck                                   # does a sparse model of equal active size change it?
    python tools/ablate.py --base-config configs/runs/cplm-135m.yaml --sizes base --launcher "torchrun --nproc-per-node 8"
    python tools/ablate.py --arms gate bias-m2 detach nodecay joint wsd --sizes tiny --seeds 1 2 3 --steps 2000 \
        --arm lr-peak-6e-3 optim.lr=6e-3                    # the retention grid: which recipe keeps retrieval?

Writes <out>/report.md (tables; the copy-on minus copy-off differences and whether copy on wins,
with the seeds used; with several --optimizers or --backbones the copy head's gain under each, and for
sparse runs the expert load and copy share over steps), <out>/summary.json, and PNGs: validation loss
against tokens, suite accuracy per variant, gradient suppression (and routing.png). --backbones sparse
is the same model with every MLP 8 experts of width ffn / 2, top-2: the dense model's active
parameters (cplm_dist.experiments.ablation_sparse says why this choice). Finished runs are reused, so an interrupted
ablation continues where it stopped. The runs, their summaries and the report are
cplm_dist.experiments.ablation's; the evaluations run as the installed evaluate and grad_bottleneck
tools (python -m cplm_dist_tools.evaluate, after --launcher).

--arms (and --arm NAME OVERRIDE...) runs the retention grid instead (cplm_dist.experiments.retention):
each arm a named set of overrides, every size and seed trained with the in-loop copy suite, the first
arm the reference; it writes <out>/retention.md (curves, each arm minus the reference paired by seed
with 90% t-intervals, which arms keep retrieval without costing validation loss), retention.png and
summary.json. --variants, --optimizers, --backbones and the learning-rate flags belong to the ablation.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from cplm_dist.config import load_config
from cplm_dist.config.cli import exit_on_usage_error
from cplm_dist.errors import UsageError
from cplm_dist.experiments.ablation import OPTIMIZERS, SIZES, Ablation, pick_learning_rates, run_ablation, write_report
from cplm_dist.experiments.ablation_sparse import BACKBONES
from cplm_dist.experiments.retention import ARMS, RetentionGrid, arm_overrides, run_grid, write_grid_report
from cplm_dist.experiments.runs import VARIANTS, ensure_quickstart_data, interpreter

EVALUATE, BOTTLENECK = "cplm_dist_tools.evaluate", "cplm_dist_tools.grad_bottleneck"  # this package's tools, as installed


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-config", default="configs/quickstart.yaml")
    p.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=list(SIZES))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--seeds", nargs="+", type=int, default=[1])
    p.add_argument("--optimizers", nargs="+", default=["adamw"], choices=list(OPTIMIZERS))
    p.add_argument("--backbones", nargs="+", default=["dense"], choices=list(BACKBONES),
                   help="sparse: every MLP 8 experts of width ffn/2, top-2 (the dense model's active parameters)")
    p.add_argument("--skip", nargs="+", default=[], choices=["suite", "bottleneck"],
                   help="evaluations to leave out (their report columns stay empty)")
    p.add_argument("--lr", nargs="+", default=[], metavar="OPT=LR", help="an optimizer's learning rate (optim.lr for "
                   "adamw, optim.muon.lr for muon), e.g. muon=6e-3")
    p.add_argument("--lr-grid", nargs="+", default=[], metavar="OPT=LR,LR,...", help="pick an optimizer's learning "
                   "rate first: copy off at the first size and seed, lowest validation loss (runs in <out>/lr-grid)")
    p.add_argument("--arms", nargs="+", default=[], metavar="ARM", help=f"the retention grid's named arms, the first "
                   f"the reference: {', '.join(ARMS)}")
    p.add_argument("--arm", nargs="+", action="append", default=[], metavar=("NAME", "OVERRIDE"),
                   help="an arm of the retention grid given by its overrides (repeatable)")
    p.add_argument("--report-only", action="store_true", help="the retention grid: report the finished runs, train none")
    p.add_argument("--steps", type=int, default=None, help="steps a run (200; the retention grid 2000)")
    p.add_argument("--samples", type=int, default=16, help="evaluation samples per task setting")
    p.add_argument("--out", default=None, help="runs/ablation (the retention grid: runs/retention)")
    p.add_argument("--launcher", default="", help="prefix for the training and evaluation commands, e.g. 'torchrun --nproc-per-node 8'")
    p.add_argument("overrides", nargs="*", help="config overrides for every run")
    return p


def per_optimizer(pairs: list[str], flag: str, optimizers: list[str]) -> dict[str, list[float]]:
    """{optimizer: [rates]} from OPT=LR[,LR...] words; a malformed one is a usage error naming it."""
    out = {}
    for pair in pairs:
        name, _, rates = pair.partition("=")
        try:
            out[name] = [float(r) for r in rates.split(",")]
        except ValueError:
            raise UsageError(f"{flag} {pair}: expected OPT=LR[,LR...] with numbers, e.g. muon=3e-3,6e-3") from None
        if name not in optimizers or not all(r > 0 for r in out[name]):
            raise UsageError(f"{flag} {pair}: the optimizer must be one of --optimizers {optimizers} and every rate > 0")
    return out


def retention_main(args) -> int:
    """--arms / --arm: the retention grid (cplm_dist.experiments.retention)."""
    custom = {}
    for words in args.arm:
        if len(words) < 2:
            raise UsageError(f"--arm {' '.join(words)}: give a name and at least one override, e.g. --arm lr6 optim.lr=6e-3")
        custom[words[0]] = words[1:]
    out = Path(args.out or "runs/retention")
    out.mkdir(parents=True, exist_ok=True)
    log = out / "retention.log"
    ensure_quickstart_data(load_config(args.base_config, args.overrides), log)
    steps = args.steps or 2000
    grid = RetentionGrid(args.base_config, args.sizes, arm_overrides(args.arms, args.base_config, args.overrides, steps, custom),
                         seeds=args.seeds, steps=steps, overrides=args.overrides, out=out)
    runs = run_grid(grid, None if args.report_only else interpreter(args.launcher), log)
    if not runs:
        raise UsageError(f"no finished run of this grid in {out}: run it without --report-only first")
    (out / "summary.json").write_text(json.dumps(runs, indent=2) + "\n")
    print(write_grid_report(runs, grid, out))
    print(f"wrote {out / 'retention.md'}, {out / 'summary.json'} and retention.png")
    return 0


@exit_on_usage_error
def main(argv=None) -> int:
    args = parser().parse_intermixed_args(argv)
    if args.arms or args.arm:
        return retention_main(args)
    args.steps, args.out = args.steps or 200, args.out or "runs/ablation"
    fixed = {k: v[0] for k, v in per_optimizer(args.lr, "--lr", args.optimizers).items()}
    grid = per_optimizer(args.lr_grid, "--lr-grid", args.optimizers)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "ablation.log"
    py = interpreter(args.launcher)  # torchrun takes `-m module` as python does
    ensure_quickstart_data(load_config(args.base_config, args.overrides), log)  # fail early on a bad base
    ablation = Ablation(args.base_config, args.sizes, args.variants, args.seeds, steps=args.steps, samples=args.samples,
                        overrides=args.overrides, out=out, optimizers=args.optimizers, learning_rates=fixed,
                        backbones=args.backbones, skip=tuple(args.skip))
    picked = pick_learning_rates(ablation, grid, py, log) if grid else None
    if picked:
        ablation = dataclasses.replace(ablation, learning_rates={**fixed, **{o: r["picked"] for o, r in picked.items()}})
    runs = run_ablation(ablation, py, [*py, "-m", EVALUATE], [*py, "-m", BOTTLENECK], log)
    (out / "summary.json").write_text(json.dumps(runs, indent=2) + "\n")
    report = write_report(runs, ablation, out, picked)
    print(report)
    print(f"wrote {out / 'report.md'}, {out / 'summary.json'} and plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
