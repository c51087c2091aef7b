"""The long-context ablation: does document masking change the copy head's gain, how large is the
gain on natural text alone, and where does copy on win at long context?

    python tools/ablate_long_context.py                 # CPU default (about an hour of 2 cores)
    python tools/ablate_long_context.py --seeds 1 2 3 --steps 300 --lengths 256 1024 4096 16384

Matched runs {copy off, gate} x {data.document_mask off, on} x {the quickstart corpus, its natural
half alone (the standard-library sources: no synthetic copy documents)} x seeds, trained at
--seq-length (default 1024) with model.max_seq_len --max-seq-len (4096), every run of a seed on the
same data order from the same initial seed; each evaluated by context length
(tools/evaluate.py --context-lengths: needle, phone book, MQAR, variable tracking), beyond the
training length too. All runs train first, then all are evaluated. Writes <out>/report.md,
<out>/summary.json and <out>/by_length.png. Finished runs and evaluations are reused, so an
interrupted ablation continues where it stopped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from cplm_dist.config import load_config
from cplm_dist.config.cli import exit_on_usage_error
from cplm_dist.experiments.runs import VARIANTS, ensure_quickstart_data, finished, run

TOOLS = Path(__file__).resolve().parent
CORPORA = {  # name -> the data.blend override (None: the base config's blend)
    "quickstart": None,
    "natural": "data.blend=[{path: data/quickstart/stdlib, weight: 1.0}]",
}
MASKS = {"nomask": "data.document_mask=false", "docmask": "data.document_mask=true"}
MARGIN = 0.02  # an accuracy difference smaller than this counts as a tie


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-config", default="configs/quickstart.yaml")
    p.add_argument("--variants", nargs="+", default=["off", "gate"], choices=list(VARIANTS))
    p.add_argument("--masks", nargs="+", default=list(MASKS), choices=list(MASKS))
    p.add_argument("--corpora", nargs="+", default=list(CORPORA), choices=list(CORPORA))
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=4, help="also the global batch (one rank)")
    p.add_argument("--lengths", nargs="+", type=int, default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--samples", type=int, default=8, help="evaluation samples per task and length")
    p.add_argument("--out", default="runs/ablation-long")
    p.add_argument("overrides", nargs="*", help="config overrides for every run")
    return p


def plan(args) -> list[dict]:
    """Every run: its name, axes and training overrides."""
    runs = []
    for corpus in args.corpora:
        for mask in args.masks:
            for variant in args.variants:
                for seed in args.seeds:
                    name = f"{corpus}-{mask}-{variant}-seed{seed}"
                    run_dir = Path(args.out) / name
                    blend = [CORPORA[corpus]] if CORPORA[corpus] else []
                    overrides = [*args.overrides, *blend, MASKS[mask], *VARIANTS[variant], f"seed={seed}",
                                 f"data.seed={seed}", f"data.seq_length={args.seq_length}",
                                 f"model.max_seq_len={args.max_seq_len}", f"train.micro_batch_size={args.micro_batch}",
                                 f"train.global_batch_size={args.micro_batch}", f"train.train_steps={args.steps}",
                                 f"train.out_dir={run_dir}", f"train.eval_interval={max(1, args.steps // 4)}",
                                 f"train.save_interval={args.steps}", f"train.log_interval={max(1, args.steps // 10)}"]
                    runs.append({"name": name, "corpus": corpus, "mask": mask, "variant": variant, "seed": seed,
                                 "dir": run_dir, "overrides": overrides})
    return runs


@exit_on_usage_error
def main(argv=None) -> int:
    args = parser().parse_intermixed_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "ablation.log"
    ensure_quickstart_data(load_config(args.base_config, args.overrides), log)
    runs = plan(args)
    for r in runs:  # every config checked before the first run starts
        load_config(args.base_config, r["overrides"])
    for r in runs:
        if not finished(r["dir"], args.steps):
            print(f"train {r['name']} ...", flush=True)
            run([sys.executable, "-m", "cplm_dist.train", "--config", args.base_config, *r["overrides"], "--resume", "auto"], log)
    for r in runs:
        result = r["dir"] / "eval" / "by-length" / "eval_by_length.json"
        if not result.exists():
            print(f"evaluate {r['name']} by context length ...", flush=True)
            run([sys.executable, str(TOOLS / "evaluate.py"), "--checkpoint", str(r["dir"]), "--context-lengths",
                 *map(str, args.lengths), "--samples", str(args.samples), "--out", str(result.parent)], log)
        r.update(summarise(r["dir"], result))
    summary = [{k: (str(v) if isinstance(v, Path) else v) for k, v in r.items() if k != "overrides"} for r in runs]
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    report = write_report(runs, args, out)
    print(report)
    print(f"wrote {out / 'report.md'}, {out / 'summary.json'} and {out / 'by_length.png'}")
    return 0


def summarise(run_dir: Path, result: Path) -> dict:
    """The run's final validation loss and its accuracy per task and context length."""
    from cplm_dist.train.run_log import read_metrics

    valid = read_metrics(run_dir / "logs" / "metrics.jsonl", "valid")
    by_length = json.loads(result.read_text())["tasks"]
    return {"valid_loss": valid[max(valid)]["loss"] if valid else None,
            "by_length": {task: {int(n): row["accuracy"] for n, row in rows.items()} for task, rows in by_length.items()}}


def mean_over(runs: list[dict], task: str, length: int) -> float:
    values = [r["by_length"][task][length] for r in runs if length in r["by_length"].get(task, {})]
    return statistics.mean(values) if values else float("nan")


def gain_table(runs: list[dict], args, tasks: list[str]) -> list[str]:
    """Copy on (gate) minus copy off per corpus x mask, task and length: mean over seeds."""
    rows = ["| corpus | mask | valid loss | " + " | ".join(f"{t} @{n}" for t in tasks for n in args.lengths) + " |",
            "|---" * (3 + len(tasks) * len(args.lengths)) + "|"]
    for corpus in args.corpora:
        for mask in args.masks:
            pick = lambda v: [r for r in runs if (r["corpus"], r["mask"], r["variant"]) == (corpus, mask, v)]  # noqa: E731
            on, off = pick("gate"), pick("off")
            if not on or not off:
                continue
            loss = statistics.mean(r["valid_loss"] for r in on) - statistics.mean(r["valid_loss"] for r in off)
            cells = [f"{mean_over(on, t, n) - mean_over(off, t, n):+.2f}" for t in tasks for n in args.lengths]
            rows.append(f"| {corpus} | {mask} | {loss:+.3f} | " + " | ".join(cells) + " |")
    return rows


def write_report(runs: list[dict], args, out: Path) -> str:
    tasks = sorted({t for r in runs for t in r["by_length"]})
    lines = ["# Long-context ablation", "",
             f"Command: `python tools/ablate_long_context.py --steps {args.steps} --seeds {' '.join(map(str, args.seeds))} "
             f"--lengths {' '.join(map(str, args.lengths))} --samples {args.samples}` (base `{args.base_config}`, "
             f"data.seq_length {args.seq_length}, model.max_seq_len {args.max_seq_len}, batch {args.micro_batch} x "
             f"{args.seq_length} tokens, {args.steps} steps). Evaluated by context length with tools/evaluate.py "
             "--context-lengths: accuracy (mqar) or exact match (the text tasks).", "",
             "## Every run", "",
             "| run | valid loss | " + " | ".join(f"{t} @{n}" for t in tasks for n in args.lengths) + " |",
             "|---" * (2 + len(tasks) * len(args.lengths)) + "|"]
    for r in runs:
        cells = [f"{r['by_length'].get(t, {}).get(n, float('nan')):.2f}" for t in tasks for n in args.lengths]
        lines.append(f"| {r['name']} | {r['valid_loss']:.4f} | " + " | ".join(cells) + " |")
    lines += ["", "## Copy on (gate) minus copy off, mean over seeds", "", *gain_table(runs, args, tasks), ""]
    (out / "report.md").write_text("\n".join(lines))
    plot(runs, args, tasks, out)
    return "\n".join(lines)


def plot(runs: list[dict], args, tasks: list[str], out: Path) -> None:
    """One panel per corpus and task: accuracy against context length, a line per variant and mask
    (copy off dashed), the training length marked."""
    from cplm_dist.profiling.plotting import figure

    panels = [(corpus, task) for corpus in args.corpora for task in tasks]
    with figure(out / "by_length.png", ncols=len(panels), size=(3 * len(panels), 3.2)) as axes:
        for ax, (corpus, task) in zip(axes if len(panels) > 1 else [axes], panels):
            for mask in args.masks:
                for variant in args.variants:
                    group = [r for r in runs if (r["corpus"], r["mask"], r["variant"]) == (corpus, mask, variant)]
                    ax.plot(args.lengths, [mean_over(group, task, n) for n in args.lengths], marker="o",
                            linestyle="--" if variant == "off" else "-", label=f"{variant} {mask}")
            ax.axvline(args.seq_length, color="grey", linewidth=0.5)
            ax.set_xscale("log", base=2)
            ax.set(title=f"{corpus}: {task}", ylim=(-0.02, 1.02), xlabel="context length")
        (axes[0] if len(panels) > 1 else axes).legend(fontsize=6)


if __name__ == "__main__":
    sys.exit(main())
