"""The long-context ablation (tools/ablate_long_context.py is its command line): does document
masking change the copy head's gain, how large is the gain on natural text alone, and where does
copy on win at long context? Matched runs {variants} x {data.document_mask off, on} x {the
quickstart corpus, its natural half alone} x seeds, trained at one sequence length, each
evaluated by context length beyond it too (the evaluation tool's --context-lengths); a report of
every run and of copy on minus copy off, and a plot by length.

    ablation = LongContextAblation("configs/quickstart.yaml", seeds=[1, 2], steps=120, lengths=[256, 1024, 4096])
    runs = plan(ablation)
    run_all(runs, ablation, evaluate=[...], log=log)
    write_report(runs, ablation, out)
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from cplm_dist.config import load_config
from cplm_dist.experiments.runs import VARIANTS, finished, run

CORPORA = {  # name -> the data.blend override (None: the base config's blend)
    "quickstart": None,
    "natural": "data.blend=[{path: data/quickstart/stdlib, weight: 1.0}]",
}
MASKS = {"nomask": "data.document_mask=false", "docmask": "data.document_mask=true"}


@dataclass(frozen=True)
class LongContextAblation:
    """The axes (variants, masks, corpora, seeds), the training (steps, sequence length, the model's
    max_seq_len, a batch of micro_batch sequences on one rank), the lengths evaluated and samples a
    task and length, the overrides every run shares and the directory the runs go in."""

    base_config: str
    variants: list[str] = field(default_factory=lambda: ["off", "gate"])
    masks: list[str] = field(default_factory=lambda: list(MASKS))
    corpora: list[str] = field(default_factory=lambda: list(CORPORA))
    seeds: list[int] = field(default_factory=lambda: [1, 2])
    steps: int = 120
    seq_length: int = 1024
    max_seq_len: int = 4096
    micro_batch: int = 4
    lengths: list[int] = field(default_factory=lambda: [256, 512, 1024, 2048, 4096])
    samples: int = 8
    overrides: list[str] = field(default_factory=list)
    out: Path = Path("runs/ablation-long")


def plan(ablation: LongContextAblation) -> list[dict]:
    """Every run: its name, axes and training overrides."""
    runs = []
    for corpus in ablation.corpora:
        for mask in ablation.masks:
            for variant in ablation.variants:
                for seed in ablation.seeds:
                    name = f"{corpus}-{mask}-{variant}-seed{seed}"
                    run_dir = Path(ablation.out) / name
                    blend = [CORPORA[corpus]] if CORPORA[corpus] else []
                    overrides = [*ablation.overrides, *blend, MASKS[mask], *VARIANTS[variant], f"seed={seed}",
                                 f"data.seed={seed}", f"data.seq_length={ablation.seq_length}",
                                 f"model.max_seq_len={ablation.max_seq_len}", f"train.micro_batch_size={ablation.micro_batch}",
                                 f"train.global_batch_size={ablation.micro_batch}", f"train.train_steps={ablation.steps}",
                                 f"train.out_dir={run_dir}", f"train.eval_interval={max(1, ablation.steps // 4)}",
                                 f"train.save_interval={ablation.steps}", f"train.log_interval={max(1, ablation.steps // 10)}"]
                    runs.append({"name": name, "corpus": corpus, "mask": mask, "variant": variant, "seed": seed,
                                 "dir": run_dir, "overrides": overrides})
    return runs


def run_all(runs: list[dict], ablation: LongContextAblation, evaluate: list[str], log: Path) -> None:
    """Train every unfinished run, then evaluate each by context length (`evaluate`: the
    evaluation command, -m the evaluation tool's module) unless its eval_by_length.json exists;
    each run's record gets its summary."""
    for r in runs:  # every config checked before the first run starts
        load_config(ablation.base_config, r["overrides"])
    for r in runs:
        if not finished(r["dir"], ablation.steps):
            print(f"train {r['name']} ...", flush=True)
            run([sys.executable, "-m", "cplm_dist.train", "--config", ablation.base_config, *r["overrides"], "--resume", "auto"], log)
    for r in runs:
        result = r["dir"] / "eval" / "by-length" / "eval_by_length.json"
        if not result.exists():
            print(f"evaluate {r['name']} by context length ...", flush=True)
            run([*evaluate, "--checkpoint", str(r["dir"]), "--context-lengths", *map(str, ablation.lengths),
                 "--samples", str(ablation.samples), "--out", str(result.parent)], log)
        r.update(summarise(r["dir"], result))


def summarise(run_dir: Path, result: Path) -> dict:
    """The run's final validation loss and its accuracy per task and context length."""
    from cplm_dist.training.run_log import read_metrics

    valid = read_metrics(run_dir / "logs" / "metrics.jsonl", "valid")
    by_length = json.loads(result.read_text())["tasks"]
    return {"valid_loss": valid[max(valid)]["loss"] if valid else None,
            "by_length": {task: {int(n): row["accuracy"] for n, row in rows.items()} for task, rows in by_length.items()}}


def mean_over(runs: list[dict], task: str, length: int) -> float:
    """The mean accuracy of `runs` at one task and length (nan: none measured it)."""
    values = [r["by_length"][task][length] for r in runs if length in r["by_length"].get(task, {})]
    return statistics.mean(values) if values else float("nan")


def gain_table(runs: list[dict], ablation: LongContextAblation, tasks: list[str]) -> list[str]:
    """Copy on (gate) minus copy off per corpus x mask, task and length: mean over seeds."""
    rows = ["| corpus | mask | valid loss | " + " | ".join(f"{t} @{n}" for t in tasks for n in ablation.lengths) + " |",
            "|---" * (3 + len(tasks) * len(ablation.lengths)) + "|"]
    for corpus in ablation.corpora:
        for mask in ablation.masks:
            pick = lambda v: [r for r in runs if (r["corpus"], r["mask"], r["variant"]) == (corpus, mask, v)]  # noqa: E731
            on, off = pick("gate"), pick("off")
            if not on or not off:
                continue
            loss = statistics.mean(r["valid_loss"] for r in on) - statistics.mean(r["valid_loss"] for r in off)
            cells = [f"{mean_over(on, t, n) - mean_over(off, t, n):+.2f}" for t in tasks for n in ablation.lengths]
            rows.append(f"| {corpus} | {mask} | {loss:+.3f} | " + " | ".join(cells) + " |")
    return rows


def write_report(runs: list[dict], ablation: LongContextAblation, out: Path) -> str:
    """report.md (every run; copy on minus copy off) and by_length.png; the report's text."""
    tasks = sorted({t for r in runs for t in r["by_length"]})
    lines = ["# Long-context ablation", "",
             f"Command: `python tools/ablate_long_context.py --steps {ablation.steps} --seeds {' '.join(map(str, ablation.seeds))} "
             f"--lengths {' '.join(map(str, ablation.lengths))} --samples {ablation.samples}` (base `{ablation.base_config}`, "
             f"data.seq_length {ablation.seq_length}, model.max_seq_len {ablation.max_seq_len}, batch {ablation.micro_batch} x "
             f"{ablation.seq_length} tokens, {ablation.steps} steps). Evaluated by context length with tools/evaluate.py "
             "--context-lengths: accuracy (mqar) or exact match (the text tasks).", "",
             "## Every run", "",
             "| run | valid loss | " + " | ".join(f"{t} @{n}" for t in tasks for n in ablation.lengths) + " |",
             "|---" * (2 + len(tasks) * len(ablation.lengths)) + "|"]
    for r in runs:
        cells = [f"{r['by_length'].get(t, {}).get(n, float('nan')):.2f}" for t in tasks for n in ablation.lengths]
        lines.append(f"| {r['name']} | {r['valid_loss']:.4f} | " + " | ".join(cells) + " |")
    lines += ["", "## Copy on (gate) minus copy off, mean over seeds", "", *gain_table(runs, ablation, tasks), ""]
    (out / "report.md").write_text("\n".join(lines))
    plot(runs, ablation, tasks, out)
    return "\n".join(lines)


def plot(runs: list[dict], ablation: LongContextAblation, tasks: list[str], out: Path) -> None:
    """One panel per corpus and task: accuracy against context length, a line per variant and mask
    (copy off dashed), the training length marked."""
    from cplm_dist.plotting import figure

    panels = [(corpus, task) for corpus in ablation.corpora for task in tasks]
    with figure(out / "by_length.png", ncols=len(panels), size=(3 * len(panels), 3.2)) as axes:
        for ax, (corpus, task) in zip(axes if len(panels) > 1 else [axes], panels):
            for mask in ablation.masks:
                for variant in ablation.variants:
                    group = [r for r in runs if (r["corpus"], r["mask"], r["variant"]) == (corpus, mask, variant)]
                    ax.plot(ablation.lengths, [mean_over(group, task, n) for n in ablation.lengths], marker="o",
                            linestyle="--" if variant == "off" else "-", label=f"{variant} {mask}")
            ax.axvline(ablation.seq_length, color="grey", linewidth=0.5)
            ax.set_xscale("log", base=2)
            ax.set(title=f"{corpus}: {task}", ylim=(-0.02, 1.02), xlabel="context length")
        (axes[0] if len(panels) > 1 else axes).legend(fontsize=6)
