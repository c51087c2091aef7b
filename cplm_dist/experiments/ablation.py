"""The copy-head ablation (tools/ablate.py is its command line): matched training runs, copy off
against each mix, at several sizes (optimizers, dense or sparse backbones) with the same seeds,
data order and token budget; each evaluated on the copy / retrieval suite and the gradient
bottleneck; then the paired differences (copy on minus copy off, per seed and across seeds) in a
report with plots. The sparse backbone and its report sections are ablation_sparse.py's.

    ablation = Ablation("configs/quickstart.yaml", sizes=["tiny"], variants=["off", "gate"], seeds=[1, 2])
    runs = run_ablation(ablation, train=[sys.executable], evaluate=[...], bottleneck=[...], log=log)
    write_report(runs, ablation, out)

A finished run (its last checkpoint written) is not trained again, nor evaluated again once its
eval.json and bottleneck.json exist, so an interrupted ablation continues where it stopped.
`skip` leaves out an evaluation ("suite", "bottleneck") where time is short; the report then
leaves its columns empty.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from cplm_dist.config import load_config
from cplm_dist.experiments.ablation_sparse import backbone_effect, backbone_overrides, over_steps, parameters, routing_plot, routing_table
from cplm_dist.experiments.paired import MARGIN, paired_differences, won
from cplm_dist.experiments.runs import COPY_TASKS, VARIANTS, finished, mean_score, run

SIZES = {  # name -> overrides on the base config
    "base": [],
    "tiny": [],
    "small": ["model.num_layers=4", "model.hidden_size=256", "model.ffn_hidden_size=512"],
    # about 10x the quickstart's parameters (8.1M against 0.83M; 22x outside the embedding)
    "medium": ["model.num_layers=4", "model.hidden_size=384", "model.ffn_hidden_size=1024"],
}
OPTIMIZERS = {"adamw": ["optim.name=adamw"], "muon": ["optim.name=muon"]}  # name -> overrides
LR_FIELD = {"adamw": "optim.lr", "muon": "optim.muon.lr"}  # the learning rate a grid picks per optimizer


class Arm(NamedTuple):
    """One size x optimizer x backbone of an ablation; `label` names its runs (<label>-<variant>-seed<k>)."""

    label: str
    size: str
    optimizer: str
    backbone: str = "dense"


@dataclass(frozen=True)
class Ablation:
    """What is compared: the base config and overrides every run shares, the SIZES, the VARIANTS
    and seeds, steps a run, suite samples a setting, the directory the runs go in, the optimizers
    and backbones (dense; sparse: ablation_sparse.py), and the evaluations skipped."""

    base_config: str
    sizes: list[str]
    variants: list[str]
    seeds: list[int] = field(default_factory=lambda: [1])
    steps: int = 200
    samples: int = 16
    overrides: list[str] = field(default_factory=list)
    out: Path = Path("runs/ablation")
    optimizers: list[str] = field(default_factory=lambda: ["adamw"])
    learning_rates: dict[str, float] = field(default_factory=dict)  # optimizer -> its LR_FIELD (else the config's)
    backbones: list[str] = field(default_factory=lambda: ["dense"])
    skip: tuple[str, ...] = ()  # evaluations left out: "suite", "bottleneck"

    def arms(self) -> list[Arm]:
        """Every size x optimizer x backbone: the label is the size, then the optimizer unless AdamW
        is the only one, then the backbone unless dense is the only one (the runs' names before
        either was an axis)."""
        opt_alone, dense_alone = self.optimizers == ["adamw"], self.backbones == ["dense"]
        return [Arm(size + ("" if opt_alone else f"-{opt}") + ("" if dense_alone else f"-{bb}"), size, opt, bb)
                for size in self.sizes for opt in self.optimizers for bb in self.backbones]


def run_overrides(ablation: Ablation, size: str, variant: str, seed: int, optimizer: str = "adamw",
                  label: str | None = None, backbone: str = "dense") -> list[str]:
    """The training overrides of one run, its config loaded: a bad one fails before it trains."""
    run_dir = Path(ablation.out) / f"{label or size}-{variant}-seed{seed}"
    steps = ablation.steps
    lr = [f"{LR_FIELD[optimizer]}={ablation.learning_rates[optimizer]}"] if optimizer in ablation.learning_rates else []
    model = [*ablation.overrides, *SIZES[size]]
    overrides = [*model, *backbone_overrides(backbone, ablation.base_config, model), *OPTIMIZERS[optimizer], *lr, *VARIANTS[variant],
                 f"seed={seed}", f"data.seed={seed}",
                 f"train.train_steps={steps}", f"train.out_dir={run_dir}", f"train.eval_interval={max(1, steps // 4)}",
                 f"train.save_interval={steps}", f"train.log_interval={max(1, steps // 20)}"]
    load_config(ablation.base_config, overrides)
    return overrides


def pick_learning_rates(ablation: Ablation, grid: dict[str, list[float]], train: list[str], log: Path) -> dict:
    """Each optimizer's learning rate, picked on its grid before the ablation: copy off at the
    first size and seed, the ablation's steps, lowest final validation loss wins (the baseline is
    tuned, the copy head takes its optimizer's rate). {optimizer: {"picked": lr, "valid_loss": {lr: loss}}};
    the runs go in <out>/lr-grid and are reused as the ablation's are."""
    from cplm_dist.training.run_log import read_metrics

    size, seed, picked = ablation.sizes[0], ablation.seeds[0], {}
    for optimizer, rates in grid.items():
        losses = {}
        for lr in rates:
            label = f"{size}-{optimizer}-lr{lr:g}"
            trial = dataclasses.replace(ablation, out=Path(ablation.out) / "lr-grid", learning_rates={optimizer: lr})
            overrides = run_overrides(trial, size, "off", seed, optimizer, label)
            run_dir = trial.out / f"{label}-off-seed{seed}"
            if not finished(run_dir, ablation.steps):
                print(f"train {run_dir.name} (learning-rate grid) ...", flush=True)
                run([*train, "-m", "cplm_dist.train", "--config", ablation.base_config, *overrides, "--resume", "auto"], log)
            valid = read_metrics(run_dir / "logs" / "metrics.jsonl", "valid")
            losses[lr] = valid[max(valid)]["loss"]
        picked[optimizer] = {"picked": min(losses, key=losses.get), "valid_loss": losses}
    return picked


def grid_table(grid: dict) -> str:
    """The learning-rate grid's final validation losses, the picked rate in bold."""
    rows = ["| optimizer | learning rate | valid loss (copy off) |", "|---|---|---|"]
    for optimizer, result in grid.items():
        for lr, loss in result["valid_loss"].items():
            mark = "**" if lr == result["picked"] else ""
            rows.append(f"| {optimizer} | {mark}{lr:g}{mark} | {loss:.4f} |")
    return "\n".join(rows)


def run_ablation(ablation: Ablation, train: list[str], evaluate: list[str], bottleneck: list[str], log: Path) -> list[dict]:
    """Train, evaluate and measure every run not done yet, in order; each run's summary. `train`
    is the prefix of `-m cplm_dist.train`, `evaluate` and `bottleneck` the evaluation and
    gradient-bottleneck commands (launcher, -m, the tool's module)."""
    runs = []
    for arm in ablation.arms():
        for variant in ablation.variants:
            for seed in ablation.seeds:
                name = f"{arm.label}-{variant}-seed{seed}"
                run_dir = Path(ablation.out) / name
                overrides = run_overrides(ablation, arm.size, variant, seed, arm.optimizer, arm.label, arm.backbone)
                if not finished(run_dir, ablation.steps):
                    print(f"train {name} ...", flush=True)
                    run([*train, "-m", "cplm_dist.train", "--config", ablation.base_config, *overrides, "--resume", "auto"], log)
                evaluation = run_dir / "eval" / "eval.json"
                if "suite" not in ablation.skip and not evaluation.exists():
                    print(f"evaluate {name} ...", flush=True)
                    run([*evaluate, "--checkpoint", str(run_dir), "--samples", str(ablation.samples),
                         "--out", str(evaluation.parent)], log)
                measured = run_dir / "eval" / "bottleneck.json"
                if "bottleneck" not in ablation.skip and not measured.exists():
                    run([*bottleneck, "--checkpoint", str(run_dir), "--json", str(measured)], log)
                runs.append({**summarise(name, arm.label, variant, seed, run_dir, evaluation, measured),
                             "optimizer": arm.optimizer, "backbone": arm.backbone,
                             "parameters": parameters(ablation.base_config, overrides)})
    return runs


def summarise(name, size, variant, seed, run_dir: Path, evaluation: Path, bottleneck: Path) -> dict:
    """One run's record (`size`: its arm's label, the size, optimizer and backbone): its final
    validation loss and curve, the copy share and expert load over steps, perplexity, suite means
    and the gradient bottleneck of its mixed (or LM-only) loss (None where skipped)."""
    from cplm_dist.training.run_log import read_metrics

    ev = json.loads(evaluation.read_text()) if evaluation.exists() else {"tasks": {}}
    bn = json.loads(bottleneck.read_text()) if bottleneck.exists() else []
    mixed = next((r for r in bn if r["loss_of"] in ("mixture", "LM head")), {})
    metrics = run_dir / "logs" / "metrics.jsonl"
    train, valid = read_metrics(metrics), read_metrics(metrics, "valid")
    return {
        "name": name, "size": size, "variant": variant, "seed": seed,
        "valid_loss": valid[max(valid)]["loss"] if valid else None,
        "valid_curve": [(train[s]["consumed_tokens"] if s in train else None, valid[s]["loss"]) for s in sorted(valid)],
        "over_steps": over_steps(metrics),
        "perplexity": (ev.get("validation") or {}).get("perplexity"),
        "suite": {task: mean_score(rows) for task, rows in ev["tasks"].items()},
        "suppressed_fraction": mixed.get("suppressed_fraction"),
        "grad_h_lm": mixed.get("grad_norm_h_via_lm_head"), "grad_h_copy": mixed.get("grad_norm_h_via_copy_head"),
    }


def write_report(runs: list[dict], ablation: Ablation, out: Path, grid: dict | None = None) -> str:
    """report.md (and the plots beside it): the learning-rate grid when one ran, the runs' table,
    copy on minus copy off per matched pair, across seeds when there are several, and the copy
    head's gain per optimizer, or per backbone with expert load and copy share, when there are
    several; its text."""
    tasks = sorted({t for r in runs for t in r["suite"]}, key=lambda t: ["induction", "mqar", "phonebook", "needle", "spamlang"].index(t))
    lines = ["# Copy head ablation", "",
             f"Base config `{ablation.base_config}`, {ablation.steps} steps per run, seeds {list(ablation.seeds)}, "
             + ("" if "suite" in ablation.skip else f"{ablation.samples} samples per suite setting, ")
             + f"optimizers {list(ablation.optimizers)}"
             + (f" (learning rates {ablation.learning_rates})" if ablation.learning_rates else "")
             + f", backbones {list(ablation.backbones)}" + (f", skipped: {', '.join(ablation.skip)}" if ablation.skip else "")
             + ". Every run of a seed sees the same data in the same order and starts from the same seed; only the "
             "copy head (and the optimizer, the backbone) differs.", "",
             *(["## Learning rates, picked on a grid first", "", grid_table(grid), ""] if grid else []),
             "| " + " | ".join(["run", "valid loss", *tasks, "LM-head gradient suppressed", "dL/dh via LM / copy"]) + " |",
             "|---" * (4 + len(tasks)) + "|"]
    for r in runs:
        bottleneck = (f"{r['suppressed_fraction']:.4f} | {r['grad_h_lm']:.3g} / {r['grad_h_copy']:.3g}"
                      if r["suppressed_fraction"] is not None else "- | -")
        lines.append("| " + " | ".join([r["name"], f"{r['valid_loss']:.4f}", *(f"{r['suite'].get(t, float('nan')):.3f}" for t in tasks),
                                        bottleneck]) + " |")
    lines += ["", *([] if "suite" in ablation.skip else ["Suite columns: mean accuracy over settings (induction, mqar, spamlang) "
                                                          "or mean exact match (phonebook, needle).", ""]),
              "## Copy on minus copy off", ""]
    verdicts, labels = [], [arm.label for arm in ablation.arms()]
    for size in labels:
        for seed in ablation.seeds:
            off = next((r for r in runs if (r["size"], r["variant"], r["seed"]) == (size, "off", seed)), None)
            if off is None:
                continue
            for r in runs:
                if (r["size"], r["seed"]) != (size, seed) or r["variant"] == "off":
                    continue
                diffs = {t: r["suite"].get(t, float("nan")) - off["suite"].get(t, float("nan")) for t in tasks}
                scored = [t for t in COPY_TASKS if t in diffs]
                wins = [t for t in scored if diffs[t] > MARGIN]
                ties = [t for t in scored if abs(diffs[t]) <= MARGIN]
                if scored:
                    verdicts.append(len(wins) == len(scored))
                lines.append(f"- {size}, seed {seed}, {r['variant']}: valid loss {r['valid_loss'] - off['valid_loss']:+.4f}"
                             + "".join(f", {t} {d:+.3f}" for t, d in diffs.items())
                             + (f" -- better than copy off by more than {MARGIN} on {len(wins)}/{len(scored)} of "
                                f"{', '.join(scored)}" + (f" (within {MARGIN}: {', '.join(ties)})" if ties else "") if scored else ""))
    if verdicts:
        lines += ["", f"Copy on beat copy off by more than {MARGIN} on all of {', '.join(COPY_TASKS)} in "
                      f"{sum(verdicts)} of {len(verdicts)} matched pairs."]
    if len(ablation.seeds) > 1:
        lines += ["", "## Across seeds", "", across_seeds(runs, labels, ablation.variants, tasks)]
    if len(ablation.optimizers) > 1:
        lines += ["", "## Does the optimizer change what the copy head buys?", "", optimizer_effect(runs, ablation, tasks)]
    if len(ablation.backbones) > 1:
        lines += ["", "## Does a sparse backbone change what the copy head buys?", "",
                  backbone_effect(runs, ablation.arms(), ablation.variants, gain_metrics(tasks)),
                  "", "## Expert load and copy share over steps", "", routing_table(runs)]
    images = {"loss": "validation loss", **({} if "suite" in ablation.skip else {"suite": "suite"}),
              **({} if "bottleneck" in ablation.skip else {"suppression": "suppression"}),
              **({"routing": "routing"} if len(ablation.backbones) > 1 else {})}
    lines += ["", " ".join(f"![{alt}]({name}.png)" for name, alt in images.items()), ""]
    (out / "report.md").write_text("\n".join(lines))
    plots(runs, tasks, out, images)
    if len(ablation.backbones) > 1:
        routing_plot(runs, out)
    return "\n".join(lines)


def gain_metrics(tasks: list[str]) -> dict:
    """{name: run -> figure} the gains are taken on: the validation loss and each copy task scored."""
    metrics = {"valid loss": lambda r: r["valid_loss"]}
    metrics.update({t: (lambda r, t=t: r["suite"].get(t, float("nan"))) for t in tasks if t in COPY_TASKS})
    return metrics


def across_seeds(runs: list[dict], sizes: list[str], variants: list[str], tasks: list[str]) -> str:
    """Copy on minus copy off per size and variant: mean [min, max] over seeds, and how many seeds
    it won (valid loss: lower by more than 0.01 nats; suite: higher by more than MARGIN)."""
    metrics = gain_metrics(tasks)
    rows = ["| size | variant | seeds | " + " | ".join(metrics) + " |", "|---" * (3 + len(metrics)) + "|"]
    for size in sizes:
        for variant in variants:
            if variant == "off":
                continue
            cells, n = [], 0
            for name, metric in metrics.items():
                d = paired_differences(runs, size, variant, metric)
                n = max(n, len(d))
                if not d:
                    cells.append("-")
                    continue
                cells.append(f"{statistics.mean(d):+.3f} [{min(d):+.3f}, {max(d):+.3f}], won {won(name, d)}/{len(d)}")
            if n:
                rows.append(f"| {size} | {variant} | {n} | " + " | ".join(cells) + " |")
    return ("Copy on minus copy off, mean [min, max] over seeds; a valid-loss win is lower by more than 0.01 "
            f"nats, a suite win higher by more than {MARGIN}.\n\n" + "\n".join(rows))


def optimizer_effect(runs: list[dict], ablation: Ablation, tasks: list[str]) -> str:
    """Per size and copy variant: the copy head's gain (copy on minus copy off, mean over seeds)
    under each optimizer, and the gradient path the copy head opens (dL/dh via the copy head over
    via the LM head), so a reader sees whether Muon widens or narrows what the copy head buys."""
    metrics = gain_metrics(tasks)
    rows = ["| size | variant | optimizer | " + " | ".join(f"{m} gain" for m in metrics)
            + " | copy / LM gradient into h | LM-head gradient suppressed |", "|---" * (5 + len(metrics)) + "|"]
    for label, size, optimizer, _ in ablation.arms():
        mine = [r for r in runs if r["size"] == label]
        for variant in ablation.variants:
            if variant == "off":
                continue
            gains = [paired_differences(runs, label, variant, metric) for metric in metrics.values()]
            on = [r for r in mine if r["variant"] == variant]
            if not on or not gains[0]:
                continue
            measured = [r for r in on if r["grad_h_lm"]]
            path = (f"{statistics.mean(r['grad_h_copy'] / r['grad_h_lm'] for r in measured):.2f} | "
                    f"{statistics.mean(r['suppressed_fraction'] for r in measured):.4f}") if measured else "- | -"
            rows.append(f"| {size} | {variant} | {optimizer} | " + " | ".join(f"{statistics.mean(g):+.3f}" for g in gains)
                        + f" | {path} |")
    return ("The copy head's gain (copy on minus copy off, mean over seeds; valid loss: lower is better) "
            "under each optimizer, with the gradient path it opens.\n\n" + "\n".join(rows))


def plots(runs: list[dict], tasks: list[str], out: Path, images=("loss", "suite", "suppression")) -> None:
    """loss.png, and suite.png and suppression.png where `images` names them (not for a skipped evaluation)."""
    from cplm_dist.plotting import figure, lines

    with figure(out / "loss.png", size=(6, 4)) as ax:
        curves = {r["name"]: [(t, v) for t, v in r["valid_curve"] if t is not None] for r in runs}
        lines(ax, curves, xlabel="tokens", ylabel="validation loss", title="validation loss against tokens")
    if "suite" in images:
        groups: dict[str, list[dict]] = {}  # size-variant -> its runs, one per seed
        for r in runs:
            groups.setdefault(f"{r['size']}-{r['variant']}", []).append(r)
        with figure(out / "suite.png", size=(max(6, 0.3 * len(tasks) * len(groups)), 4)) as ax:
            width = 0.8 / max(1, len(groups))
            for i, (name, rs) in enumerate(groups.items()):
                values = [[r["suite"].get(t, 0) for r in rs] for t in tasks]
                means = [statistics.mean(v) for v in values]
                spread = [[m - min(v) for m, v in zip(means, values)], [max(v) - m for m, v in zip(means, values)]]
                ax.bar([j + i * width for j in range(len(tasks))], means, width, yerr=spread if len(rs) > 1 else None,
                       capsize=2, label=f"{name} ({len(rs)} seed{'s' if len(rs) > 1 else ''})")
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tasks))], tasks)
            ax.set(ylabel="accuracy / exact match (mean, min-max)", title="copy and retrieval suite", ylim=(0, 1))
            ax.legend(fontsize=7)
    if "suppression" in images:
        with figure(out / "suppression.png", size=(6, 4)) as ax:
            ax.bar([r["name"] for r in runs], [r["suppressed_fraction"] or 0.0 for r in runs])
            ax.set(ylabel="suppressed fraction", title="LM-head gradient suppression", ylim=(0.8, 1.0))
            ax.tick_params(axis="x", labelrotation=60, labelsize=7)

