"""Curves of runs side by side from their metrics.jsonl (tools/plot_runs.py): per-source training
loss and copy share, the live bottleneck (train.diagnostics_interval: the ratio of the gradient
reaching the hidden states through the copy head to that through the LM head, and the LM head's
suppressed fraction), and the in-loop suite's accuracy (train.eval_tasks).

    curves = run_curves({"copy on": "runs/a", "copy off": "runs/b"})
    plot_curves(curves, "docs/ablation/watching.png")
"""

from __future__ import annotations

import json
from pathlib import Path

PANELS = ("train loss by source", "copy share by source", "copy / LM gradient at h", "suppressed fraction",
          "in-loop accuracy")


def _records(run: Path) -> list[dict]:
    path = Path(run) / "logs" / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: give run directories (their train.out_dir)")
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
    return out


def _last_per_step(records: list[dict], event: str) -> list[dict]:
    by_step = {r["step"]: r for r in records if r.get("event") == event and "step" in r}  # a resume's later record wins
    return [by_step[s] for s in sorted(by_step)]


def run_curves(runs: dict[str, str | Path]) -> dict[str, dict[str, list[tuple]]]:
    """{panel: {"<run> <series>": [(step, value)]}} of PANELS for every run."""
    curves: dict[str, dict[str, list[tuple]]] = {p: {} for p in PANELS}
    for label, run in runs.items():
        records = _records(Path(run))
        for r in _last_per_step(records, "train"):
            for source, figures in r.get("sources", {}).items():
                curves["train loss by source"].setdefault(f"{label} {source}", []).append((r["step"], figures["loss"]))
                curves["copy share by source"].setdefault(f"{label} {source}", []).append((r["step"], figures["copy_share"]))
        for r in _last_per_step(records, "diagnostics"):
            curves["copy / LM gradient at h"].setdefault(label, []).append((r["step"], r["copy_to_lm_ratio"]))
            curves["suppressed fraction"].setdefault(label, []).append((r["step"], r["suppressed_fraction"]))
        for r in _last_per_step(records, "eval_tasks"):
            for task, rows in r["tasks"].items():
                mean = sum(f["accuracy"] for f in rows.values()) / len(rows)
                curves["in-loop accuracy"].setdefault(f"{label} {task}", []).append((r["step"], mean))
    return curves


def plot_curves(curves: dict[str, dict[str, list[tuple]]], path: str | Path) -> list[str]:
    """The panels that have data, side by side in one PNG; returns their names."""
    from cplm_dist.plotting import figure, lines

    panels = [p for p in PANELS if any(curves[p].values())]
    if not panels:
        raise ValueError("the runs have no per-source, diagnostics or in-loop records to plot")
    with figure(path, ncols=len(panels), size=(4.2 * len(panels), 3.6)) as axes:
        for ax, panel in zip(axes if len(panels) > 1 else (axes,), panels):
            lines(ax, curves[panel], xlabel="step", title=panel)
    return panels
