"""The ablation's backbone axis (tools/ablate.py --backbones dense sparse): does the copy head buy
as much on a sparse (mixture-of-experts) model as on a dense one of the same active parameters?

`sparse` is the same model with every MLP a mixture of SPARSE_EXPERTS experts of width
ffn_hidden_size / SPARSE_TOP_K, each token routed to SPARSE_TOP_K of them (the top-k weights
renormalised). A token then multiplies exactly the dense MLP's matrices' worth of expert weights
(top_k x F / top_k = F), so active parameters equal the dense model's but for the router (E x D a
layer, about 0.2% at the quickstart size) while the total grows E / top_k-fold in the MLPs. Why
this and not top-1 of the dense width (normalize=false, Switch): a top-1 expert's output is scaled
by its raw softmax probability (about 1/E at initialisation), so the MLP branch starts E times
weaker than the dense one and the two arms would differ in more than routing; renormalised top-2
keeps the branch's scale (weights sum to 1) and gives the router a gradient through the split
between the two experts (the fine-grained experts of DeepSeekMoE and Qwen3-MoE).

This module gives the overrides, each run's routing and copy share over steps (from metrics.jsonl
train records: `moe.max_load`, the busiest expert's tokens over the mean, and `copy_share`), and the
report's sections: the copy head's gain under each backbone with its paired differences across
seeds, the difference of the gains, and expert load balance.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from cplm_dist.config import load_config
from cplm_dist.errors import UsageError
from cplm_dist.experiments.paired import paired_differences, spread, won

SPARSE_EXPERTS, SPARSE_TOP_K = 8, 2
BACKBONES = ("dense", "sparse")


def backbone_overrides(backbone: str, base_config: str, overrides: list[str]) -> list[str]:
    """The model.moe overrides of `backbone` on the model `overrides` give (dense: none); sparse
    needs ffn_hidden_size divisible by SPARSE_TOP_K (a usage error otherwise)."""
    if backbone == "dense":
        return []
    ffn = load_config(base_config, overrides).model.ffn_hidden_size
    if ffn % SPARSE_TOP_K:
        raise UsageError(f"--backbones sparse: model.ffn_hidden_size={ffn} must divide by top_k {SPARSE_TOP_K} "
                         "(experts of width ffn / top_k keep the active parameters the dense model's)")
    return [f"model.moe.num_experts={SPARSE_EXPERTS}", f"model.moe.top_k={SPARSE_TOP_K}",
            f"model.moe.ffn_hidden_size={ffn // SPARSE_TOP_K}"]


def parameters(base_config: str, overrides: list[str]) -> dict[str, int]:
    """{"total", "active"} of the run's model (cplm_dist.model.counting)."""
    from cplm_dist.model.counting import active_parameters, parameter_count

    cfg = load_config(base_config, overrides)
    return {"total": parameter_count(cfg)["total"], "active": active_parameters(cfg)}


def over_steps(metrics: Path) -> dict[str, list]:
    """[(step, value)] of `copy_share` and (a sparse run) `moe.max_load` from a run's train records."""
    from cplm_dist.training.run_log import read_metrics

    train = read_metrics(metrics)
    steps = sorted(train)
    return {"copy_share": [(s, train[s]["copy_share"]) for s in steps if train[s].get("copy_share") is not None],
            "max_load": [(s, train[s]["moe"]["max_load"]) for s in steps if "max_load" in (train[s].get("moe") or {})]}


def backbone_effect(runs: list[dict], arms, variants: list[str], metrics: dict) -> str:
    """Per arm and copy variant: the copy head's gain (variant minus copy off) under each backbone,
    mean [min, max] over seeds and the seeds it won; then, per size and optimizer, the gain under
    sparse minus the gain under dense, paired by seed (negative on valid loss: the copy head helps
    the sparse model more)."""

    head = "| arm | backbone | variant | seeds | " + " | ".join(f"{m} gain" for m in metrics) + " |"
    rows = [head, "|---" * (4 + len(metrics)) + "|"]
    gains = {}  # (size, optimizer, backbone, variant, metric) -> {seed: gain}
    for arm in arms:
        for variant in variants:
            if variant == "off":
                continue
            cells, n = [], 0
            for name, metric in metrics.items():
                d = paired_differences(runs, arm.label, variant, metric)
                seeds = sorted(r["seed"] for r in runs if (r["size"], r["variant"]) == (arm.label, variant))
                gains[(arm.size, arm.optimizer, arm.backbone, variant, name)] = dict(zip(seeds, d))
                n = max(n, len(d))
                cells.append(f"{spread(d)}, won {won(name, d)}/{len(d)}" if d else "-")
            if n:
                rows.append(f"| {arm.label} | {arm.backbone} | {variant} | {n} | " + " | ".join(cells) + " |")
    diff = ["", "The gain under sparse minus the gain under dense, paired by seed (mean [min, max], 90% t-interval):", "",
            "| size | optimizer | variant | " + " | ".join(metrics) + " |", "|---" * (3 + len(metrics)) + "|"]
    for (size, opt, backbone, variant, name), by_seed in gains.items():
        if backbone != "sparse" or name != next(iter(metrics)):
            continue
        cells = []
        for metric in metrics:
            sparse, dense = gains[(size, opt, "sparse", variant, metric)], gains.get((size, opt, "dense", variant, metric), {})
            d = [sparse[s] - dense[s] for s in sparse if s in dense]
            cells.append(spread(d) if d else "-")
        diff.append(f"| {size} | {opt} | {variant} | " + " | ".join(cells) + " |")
    return ("The copy head's gain (copy on minus copy off; valid loss: lower is better, a win is lower by more than "
            "0.01 nats; suite: higher by more than 0.01) under each backbone: mean [min, max] over seeds and the 90% "
            "Student-t interval of the mean of the paired differences.\n\n"
            + "\n".join(rows) + ("\n" + "\n".join(diff) if len(diff) > 5 else ""))


def _at(curve: list, fraction: float) -> float | None:
    """The value of a [(step, value)] curve at `fraction` of its records (0: first, 1: last)."""
    return curve[min(len(curve) - 1, round(fraction * (len(curve) - 1)))][1] if curve else None


def routing_table(runs: list[dict]) -> str:
    """Per arm and variant (means over seeds): parameters total / active, expert load (max/mean of
    the sparse runs, first / middle / last train record) and the copy share at the same records."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["size"], r["variant"]), []).append(r)
    rows = ["| arm | variant | parameters total / active | max/mean load: first, middle, last record | "
            "copy share: first, middle, last record |", "|---|---|---|---|---|"]

    def cells(rs, key):
        picks = [[_at(r["over_steps"][key], f) for r in rs] for f in (0, 0.5, 1)]
        return ", ".join(f"{statistics.mean(p):.3f}" for p in picks) if all(p and None not in p for p in picks) else "-"

    for (arm, variant), rs in groups.items():
        n = rs[0].get("parameters") or {}
        size = f"{n['total'] / 1e6:.2f}M / {n['active'] / 1e6:.2f}M" if n else "-"
        rows.append(f"| {arm} | {variant} | {size} | {cells(rs, 'max_load')} | {cells(rs, 'copy_share')} |")
    return ("Means over seeds. Load: the busiest expert's routed tokens over the mean, averaged over the sparse layers "
            "and the records' window (1 = balanced, 8 = one expert takes all); copy share: the mixture's weight on the "
            "copy head.\n\n" + "\n".join(rows))


def routing_plot(runs: list[dict], out: Path) -> None:
    """routing.png: max/mean expert load (sparse runs) and the copy share (copy-on runs) against
    steps, one line an arm and variant, the mean over its seeds at each record."""
    from cplm_dist.plotting import figure, lines

    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(f"{r['size']}-{r['variant']}", []).append(r)
    curves = {}
    for name, rs in groups.items():
        for key, what in (("max_load", "load"), ("copy_share", "copy share")):
            by_step: dict[int, list[float]] = {}
            for r in rs:
                for step, value in r["over_steps"][key]:
                    by_step.setdefault(step, []).append(value)
            if any(v for values in by_step.values() for v in values):  # not a copy-off run's zeros
                curves[f"{name} {what}"] = [(step, statistics.mean(v)) for step, v in sorted(by_step.items())]
    with figure(out / "routing.png", size=(6, 4)) as ax:
        lines(ax, curves, xlabel="step", ylabel="max/mean load; copy share", title="expert load and copy share over steps")
