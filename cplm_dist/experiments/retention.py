"""The retention grid (tools/ablate.py --arms): does a recipe keep the copy head retrieving while the
loss falls? Each arm is a named set of config overrides, trained at each size and seed with the
in-loop suite (induction, mqar, spamlang) every 1/20 of the run; the report reads the curves from
metrics.jsonl, never a separate evaluation.

    grid = RetentionGrid("configs/quickstart.yaml", sizes=["tiny"], arms=arm_overrides(["gate", "detach"], ...),
                         seeds=[1, 2, 3], steps=2000)
    runs = run_grid(grid, train=[sys.executable], log=log)
    write_grid_report(runs, grid, out)

Per eval step the three fields of docs/evaluation.md ("Where the answer comes from") are
token-weighted over a task's settings: `accuracy` (the mixture), `copy_pointer_accuracy` (the copy
head alone), `copy_share` (the mix's weight on the copy side at the answers). Arms are compared with
the first arm (the reference, the default recipe) paired by seed: the final validation loss, the
final accuracy and the retained fraction (final over the run's best), each as mean [min, max] and a
90% t-interval (cplm_dist.experiments.paired). Runs are named <size>-<arm>-seed<k>; a finished run
is reused, so a stopped grid continues.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from cplm_dist.config import load_config
from cplm_dist.errors import UsageError
from cplm_dist.experiments.paired import MARGIN, paired_differences, spread, t_interval
from cplm_dist.experiments.runs import COPY_TASKS, finished, run

FIELDS = ("accuracy", "copy_pointer_accuracy", "copy_share")
SYNTHETIC = "synthetic"  # a blend entry whose path holds this is the synthetic-copy source


def _blend_text(entries) -> str:
    return "[" + ", ".join(f"{{path: {e.path}, weight: {e.weight}}}" for e in entries) + "]"


def _natural(cfg) -> list:
    """The base blend's entries but the synthetic-copy source; refused when nothing is left out or kept."""
    kept = [e for e in cfg.data.blend if SYNTHETIC not in e.path]
    if not kept or len(kept) == len(cfg.data.blend):
        raise UsageError(f"arm nosynth: the base config's data.blend has no entry with '{SYNTHETIC}' in its path "
                         "beside others; give the arm with --arm NAME OVERRIDE...")
    return kept


def _without_synthetic(cfg, steps: int) -> list[str]:
    return [f"data.blend={_blend_text(_natural(cfg))}"]


def _synthetic_late(cfg, steps: int) -> list[str]:
    """Without the synthetic source for the first half, the base blend after it."""
    return ["data.blend=[]", f"data.stages=[{{from_step: 0, blend: {_blend_text(_natural(cfg))}}}, "
                             f"{{from_step: {steps // 2}, blend: {_blend_text(cfg.data.blend)}}}]"]


def _half_rate(cfg, steps: int) -> list[str]:
    return [f"optim.lr={cfg.optim.lr / 2:g}", f"optim.min_lr={cfg.optim.min_lr / 2:g}"]


ARMS = {  # name -> (overrides, or a function of the base config and steps giving them; what it tests)
    "gate": ([], "the default recipe (the reference)"),
    "bias-m2": (["copy.gate_bias_init=-2.0"], "the gate starts towards copying (sigmoid(-2): 0.88 of the mass to the copy side)"),
    "detach": (["copy.gate_detach=true"], "the gate reads the final state detached: its loss trains its linear only"),
    "nodecay": (["optim.no_decay=[copy_head.]"], "no weight decay on the copy head's matrices (gate, q, k)"),
    "nodecay-gate": (["optim.no_decay=[copy_head.gate.]"], "no weight decay on the gate's linear"),
    "joint": (["copy.mix=joint"], "the joint mix: no learned gate"),
    "sentinel": (["copy.mix=sentinel"], "the sentinel mix"),
    "joint_gate": (["copy.mix=joint_gate"], "a gate over the joint mix's evidence: g = sigmoid(w.h + b + LSE_V - A)"),
    "wsd": (["optim.schedule=wsd"], "warmup-stable-decay instead of cosine (decay over the last 20%)"),
    "lr-half": (_half_rate, "half the peak and floor rates"),
    "nosynth": (_without_synthetic, "the blend without the synthetic-copy source"),
    "staged": (_synthetic_late, "the synthetic-copy source only in the second half (data.stages)"),
    "docmask": (["data.document_mask=true"], "attention and copy candidates within a document"),
    "muon": (["optim.name=muon"], "Muon for the layers' matrices (AdamW beside it)"),
}


def arm_overrides(names: list[str], base_config: str, base_overrides: list[str], steps: int,
                  custom: dict[str, list[str]] | None = None) -> dict[str, list[str]]:
    """{arm: overrides} for the named ARMS and the custom ones, in order; an unknown name is a usage error."""
    cfg = load_config(base_config, base_overrides)
    arms = {}
    for name in names:
        if name not in ARMS:
            raise UsageError(f"--arms {name}: unknown arm; known: {', '.join(ARMS)} (or --arm NAME OVERRIDE...)")
        given, _ = ARMS[name]
        arms[name] = list(given(cfg, steps) if callable(given) else given)
    for name, overrides in (custom or {}).items():
        if name in ARMS or name in arms:
            raise UsageError(f"--arm {name}: the name is taken (named arms: {', '.join(ARMS)}); give the custom arm another name")
        arms[name] = overrides
    return arms


@dataclass(frozen=True)
class RetentionGrid:
    """The base config and the overrides every run shares, sizes (the ablation's SIZES), the arms
    ({name: overrides}, the first the reference), seeds, steps a run, the directory the runs go in."""

    base_config: str
    sizes: list[str]
    arms: dict[str, list[str]]
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    steps: int = 2000
    overrides: list[str] = field(default_factory=list)
    out: Path = Path("runs/retention")


def run_overrides(grid: RetentionGrid, size: str, arm: str, seed: int) -> list[str]:
    """One run's training overrides, its config loaded (a bad arm fails before anything trains)."""
    from cplm_dist.experiments.ablation import SIZES

    steps, every = grid.steps, max(1, grid.steps // 20)
    overrides = [*grid.overrides, *SIZES[size], *grid.arms[arm], f"seed={seed}", f"data.seed={seed}",
                 f"train.train_steps={steps}", f"train.out_dir={grid.out / f'{size}-{arm}-seed{seed}'}",
                 f"train.eval_interval={every}", f"train.diagnostics_interval={every}",
                 f"train.eval_tasks=[{', '.join(COPY_TASKS)}]", f"train.save_interval={steps}",
                 f"train.log_interval={max(1, steps // 80)}"]
    load_config(grid.base_config, overrides)
    return overrides


def run_grid(grid: RetentionGrid, train: list[str] | None, log: Path) -> list[dict]:
    """Train every run not finished yet, in order (size, arm, seed); each run's summary. `train`
    None reports the finished runs only and names the others."""
    runs = []
    for size in grid.sizes:
        for arm in grid.arms:
            for seed in grid.seeds:
                overrides = run_overrides(grid, size, arm, seed)
                run_dir = grid.out / f"{size}-{arm}-seed{seed}"
                if not finished(run_dir, grid.steps):
                    if train is None:
                        print(f"not finished, left out: {run_dir.name}", flush=True)
                        continue
                    print(f"train {run_dir.name} ...", flush=True)
                    run([*train, "-m", "cplm_dist.train", "--config", grid.base_config, *overrides, "--resume", "auto"], log)
                runs.append({"size": size, "arm": arm, "seed": seed, **curves_of(run_dir)})
    return runs


def weighted(settings: dict[str, dict], name: str) -> float:
    """A field token-weighted over a task's settings (each carries its answer count `n`)."""
    total = sum(s["n"] for s in settings.values())
    return sum(s[name] * s["n"] for s in settings.values()) / total if total else float("nan")


def curves_of(run_dir: Path) -> dict:
    """A run's validation loss by step and, by eval step, each task's FIELDS token-weighted."""
    from cplm_dist.training.run_log import read_metrics

    metrics = run_dir / "logs" / "metrics.jsonl"
    valid, evals = read_metrics(metrics, "valid"), read_metrics(metrics, "eval_tasks")
    return {"valid": {s: valid[s]["loss"] for s in sorted(valid)},
            "evals": {s: {task: {f: weighted(settings, f) for f in FIELDS} for task, settings in evals[s]["tasks"].items()}
                      for s in sorted(evals)}}


def retrieval(run: dict, step: int | None = None, name: str = "accuracy") -> float:
    """The mean over the copy tasks of a field at `step` (None: the last eval)."""
    evals = run["evals"]
    at = evals[max(evals) if step is None else step]
    return statistics.mean(at[t][name] for t in COPY_TASKS if t in at)


def retained(run: dict) -> float:
    """The final retrieval accuracy over the run's best (1: nothing lost)."""
    best = max(retrieval(run, s) for s in run["evals"])
    return retrieval(run) / best if best else float("nan")


METRICS = {  # name -> run -> figure, compared arm minus reference
    "valid loss": lambda r: r["valid"][max(r["valid"])],
    "accuracy": retrieval,
    "retained": retained,
    "copy pointer": lambda r: retrieval(r, name="copy_pointer_accuracy"),
    "copy share": lambda r: retrieval(r, name="copy_share"),
}


def mean_curve(runs: list[dict], name: str) -> list[tuple[int, float]]:
    """[(step, mean over the runs of the copy tasks' mean `name`)] at the steps every run has."""
    steps = sorted(set.intersection(*(set(r["evals"]) for r in runs)))
    return [(s, statistics.mean(retrieval(r, s, name) for r in runs)) for s in steps]


RETAINED = 0.75  # an arm keeps retrieval when its final accuracy is at least this share of its best


def keeps(runs: list[dict], size: str, arm: str, reference: str) -> str:
    """Whether `arm` keeps retrieval without costing validation loss, against the reference paired
    by seed. Keeps: its final accuracy at least RETAINED of its own best (mean over seeds) and above
    the reference's (the paired gain's 90% interval above 0; one seed: above MARGIN). Costs: the
    loss difference's upper end (one seed: the difference) above the reference's standard
    deviation over seeds (at least MARGIN nats)."""
    acc = paired_differences(runs, size, arm, METRICS["accuracy"], key="arm", reference=reference)
    loss = paired_differences(runs, size, arm, METRICS["valid loss"], key="arm", reference=reference)
    ref_losses = [METRICS["valid loss"](r) for r in runs if (r["size"], r["arm"]) == (size, reference)]
    allowed = max(MARGIN, statistics.stdev(ref_losses) if len(ref_losses) > 1 else 0.0)
    acc_low = t_interval(acc)[0] if len(acc) > 1 else (acc[0] - MARGIN if acc else float("nan"))
    loss_high = t_interval(loss)[1] if len(loss) > 1 else (loss[0] if loss else float("nan"))
    kept = statistics.mean(retained(r) for r in runs if (r["size"], r["arm"]) == (size, arm)) >= RETAINED
    retains, costs = kept and acc_low > 0, loss_high > allowed
    return ("keeps retrieval, loss within the seeds' spread" if retains and not costs
            else "keeps retrieval, costs validation loss" if retains else "does not keep retrieval")


def write_grid_report(runs: list[dict], grid: RetentionGrid, out: Path) -> str:
    """retention.md and retention.png in `out`: the arms, their curves (mean over seeds), each arm
    against the reference paired by seed with intervals, and which keep retrieval; its text."""
    reference = next(iter(grid.arms))
    lines = ["# Retention grid", "",
             f"Base config `{grid.base_config}`{' with ' + ' '.join(grid.overrides) if grid.overrides else ''}, "
             f"{grid.steps} steps a run, seeds {list(grid.seeds)}, sizes {list(grid.sizes)}; the in-loop suite "
             f"({', '.join(COPY_TASKS)}) every {max(1, grid.steps // 20)} steps. Each figure is the tasks' mean of a "
             "field token-weighted over the task's settings.", "",
             "| arm | overrides | what it tests |", "|---|---|---|"]
    lines += [f"| {arm} | `{' '.join(o) or '-'}` | {ARMS.get(arm, (None, 'given with --arm'))[1]} |" for arm, o in grid.arms.items()]
    for size in grid.sizes:
        mine = [r for r in runs if r["size"] == size]
        if not mine:
            continue
        steps = sorted(set.intersection(*(set(r["evals"]) for r in mine)))
        shown = sorted({steps[min(len(steps) - 1, round(q * (len(steps) - 1)))] for q in (0, 0.1, 0.25, 0.5, 0.75, 1)})
        lines += ["", f"## {size}: curves (mean over seeds; accuracy / copy pointer / copy share)", "",
                  "| arm | seeds | " + " | ".join(f"step {s}" for s in shown) + " | final valid loss |",
                  "|---" * (3 + len(shown)) + "|"]
        for arm in grid.arms:
            rs = [r for r in mine if r["arm"] == arm]
            if not rs:
                continue
            cells = [" / ".join(f"{statistics.mean(retrieval(r, s, f) for r in rs):.3f}" for f in FIELDS) for s in shown]
            loss = [METRICS["valid loss"](r) for r in rs]
            lines.append(f"| {arm} | {len(rs)} | " + " | ".join(cells)
                         + f" | {statistics.mean(loss):.3f} [{min(loss):.3f}, {max(loss):.3f}] |")
        lines += ["", f"## {size}: each arm minus {reference}, paired by seed", "",
                  "Mean [min, max] over seeds and the 90% t-interval of the mean (valid loss: lower is better; "
                  "retained: final accuracy over the run's best). Verdict: an arm keeps retrieval when its final "
                  f"accuracy is at least {RETAINED} of its best and the paired gain's interval is above 0 (one seed: "
                  f"above {MARGIN}); it costs validation loss when the paired difference's upper end passes the "
                  f"reference's standard deviation over seeds (at least {MARGIN} nats).", "",
                  "| arm | " + " | ".join(METRICS) + " | verdict |", "|---" * (2 + len(METRICS)) + "|"]
        for arm in grid.arms:
            if arm == reference:
                continue
            diffs = [paired_differences(runs, size, arm, m, key="arm", reference=reference) for m in METRICS.values()]
            if diffs[0]:
                lines.append(f"| {arm} | " + " | ".join(spread(d) for d in diffs) + f" | {keeps(runs, size, arm, reference)} |")
    lines += ["", "![retention curves](retention.png)", ""]
    out.mkdir(parents=True, exist_ok=True)
    (out / "retention.md").write_text("\n".join(lines))
    plot_grid(runs, grid, out / "retention.png")
    return "\n".join(lines)


def plot_grid(runs: list[dict], grid: RetentionGrid, path: Path) -> None:
    """Accuracy, copy pointer accuracy, copy share and validation loss against steps: one line an
    arm and size, the mean over its seeds."""
    from cplm_dist.plotting import figure, lines

    groups = {(size, arm): [r for r in runs if (r["size"], r["arm"]) == (size, arm)] for size in grid.sizes for arm in grid.arms}
    groups = {f"{size} {arm}": rs for (size, arm), rs in groups.items() if rs}
    with figure(path, ncols=4, size=(17, 3.8)) as axes:
        for ax, name in zip(axes, FIELDS):
            lines(ax, {label: mean_curve(rs, name) for label, rs in groups.items()}, xlabel="step", title=name.replace("_", " "))
        loss = {label: [(s, statistics.mean(r["valid"][s] for r in rs)) for s in sorted(set.intersection(*(set(r["valid"]) for r in rs)))]
                for label, rs in groups.items()}
        lines(axes[3], loss, xlabel="step", title="validation loss")
