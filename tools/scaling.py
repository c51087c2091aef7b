"""Scaling ladders for copy on / off: plan sizes and token budgets, run every point (locally one
after another, or each as a Slurm job through launch/submit.sh), fit loss against compute per
variant, and report the copy head's gain, extrapolated to larger models and marked as such.

    python tools/scaling.py --params 1e6 8e6 --points 4 --variants off gate --seeds 1 2
    python tools/scaling.py --params 1e6 8e6 --points 4 model.arch=gpt2 --out runs/scaling-gpt2
    python tools/scaling.py --base-config configs/runs/cplm-135m.yaml --params 5e7 1e9 --points 5 \\
        --tokens-per-parameter 20 --slurm "--nodes 1 --gpus-per-node 8 --time 12:00:00 --partition gpu"

Sizes: --points log-spaced parameter targets in [--params MIN MAX] (or --sizes T1 T2 ...), each
turned into depth and width by cplm_dist.experiments.scaling.shape_for (a fixed --aspect D / L, heads of
--head-dim). Tokens: --tokens-per-parameter x the exact parameter count, in whole steps of the
base config's global batch x sequence length. Variants: copy off, gate, joint, sentinel, or
NAME=override,override (any config override). Every point trains with --resume auto into
<out>/points/<variant>-<size>-seed<k>; a point whose last checkpoint is written is not run again,
so re-running the command continues an interrupted ladder. Writes <out>/ladder.json (the plan),
<out>/points.csv (parameters, tokens, FLOPs, validation loss, suite scores a point),
<out>/fits.json, <out>/report.md and PNGs (loss against compute with the fits; the copy gain).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shlex
import subprocess
import sys
import time
from pathlib import Path

from cplm_dist.config import load_config
from cplm_dist.config.cli import exit_on_usage_error
from cplm_dist.errors import UsageError
from cplm_dist.experiments.runs import VARIANTS, ensure_quickstart_data, finished, mean_score, run
from cplm_dist.experiments.scaling import (bootstrap, fit_power_law, interval, shape_for, token_budget, training_flops,
                                           with_overrides)
from cplm_dist.model.counting import parameter_count

REPO = Path(__file__).resolve().parent.parent  # launch/submit.sh and tools/evaluate.py of this checkout

EXTRAPOLATE = {"1.7B": "cplm-1.7b", "7B": "cplm-7b", "70B": "cplm-70b"}  # shipped shapes the gain is extrapolated to


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
    p.add_argument("--slurm", metavar="SUBMIT_OPTIONS", help="submit each point as a Slurm job: launch/submit.sh options")
    p.add_argument("--stop-after", type=int, help="stop after training this many points (the rest on the next run)")
    p.add_argument("--bootstrap", type=int, default=200, help="resamples over seeds for the intervals")
    p.add_argument("overrides", nargs="*", help="config overrides for every point, e.g. model.arch=gpt2")
    return p


def variant_overrides(spec: str) -> tuple[str, list[str]]:
    if "=" in spec.split(",")[0] and spec.split("=", 1)[0] not in VARIANTS:
        name, rest = spec.split("=", 1)
        return name, [o for o in rest.split(",") if o]
    if spec not in VARIANTS:
        raise UsageError(f"--variants {spec}: not one of {sorted(VARIANTS)} nor NAME=override,override")
    return spec, VARIANTS[spec]


def plan_ladder(args) -> list[dict]:
    """Every point: variant, size, seed, shape, tokens, steps and the training overrides."""
    base = load_config(args.base_config, args.overrides)
    if args.sizes:
        targets = sorted(args.sizes)
    elif args.params:
        lo, hi = sorted(args.params)
        targets = [lo * (hi / lo) ** (i / max(1, args.points - 1)) for i in range(args.points)]
    else:
        raise UsageError("give the ladder's sizes: --params MIN MAX [--points N] or --sizes T1 T2 ...")
    per_step = base.train.global_batch_size * base.data.seq_length
    points = []
    for target in targets:
        shape = shape_for(base, target, aspect=args.aspect, head_dim=args.head_dim)
        tokens = token_budget(shape.parameters, args.tokens_per_parameter)
        steps = max(1, math.ceil(tokens / per_step))
        for spec in args.variants:
            name, overrides = variant_overrides(spec)
            for seed in args.seeds:
                point = f"{name}-{shape.label}-seed{seed}"
                run_dir = Path(args.out) / "points" / point
                train = [*args.overrides, *shape.overrides, *overrides, f"seed={seed}", f"data.seed={seed}",
                         f"train.train_steps={steps}", f"optim.warmup_steps={max(1, steps // 10)}",
                         f"train.eval_interval={steps}", f"train.save_interval={steps}",
                         f"train.log_interval={max(1, steps // 20)}", f"train.out_dir={run_dir}"]
                cfg = load_config(args.base_config, train)  # a bad point fails here, before anything runs
                points.append({"point": point, "variant": name, "target": target, "seed": seed, "layers": shape.layers,
                               "hidden": shape.hidden, "parameters": shape.parameters, "steps": steps,
                               "tokens": steps * per_step, "flops": training_flops(cfg, steps * per_step, cfg.data.seq_length),
                               "run_dir": str(run_dir), "train_args": ["--config", args.base_config, *train]})
    return points


def train_points(points: list[dict], args, log: Path) -> None:
    todo = [p for p in points if not finished(Path(p["run_dir"]), p["steps"])]
    if args.stop_after is not None:
        todo = todo[: args.stop_after]
    if args.slurm:
        return submit_and_wait(todo, args, log)
    py = shlex.split(args.launcher) or [sys.executable]
    for p in todo:
        print(f"train {p['point']} ({p['parameters'] / 1e6:.2f}M parameters, {p['tokens']:,} tokens) ...", flush=True)
        run([*py, "-m", "cplm_dist.train", *p["train_args"], "--resume", "auto"], log)


def submit_and_wait(todo: list[dict], args, log: Path) -> None:
    """One Slurm job a point (launch/submit.sh, --resume auto), then wait until every one has
    written its last checkpoint; a job that leaves the queue before that is an error."""
    jobs = {}
    for p in todo:
        cmd = [str(REPO / "launch" / "submit.sh"), *shlex.split(args.slurm), "--job-name", f"scaling-{p['point']}",
               "--log-dir", str(Path(args.out) / "slurm"), "--", *p["train_args"], "--resume", "auto"]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        with log.open("a") as f:
            f.write(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise UsageError(f"submitting {p['point']} failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
        jobs[proc.stdout.split()[-1]] = p
        print(f"submitted {p['point']} as job {proc.stdout.split()[-1]}", flush=True)
    while jobs:
        time.sleep(2)
        queued = set(subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split())
        for job, p in list(jobs.items()):
            if finished(Path(p["run_dir"]), p["steps"]):
                del jobs[job]
            elif job not in queued:
                raise UsageError(f"Slurm job {job} ({p['point']}) ended before its last checkpoint: see {Path(args.out) / 'slurm'}")


def evaluate_points(points: list[dict], args, log: Path) -> None:
    if not args.suite or args.suite == ["none"]:
        return
    py = shlex.split(args.launcher) or [sys.executable]
    for p in points:
        out = Path(p["run_dir"]) / "eval"
        if finished(Path(p["run_dir"]), p["steps"]) and not (out / "eval.json").exists():
            run([*py, str(REPO / "tools" / "evaluate.py"), "--checkpoint", p["run_dir"], "--tasks", *args.suite,
                 "--samples", str(args.samples), "--valid-batches", "0", "--out", str(out)], log)


def collect(points: list[dict]) -> list[dict]:
    """One row a finished point: the plan's figures, its final validation loss, suite scores."""
    from cplm_dist.train.run_log import read_metrics

    rows = []
    for p in points:
        run_dir = Path(p["run_dir"])
        if not finished(run_dir, p["steps"]):
            continue
        valid = read_metrics(run_dir / "logs" / "metrics.jsonl", "valid")
        row = {k: p[k] for k in ("point", "variant", "seed", "layers", "hidden", "parameters", "steps", "tokens", "flops")}
        row["valid_loss"] = valid[max(valid)]["loss"]
        evaluation = run_dir / "eval" / "eval.json"
        if evaluation.exists():
            row.update({f"suite_{t}": mean_score(r) for t, r in json.loads(evaluation.read_text())["tasks"].items()})
        rows.append(row)
    return rows


def fit_variants(rows: list[dict], args) -> dict:
    """Per variant: the fit, bootstrap intervals of alpha and of the loss at each extrapolation
    target's compute, when the ladder has 3 sizes or more."""
    base = load_config(args.base_config, args.overrides)
    targets = {}
    for label, name in EXTRAPOLATE.items():
        cfg = with_overrides(load_config(name), [f"model.arch={base.model.arch}"])
        n = parameter_count(cfg)["total"]
        targets[label] = training_flops(cfg, token_budget(n, args.tokens_per_parameter), base.data.seq_length)
    fits = {}
    for variant in sorted({r["variant"] for r in rows}):
        points = [{"compute": r["flops"], "loss": r["valid_loss"]} for r in rows if r["variant"] == variant]
        if len({p["compute"] for p in points}) < 3:
            continue
        best = fit_power_law([p["compute"] for p in points], [p["loss"] for p in points])
        samples = bootstrap(points, samples=args.bootstrap)
        fits[variant] = {"E": best.E, "A": best.A, "alpha": float(best.alpha), "rms_log_error": best.rms_log_error,
                         "alpha_interval": interval([f.alpha for f in samples]),
                         "max_compute": max(p["compute"] for p in points),
                         "extrapolated": {label: {"compute": c, "loss": best(c), "interval": interval([f(c) for f in samples])}
                                          for label, c in targets.items()},
                         "_samples": samples}
    return fits


def gains(rows: list[dict], fits: dict) -> dict:
    """Per copy variant: the measured gain over copy off at each size (mean over seeds, off loss
    minus the variant's) and, with both fits, the extrapolated gain with its interval."""
    out = {}
    off = {r["parameters"]: [] for r in rows if r["variant"] == "off"}
    for r in rows:
        if r["variant"] == "off":
            off[r["parameters"]].append(r["valid_loss"])
    for variant in sorted({r["variant"] for r in rows} - {"off"}):
        sizes = {}
        for r in rows:
            if r["variant"] == variant and off.get(r["parameters"]):
                sizes.setdefault(r["parameters"], []).append(r["valid_loss"])
        measured = {n: sum(off[n]) / len(off[n]) - sum(v) / len(v) for n, v in sorted(sizes.items())}
        entry = {"measured": measured, "extrapolated": {}}
        if variant in fits and "off" in fits:
            for label, e in fits[variant]["extrapolated"].items():
                c = e["compute"]
                diffs = [a(c) - b(c) for a, b in zip(fits["off"]["_samples"], fits[variant]["_samples"])]
                entry["extrapolated"][label] = {"compute": c, "gain": fits["off"]["extrapolated"][label]["loss"] - e["loss"],
                                                "interval": interval(diffs)}
        out[variant] = entry
    return out


def write_outputs(rows: list[dict], fits: dict, gain: dict, args, out: Path) -> str:
    """points.csv, fits.json, the plots and report.md (ladder.json, the plan, is written before training)."""
    keys = sorted({k for r in rows for k in r}, key=lambda k: (k.startswith("suite_"), k))
    with open(out / "points.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    public = {v: {k: x for k, x in fit.items() if not k.startswith("_")} for v, fit in fits.items()}
    (out / "fits.json").write_text(json.dumps({"fits": public, "gains": gain}, indent=2, default=str) + "\n")
    plots(rows, fits, gain, out)
    report = write_report(rows, public, gain, args)
    (out / "report.md").write_text(report)
    return report


def plots(rows: list[dict], fits: dict, gain: dict, out: Path) -> None:
    from cplm_dist.profiling.plotting import figure

    if not rows:
        return
    compute = sorted({r["flops"] for r in rows})
    with figure(out / "loss_vs_compute.png") as ax:
        for variant in sorted({r["variant"] for r in rows}):
            mine = [r for r in rows if r["variant"] == variant]
            line = ax.scatter([r["flops"] for r in mine], [r["valid_loss"] for r in mine], label=variant, s=14)
            if variant in fits:
                xs = [compute[0] * (compute[-1] / compute[0]) ** (i / 50) for i in range(51)]
                ax.plot(xs, [fits[variant]["E"] + fits[variant]["A"] * x ** -fits[variant]["alpha"] for x in xs],
                        color=line.get_facecolor()[0], lw=1)
        ax.set(xscale="log", xlabel="training FLOPs", ylabel="validation loss", title="loss against compute (fits: E + A C^-alpha)")
        ax.legend()
    if not any(entry["measured"] for entry in gain.values()):
        return  # no copy-off point to compare with
    with figure(out / "copy_gain.png") as ax:
        by_size = {r["parameters"]: r["flops"] for r in rows}
        for variant, entry in gain.items():
            ax.plot([by_size[n] for n in entry["measured"]], list(entry["measured"].values()), marker="o", label=f"{variant} (measured)")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set(xscale="log", xlabel="training FLOPs", ylabel="copy-off loss - variant loss", title="the copy head's gain")
        ax.legend()


def write_report(rows: list[dict], fits: dict, gain: dict, args) -> str:
    lines = ["# Scaling: copy on against copy off", "",
             f"Ladder: {len({r['parameters'] for r in rows})} sizes x variants {args.variants} x seeds {args.seeds}, "
             f"{args.tokens_per_parameter:g} tokens a parameter, aspect D/L {args.aspect:g}, heads of {args.head_dim}; "
             f"base `{args.base_config}` {' '.join(args.overrides)}. Compute is training FLOPs (flops_per_token x tokens).", "",
             "| variant | parameters | layers x hidden | tokens | FLOPs | validation loss (mean over seeds) |", "|---|---|---|---|---|---|"]
    groups = {}
    for r in rows:
        groups.setdefault((r["variant"], r["parameters"]), []).append(r)
    for (variant, n), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        losses = [r["valid_loss"] for r in rs]
        lines.append(f"| {variant} | {n / 1e6:.2f}M | {rs[0]['layers']} x {rs[0]['hidden']} | {rs[0]['tokens']:,} | "
                     f"{rs[0]['flops']:.3g} | {sum(losses) / len(losses):.4f}" + (f" ({min(losses):.4f}-{max(losses):.4f})" if len(losses) > 1 else "") + " |")
    lines += ["", "## Fits: L(C) = E + A C^-alpha", ""]
    if fits:
        lines += ["| variant | E | A | alpha [90% interval over seeds] | rms log error |", "|---|---|---|---|---|"]
        for v, f in fits.items():
            lo, hi = f["alpha_interval"]
            lines.append(f"| {v} | {f['E']:.4f} | {f['A']:.4g} | {f['alpha']:.4f} [{lo:.4f}, {hi:.4f}] | {f['rms_log_error']:.4f} |")
    else:
        lines.append("Fewer than 3 sizes per variant: no fit.")
    lines += ["", "## The copy head's gain (copy-off loss minus the variant's; positive: the copy head helps)", ""]
    for variant, entry in gain.items():
        measured = ", ".join(f"{n / 1e6:.2f}M: {g:+.4f}" for n, g in entry["measured"].items())
        helps = [n for n, g in entry["measured"].items() if g > 0]
        lines.append(f"- {variant}, measured: {measured}. It helps at {len(helps)} of {len(entry['measured'])} sizes"
                     + ("" if len(helps) == len(entry["measured"]) else
                        f"; it does not at {', '.join(f'{n / 1e6:.2f}M' for n in entry['measured'] if n not in helps)}") + ".")
        for label, e in entry["extrapolated"].items():
            lo, hi = e["interval"]
            lines.append(f"  - EXTRAPOLATION to {label} ({e['compute']:.3g} FLOPs, far beyond the largest measured point): "
                         f"gain {e['gain']:+.4f} [90% interval {lo:+.4f}, {hi:+.4f}]")
    lines += ["", "Extrapolated figures come from the fits alone: a small ladder says little about 1.7B-70B, and an "
              "interval that spans zero means the ladder cannot tell.", ""]
    return "\n".join(lines)


@exit_on_usage_error
def main(argv=None) -> int:
    args = parser().parse_intermixed_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "scaling.log"
    ensure_quickstart_data(load_config(args.base_config, args.overrides), log)
    points = plan_ladder(args)
    (out / "ladder.json").write_text(json.dumps(points, indent=2) + "\n")
    print(f"{len(points)} points; {sum(finished(Path(p['run_dir']), p['steps']) for p in points)} already finished", flush=True)
    train_points(points, args, log)
    evaluate_points(points, args, log)
    rows = collect(points)
    fits = fit_variants(rows, args)
    report = write_outputs(rows, fits, gains(rows, fits), args, out)
    print(report)
    print(f"wrote {out / 'points.csv'}, {out / 'fits.json'}, {out / 'report.md'} and plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
