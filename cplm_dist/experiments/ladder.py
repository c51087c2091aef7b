"""A scaling ladder, point by point (tools/scaling.py is its command line): every point planned
(variant x size x seed: its shape, token budget and training overrides), trained (one after another
here, or each as a Slurm job: slurm.py), evaluated on the copy suite and collected into one row;
ladder_report.py fits the rows and writes the report.

    ladder = Ladder("configs/quickstart.yaml", targets=(1e6, 2e6, 4e6), variants=("off", "gate"))
    points = plan_ladder(ladder)                       # <out>/ladder.json
    train_points(unfinished(points), [sys.executable], log)
    evaluate_points(points, [sys.executable, "-m", evaluation_module], ["induction"], 16, log)
    rows = collect(points)

Each point's learning rate, micro-batch, global batch and (under Slurm) job size come from the
ladder's recipe (ladder_recipe.py: rules with their sources, or the ladder file's table); the
shape alone is not enough (a 1.7B point on a 135M config would keep the 135M's lr and batch).
A point trains with --resume auto into <out>/points/<variant>-<size>-seed<k>; a point whose last
checkpoint is written is finished and not trained again, so a driver run again continues an
interrupted ladder. Every command goes through what is installed (runs.py).

A point may be sparse (model.moe among the ladder's overrides, which then size the shapes by total
parameters, every expert; or a variant's, on the shape the ladder sized), and each point records its total and its active parameters
(what a token uses: cplm_dist.model.counting) besides the FLOPs (counted on the active matrices);
`axis` chooses which of the three the fits run along (ladder_report.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from cplm_dist.config import load_config
from cplm_dist.errors import UsageError
from cplm_dist.experiments.ladder_recipe import Job, Recipe
from cplm_dist.experiments.runs import VARIANTS, finished, mean_score, run
from cplm_dist.experiments.scaling import shape_for, token_budget, training_flops, with_overrides
from cplm_dist.model.counting import active_parameters, parameter_count

AXES = {"flops": "flops", "active": "active_parameters", "total": "total_parameters"}  # --axis -> the row's column


@dataclass(frozen=True)
class Ladder:
    """A ladder as asked for: the base config and the overrides every point shares, the parameter
    targets, the variants (VARIANTS names or NAME=override,override) and seeds, the shapes' aspect
    ratio D / L and head size, tokens a parameter, and the directory it writes."""

    base_config: str
    targets: list[float]
    variants: list[str]
    seeds: list[int] = field(default_factory=lambda: [1])
    overrides: list[str] = field(default_factory=list)
    aspect: float = 32.0
    head_dim: int = 64
    tokens_per_parameter: float = 20.0
    out: Path = Path("runs/scaling")
    recipe: Recipe = field(default_factory=Recipe)  # each point's lr, batches and job (ladder_recipe.py)
    job: Job = field(default_factory=Job)  # the Slurm job size the points may use (--slurm's --nodes, --gpus-per-node)
    world: int = 1  # ranks a local point trains on (the --launcher's processes)
    axis: str = "flops"  # what the fits run along: AXES


def log_spaced(low: float, high: float, points: int) -> list[float]:
    """`points` parameter targets log-spaced over [low, high] (either order)."""
    lo, hi = sorted((low, high))
    return [lo * (hi / lo) ** (i / max(1, points - 1)) for i in range(points)]


def variant_overrides(spec: str) -> tuple[str, list[str]]:
    """(name, overrides) of a variant: a VARIANTS name, or NAME=override,override."""
    if "=" in spec.split(",")[0] and spec.split("=", 1)[0] not in VARIANTS:
        name, rest = spec.split("=", 1)
        return name, [o for o in rest.split(",") if o]
    if spec not in VARIANTS:
        raise UsageError(f"--variants {spec}: not one of {sorted(VARIANTS)} nor NAME=override,override")
    return spec, VARIANTS[spec]


def plan_ladder(ladder: Ladder) -> list[dict]:
    """Every point: variant, size, seed, shape, its recipe (lr, batches, job size), tokens, steps and
    the training arguments; each point's config is loaded here, so a bad point fails before
    anything runs."""
    base = load_config(ladder.base_config, ladder.overrides)
    given = frozenset(o.partition("=")[0] for o in ladder.overrides)
    points = []
    for target in sorted(ladder.targets):
        shape = shape_for(base, target, aspect=ladder.aspect, head_dim=ladder.head_dim)
        budget = token_budget(shape.parameters, ladder.tokens_per_parameter)
        flops = training_flops(with_overrides(base, list(shape.overrides)), budget, base.data.seq_length)
        recipe = ladder.recipe.for_point(base, target, shape.layers, shape.hidden, flops, ladder.job, ladder.world, given)
        per_step = recipe.global_batch * base.data.seq_length
        steps = max(1, math.ceil(budget / per_step))
        for spec in ladder.variants:
            name, overrides = variant_overrides(spec)
            for seed in ladder.seeds:
                point = f"{name}-{shape.label}-seed{seed}"
                run_dir = Path(ladder.out) / "points" / point
                train = [*ladder.overrides, *shape.overrides, *recipe.overrides(), *overrides, f"seed={seed}", f"data.seed={seed}",
                         f"train.train_steps={steps}", f"optim.warmup_steps={max(1, steps // 10)}",
                         f"train.eval_interval={steps}", f"train.save_interval={steps}",
                         f"train.log_interval={max(1, steps // 20)}", f"train.out_dir={run_dir}"]
                cfg = load_config(ladder.base_config, train)
                points.append({"point": point, "variant": name, "target": target, "seed": seed, "tp": cfg.parallel.tp,
                               "layers": shape.layers, "experts": cfg.model.moe.num_experts,
                               "total_parameters": parameter_count(cfg)["total"], "active_parameters": active_parameters(cfg),
                               "hidden": shape.hidden, "parameters": shape.parameters, "steps": steps,
                               "tokens": steps * per_step, "flops": training_flops(cfg, steps * per_step, cfg.data.seq_length),
                               "recipe": dataclasses.asdict(recipe), "submit_options": recipe.submit_options(ladder.job),
                               "run_dir": str(run_dir), "train_args": ["--config", ladder.base_config, *train]})
    return points


def unfinished(points: list[dict], limit: int | None = None) -> list[dict]:
    """The points still to train, at most `limit` of them (the rest on the next run)."""
    todo = [p for p in points if not finished(Path(p["run_dir"]), p["steps"])]
    return todo if limit is None else todo[:limit]


def train_points(todo: list[dict], prefix: list[str], log: Path) -> None:
    """Train each point here, one after another: `prefix` (this interpreter, or a launcher such
    as torchrun) -m cplm_dist.train, resuming whatever a point had written."""
    for p in todo:
        print(f"train {p['point']} ({p['parameters'] / 1e6:.2f}M parameters, {p['tokens']:,} tokens) ...", flush=True)
        run([*prefix, "-m", "cplm_dist.train", *p["train_args"], "--resume", "auto"], log)


def evaluate_points(points: list[dict], evaluate: list[str], tasks: list[str], samples: int, log: Path) -> None:
    """The copy suite on each finished point not yet evaluated: `evaluate` is the evaluation
    command (launcher, -m, the evaluation tool's module), its eval.json in <point>/eval."""
    if not tasks or tasks == ["none"]:
        return
    for p in points:
        out = Path(p["run_dir"]) / "eval"
        if finished(Path(p["run_dir"]), p["steps"]) and not (out / "eval.json").exists():
            run([*evaluate, "--checkpoint", p["run_dir"], "--tasks", *tasks, "--samples", str(samples),
                 "--valid-batches", "0", "--out", str(out)], log)


def collect(points: list[dict]) -> list[dict]:
    """One row a finished point: the plan's figures, its final validation loss, suite scores."""
    from cplm_dist.training.run_log import read_metrics

    rows = []
    for p in points:
        run_dir = Path(p["run_dir"])
        if not finished(run_dir, p["steps"]):
            continue
        valid = read_metrics(run_dir / "logs" / "metrics.jsonl", "valid")
        row = {k: p.get(k) for k in ("point", "variant", "seed", "layers", "hidden", "parameters", "experts", "total_parameters",
                                     "active_parameters", "steps", "tokens", "flops")}
        row["valid_loss"] = valid[max(valid)]["loss"]
        evaluation = run_dir / "eval" / "eval.json"
        if evaluation.exists():
            row.update({f"suite_{t}": mean_score(r) for t, r in json.loads(evaluation.read_text())["tasks"].items()})
        rows.append(row)
    return rows
