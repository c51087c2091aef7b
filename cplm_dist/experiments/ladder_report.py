"""A scaling ladder's results: a power-law fit of loss against compute (or, `Ladder.axis`, active
or total parameters: a sparse ladder's two sizes) per variant with bootstrap intervals over seeds,
the copy head's gain over copy off (measured at each size, and extrapolated by the fits to the
shipped 1.7B-70B shapes, with the ladder's model.moe when it is sparse, marked as such), and what
the ladder writes:
<out>/points.csv, <out>/fits.json, <out>/report.md and PNGs (loss against compute with the fits;
the copy gain).
"""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

from cplm_dist.config import load_config
from cplm_dist.experiments.ladder import AXES, Ladder
from cplm_dist.experiments.scaling import bootstrap, fit_power_law, interval, token_budget, training_flops, with_overrides
from cplm_dist.model.counting import active_parameters, parameter_count

AXIS_NAMES = {"flops": "training FLOPs", "active": "active parameters", "total": "total parameters"}

EXTRAPOLATE = {"1.7B": "cplm-1.7b", "7B": "cplm-7b", "70B": "cplm-70b"}  # shipped shapes the gain is extrapolated to


def extrapolation_targets(ladder: Ladder) -> dict[str, float]:
    """Each EXTRAPOLATE shape's value on the ladder's axis: its training FLOPs at the ladder's tokens
    a parameter, or its active or total parameters; the shape takes the ladder's backbone and, when
    the ladder is sparse, its model.moe (expert width null: the shape's own MLP width)."""
    base = load_config(ladder.base_config, ladder.overrides)
    targets = {}
    for label, name in EXTRAPOLATE.items():
        cfg = with_overrides(load_config(name), [f"model.arch={base.model.arch}"])
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe=base.model.moe))
        n = parameter_count(cfg)["total"]
        targets[label] = {"flops": lambda: training_flops(cfg, token_budget(n, ladder.tokens_per_parameter), base.data.seq_length),
                          "active": lambda: active_parameters(cfg), "total": lambda: n}[ladder.axis]()
    return targets


def fit_variants(rows: list[dict], ladder: Ladder, resamples: int = 200) -> dict:
    """Per variant: the fit along the ladder's axis (`compute` below: FLOPs, active or total
    parameters), bootstrap intervals (`resamples` over seeds) of alpha and of the loss at each
    extrapolation target, when the ladder has 3 sizes or more."""
    targets, column = extrapolation_targets(ladder), AXES[ladder.axis]
    fits = {}
    for variant in sorted({r["variant"] for r in rows}):
        points = [{"compute": r[column], "loss": r["valid_loss"]} for r in rows if r["variant"] == variant]
        if len({p["compute"] for p in points}) < 3:
            continue
        best = fit_power_law([p["compute"] for p in points], [p["loss"] for p in points])
        samples = bootstrap(points, samples=resamples)
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


def write_outputs(rows: list[dict], fits: dict, gain: dict, ladder: Ladder, out: Path) -> str:
    """points.csv, fits.json, the plots and report.md (ladder.json, the plan, is written before training)."""
    keys = sorted({k for r in rows for k in r}, key=lambda k: (k.startswith("suite_"), k))
    with open(out / "points.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    public = {v: {k: x for k, x in fit.items() if not k.startswith("_")} for v, fit in fits.items()}
    (out / "fits.json").write_text(json.dumps({"fits": public, "gains": gain}, indent=2, default=str) + "\n")
    plots(rows, fits, gain, out, ladder.axis)
    report = write_report(rows, public, gain, ladder)
    (out / "report.md").write_text(report)
    return report


def plots(rows: list[dict], fits: dict, gain: dict, out: Path, axis: str = "flops") -> None:
    """loss_vs_compute.png (along the ladder's axis: FLOPs, active or total parameters, with the
    fits) and copy_gain.png."""
    from cplm_dist.plotting import figure

    if not rows:
        return
    column, xlabel = AXES[axis], AXIS_NAMES[axis]
    compute = sorted({r[column] for r in rows})
    with figure(out / "loss_vs_compute.png") as ax:
        for variant in sorted({r["variant"] for r in rows}):
            mine = [r for r in rows if r["variant"] == variant]
            line = ax.scatter([r[column] for r in mine], [r["valid_loss"] for r in mine], label=variant, s=14)
            if variant in fits:
                xs = [compute[0] * (compute[-1] / compute[0]) ** (i / 50) for i in range(51)]
                ax.plot(xs, [fits[variant]["E"] + fits[variant]["A"] * x ** -fits[variant]["alpha"] for x in xs],
                        color=line.get_facecolor()[0], lw=1)
        ax.set(xscale="log", xlabel=xlabel, ylabel="validation loss", title=f"loss against {xlabel} (fits: E + A x^-alpha)")
        ax.legend()
    if not any(entry["measured"] for entry in gain.values()):
        return  # no copy-off point to compare with
    with figure(out / "copy_gain.png") as ax:
        by_size = {r["parameters"]: r[column] for r in rows}
        for variant, entry in gain.items():
            ax.plot([by_size[n] for n in entry["measured"]], list(entry["measured"].values()), marker="o", label=f"{variant} (measured)")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set(xscale="log", xlabel=xlabel, ylabel="copy-off loss - variant loss", title="the copy head's gain")
        ax.legend()


def write_report(rows: list[dict], fits: dict, gain: dict, ladder: Ladder) -> str:
    lines = ["# Scaling: copy on against copy off", "",
             f"Ladder: {len({r['parameters'] for r in rows})} sizes x variants {list(ladder.variants)} x seeds {list(ladder.seeds)}, "
             f"{ladder.tokens_per_parameter:g} tokens a parameter, aspect D/L {ladder.aspect:g}, heads of {ladder.head_dim}; "
             f"base `{ladder.base_config}` {' '.join(ladder.overrides)}. Compute is training FLOPs (flops_per_token x tokens, "
             f"a sparse point's on its active matrices); the fits run along {AXIS_NAMES[ladder.axis]} (--axis {ladder.axis}).", "",
             "| variant | parameters | total / active | layers x hidden | tokens | FLOPs | validation loss (mean over seeds) |",
             "|---|---|---|---|---|---|---|"]
    groups = {}
    for r in rows:
        groups.setdefault((r["variant"], r["parameters"]), []).append(r)
    for (variant, n), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        losses = [r["valid_loss"] for r in rs]
        both = (f"{rs[0]['total_parameters'] / 1e6:.2f}M / {rs[0]['active_parameters'] / 1e6:.2f}M"
                if rs[0].get("active_parameters") else "-")
        lines.append(f"| {variant} | {n / 1e6:.2f}M | {both} | {rs[0]['layers']} x {rs[0]['hidden']} | {rs[0]['tokens']:,} | "
                     f"{rs[0]['flops']:.3g} | {sum(losses) / len(losses):.4f}" + (f" ({min(losses):.4f}-{max(losses):.4f})" if len(losses) > 1 else "") + " |")
    lines += ["", f"## Fits: L(x) = E + A x^-alpha, x the {AXIS_NAMES[ladder.axis]}", ""]
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
            lines.append(f"  - EXTRAPOLATION to {label} ({e['compute']:.3g} {AXIS_NAMES[ladder.axis]}, far beyond the largest measured point): "
                         f"gain {e['gain']:+.4f} [90% interval {lo:+.4f}, {hi:+.4f}]")
    lines += ["", "Extrapolated figures come from the fits alone: a small ladder says little about 1.7B-70B, and an "
              "interval that spans zero means the ladder cannot tell.", ""]
    return "\n".join(lines)
