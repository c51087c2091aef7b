"""Scaling ladders for copy on / off: plan sizes and token budgets, run every point (locally one
after another, or each as a Slurm job through launch/submit.sh), fit loss against compute per
variant, and report the copy head's gain, extrapolated to larger models and marked as such.

    python tools/scaling.py --params 1e6 8e6 --points 4 --variants off gate --seeds 1 2
    python tools/scaling.py --params 1e6 8e6 --points 4 model.arch=gpt2 --out runs/scaling-gpt2
    python tools/scaling.py --params 2e6 16e6 --points 4 model.moe.num_experts=8 --axis active --out runs/scaling-moe
    python tools/scaling.py --base-config configs/runs/cplm-135m.yaml --params 5e7 1e9 --points 5 \\
        --tokens-per-parameter 20 --slurm "--nodes 1 --gpus-per-node 8 --time 12:00:00 --partition gpu"

Sizes: --points log-spaced parameter targets in [--params MIN MAX] (or --sizes T1 T2 ...), each
turned into depth and width by cplm_dist.experiments.scaling.shape_for (a fixed --aspect D / L, heads of
--head-dim). Tokens: --tokens-per-parameter x the exact parameter count, in whole steps of the
base config's global batch x sequence length. Sparse points: model.moe.* among the overrides (sized
by total parameters; each point reports total and active); --axis flops | active | total picks what
the fits run along. Variants: copy off, gate, joint, sentinel, joint_gate, or
NAME=override,override (any config override). Every point trains with --resume auto into
<out>/points/<variant>-<size>-seed<k>; a point whose last checkpoint is written is not run again,
so re-running the command continues an interrupted ladder. Writes <out>/ladder.json (the plan),
<out>/points.csv (parameters, tokens, FLOPs, validation loss, suite scores a point),
<out>/fits.json, <out>/report.md and PNGs (loss against compute with the fits; the copy gain).

Recipes: each point's learning rate, micro-batch, global batch and (under --slurm) job size come
from rules (default: lr from the base config's along the width, muP's 1/width; the batch in tokens
from DeepSeek LLM's power law in compute; the micro-batch that fits the base's memory; the fewest
GPUs that train the point within 24 hours) or from --ladder-file's table, which names points by
parameters; overrides on the command line (optim.lr=..., train.global_batch_size=...) win over both.
Each point's recipe is in ladder.json. Rules, sources and the file: cplm_dist/experiments/ladder_recipe.py.

--slurm runs the launch/submit.sh this installation ships (inside the package once installed) in
this directory, each point's job sized by its recipe (at most the options' --nodes), and evaluates
each trained point in a Slurm job of its own (sbatch, one node; the options' --time, --partition,
--account and other sbatch options kept), not on this host; with --dry-run among its options each
point's sbatch commands are printed and nothing is queued. The work is cplm_dist.experiments': ladder.py (plan, train, evaluate, collect),
slurm.py (submit and wait), ladder_report.py (fits, gains, the report).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from cplm_dist.config import load_config
from cplm_dist.config.cli import exit_on_usage_error
from cplm_dist.errors import UsageError
from cplm_dist.experiments.ladder import Ladder, collect, evaluate_points, log_spaced, plan_ladder, train_points, unfinished
from cplm_dist.experiments.ladder_recipe import Job, Recipe
from cplm_dist.experiments.ladder_report import fit_variants, gains, write_outputs
from cplm_dist.experiments.runs import VARIANTS, ensure_quickstart_data, finished, interpreter
from cplm_dist.experiments.slurm import evaluate_in_jobs, submit_and_wait

EVALUATE = "cplm_dist_tools.evaluate"  # the suite after training: this package's evaluate tool, as installed


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-config", default="configs/quickstart.yaml")
    p.add_argument("--params", nargs=2, type=float, metavar=("MIN", "MAX"), help="parameter range of the ladder")
    p.add_argument("--points", type=int, default=4, help="sizes, log-spaced over --params")
    p.add_argument("--sizes", nargs="+", type=float, help="explicit parameter targets instead of --params/--points")
    p.add_argument("--aspect", type=float, default=32.0, help="hidden size / layers")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--tokens-per-parameter", type=float, default=20.0)
    p.add_argument("--variants", nargs="+", default=["off", "gate"], help=f"{sorted(VARIANTS)} or NAME=override,override")
    p.add_argument("--seeds", nargs="+", type=int, default=[1])
    p.add_argument("--suite", nargs="*", default=["induction", "mqar"], help="copy/retrieval tasks after training (none: skip)")
    p.add_argument("--samples", type=int, default=16, help="evaluation samples per task setting")
    p.add_argument("--out", default="runs/scaling")
    p.add_argument("--launcher", default="", help="prefix for local commands, e.g. 'torchrun --nproc-per-node 8'")
    p.add_argument("--slurm", metavar="SUBMIT_OPTIONS", help="submit each point as a Slurm job: launch/submit.sh options "
                   "(--nodes: the most a point's job takes; each trained point is evaluated in a job of its own)")
    p.add_argument("--ladder-file", metavar="YAML", help="the points' recipe: `rules:` (lr, batch, micro, hours, mfu, "
                   "peak_tflops) and a `table:` of rows by params (cplm_dist/experiments/ladder_recipe.py)")
    p.add_argument("--stop-after", type=int, help="stop after training this many points (the rest on the next run)")
    p.add_argument("--bootstrap", type=int, default=200, help="resamples over seeds for the intervals")
    p.add_argument("--axis", default="flops", choices=["flops", "active", "total"], help="what the fits run along: "
                   "training FLOPs, or active or total parameters (a sparse ladder: model.moe.* among the overrides)")
    p.add_argument("overrides", nargs="*", help="config overrides for every point, e.g. model.arch=gpt2")
    return p


def ladder_of(args) -> Ladder:
    if args.sizes:
        targets = sorted(args.sizes)
    elif args.params:
        targets = log_spaced(*args.params, args.points)
    else:
        raise UsageError("give the ladder's sizes: --params MIN MAX [--points N] or --sizes T1 T2 ...")
    return Ladder(args.base_config, targets, args.variants, args.seeds, args.overrides, aspect=args.aspect,
                  head_dim=args.head_dim, tokens_per_parameter=args.tokens_per_parameter, out=Path(args.out),
                  recipe=Recipe.from_file(args.ladder_file), job=job_of(args.slurm), world=world_of(args.launcher),
                  axis=args.axis)


def _option(words: list[str], names: tuple[str, ...], default: int) -> int:
    """The last integer value of one of `names` among `words` (--name N or --name=N)."""
    value = default
    for i, word in enumerate(words):
        name, _, inline = word.partition("=")
        if name in names and (inline or i + 1 < len(words)):
            raw = inline or words[i + 1]
            if not raw.isdigit():
                raise UsageError(f"{name} {raw}: need a whole number")
            value = int(raw)
    return value


def job_of(slurm: str | None) -> Job:
    """The job size a ladder's Slurm points may use: its options' --nodes, --gpus-per-node and
    --tasks-per-node (no --slurm: the points train here)."""
    if slurm is None:
        return Job()
    words = shlex.split(slurm)
    return Job(slurm=True, max_nodes=max(1, _option(words, ("--nodes",), 1)), gpus_per_node=_option(words, ("--gpus-per-node",), 0),
               tasks_per_node=max(1, _option(words, ("--tasks-per-node",), 1)))


def world_of(launcher: str) -> int:
    """The ranks a local point trains on: the --launcher's processes a node x nodes (1 without one)."""
    words = shlex.split(launcher or "")
    return (max(1, _option(words, ("--nproc-per-node", "--nproc_per_node"), 1))
            * max(1, _option(words, ("--nnodes",), 1)))


@exit_on_usage_error
def main(argv=None) -> int:
    args = parser().parse_intermixed_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "scaling.log"
    ensure_quickstart_data(load_config(args.base_config, args.overrides), log)
    ladder = ladder_of(args)
    points = plan_ladder(ladder)
    (out / "ladder.json").write_text(json.dumps(points, indent=2) + "\n")
    print(f"{len(points)} points; {sum(finished(Path(p['run_dir']), p['steps']) for p in points)} already finished", flush=True)
    todo, prefix = unfinished(points, args.stop_after), interpreter(args.launcher)
    if args.slurm:
        options = shlex.split(args.slurm)
        if not submit_and_wait(todo, options, out, log):
            evaluate_in_jobs(points, [*prefix, "-m", EVALUATE], args.suite, args.samples, options, out, log)
            print(f"dry run: nothing submitted; the plan is in {out / 'ladder.json'}; each point is evaluated with "
                  f"{shlex.join([*prefix, '-m', EVALUATE])} once trained, in a Slurm job of its own")
            return 0
        evaluate_in_jobs(points, [*prefix, "-m", EVALUATE], args.suite, args.samples, options, out, log)
    else:
        train_points(todo, prefix, log)
        evaluate_points(points, [*prefix, "-m", EVALUATE], args.suite, args.samples, log)
    rows = collect(points)
    fits = fit_variants(rows, ladder, args.bootstrap)
    report = write_outputs(rows, fits, gains(rows, fits), ladder, out)
    print(report)
    print(f"wrote {out / 'points.csv'}, {out / 'fits.json'}, {out / 'report.md'} and plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
