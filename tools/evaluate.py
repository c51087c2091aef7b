"""Evaluate a checkpoint: validation perplexity and the copy / retrieval suite.

    python tools/evaluate.py --checkpoint runs/quickstart-20261130-030950
    python tools/evaluate.py --checkpoint runs/x/checkpoints/step-00000200 --tasks induction mqar --samples 64
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 tools/evaluate.py --checkpoint runs/tp2-run    # its tp
    python tools/evaluate.py --checkpoint runs/long --context-lengths 1024 4096 16384          # by context length
    python tools/evaluate.py --compare runs/copy-on runs/copy-off --context-lengths 1024 4096 --out runs/compare

By context length (--context-lengths L ...; cplm_dist/evaluation/long_context.py): needle, phonebook,
mqar and vartrack (multi-hop variable tracking) with their facts hidden in about L tokens of filler
(the run's validation documents, else the standard-library corpus); prompts prefilled in chunks of
1024 tokens (no T x V tensor); writes <out>/eval_by_length.json ({"tasks": {task: {L: {accuracy,
metric, samples, ...}}}}) and <out>/by_length.png. A length beyond the checkpoint's
model.max_seq_len is one line and exit 2. --compare A B: two checkpoints (each evaluated unless it
already has an eval_by_length.json, or is one) side by side: <out>/compare.json, <out>/compare.png.

Tasks (cplm_dist/evaluation/tasks.py): induction, mqar, phonebook, needle, spamlang. Writes
<out>/eval.json, one PNG per task (accuracy or exact match against context length, pairs or
depth) and prints a table. The run's own config (stored in the checkpoint) gives the model, the
tokenizer and the validation data; data.* overrides point elsewhere. Without the data the
perplexity is skipped and the needle's filler comes from the standard-library corpus.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cplm_dist.config import apply_overrides, from_dict, to_dict
from cplm_dist.config.cli import exit_on_usage_error
from cplm_dist.errors import UsageError
from cplm_dist.evaluation.long_context import LONG_TASKS, MIN_LENGTH, run_by_length
from cplm_dist.evaluation.tasks import TASKS, EvalContext, run_suite

BY_LENGTH = "eval_by_length.json"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="a run directory, its checkpoints/, or a step-* directory")
    p.add_argument("--tasks", nargs="+", choices=sorted(set(TASKS) | set(LONG_TASKS)),
                   help=f"default: {' '.join(TASKS)}; by context length: {' '.join(LONG_TASKS)}")
    p.add_argument("--context-lengths", nargs="+", type=int, metavar="L",
                   help="run the retrieval and copy tasks at each context length (tokens) instead of the suite")
    p.add_argument("--compare", nargs=2, metavar=("RUN_A", "RUN_B"),
                   help="two checkpoints (or their eval_by_length.json) by context length, side by side")
    p.add_argument("--samples", type=int, default=32, help="samples per task setting")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--valid-batches", type=int, default=16, help="validation batches for the perplexity (0: skip)")
    p.add_argument("--out", help="output directory (default: <run>/eval/<step>)")
    p.add_argument("overrides", nargs="*", metavar="data.field=value")
    return p


def validation(model, cfg, batches: int) -> tuple[dict | None, list[str]]:
    """({loss, perplexity, tokens} or None where there is no validation data, decoded validation
    documents for the needle's filler)."""
    from cplm_dist.data.gpt_data import build_datasets
    from cplm_dist.errors import DataError
    from cplm_dist.evaluation.perplexity import validation_perplexity

    micro = cfg.train.micro_batch_size
    try:
        data = build_datasets(cfg, (0, batches * micro, 0))
    except DataError as e:
        print(f"note: no validation perplexity ({e})")
        return None, []
    return validation_perplexity(model, data, micro)


def print_table(results: dict, valid: dict | None) -> None:
    if valid:
        print(f"validation: loss {valid['loss']:.4f}, perplexity {valid['perplexity']:.2f} ({valid['tokens']:,} tokens)")
    for task, rows in results.items():
        for r in rows:
            setting = " ".join(f"{k}={v}" for k, v in r["setting"].items())
            score = (f"exact match {r['exact_match']:.3f}" if "exact_match" in r
                     else f"accuracy {r['accuracy']:.3f}  loss {r['loss']:.3f}"
                     + (f"  (lm alone {r['lm_accuracy']:.3f}, copy pointer {r['copy_pointer_accuracy']:.3f}, "
                        f"copy share {r['copy_share']:.3f})" if "copy_share" in r else ""))
            print(f"  {task:<10} {setting:<24} {score}  (n={r['n']})")


def plot(results: dict, out: Path) -> list[Path]:
    """Per task: accuracy (or exact match) against its first setting key, a line per other setting."""
    from cplm_dist.plotting import figure, lines

    paths = []
    for task, rows in results.items():
        if not rows:
            continue
        x_key, *group_keys = list(rows[0]["setting"])
        metric = "exact_match" if "exact_match" in rows[0] else "accuracy"
        series = {}
        for r in rows:
            label = ", ".join(f"{k}={r['setting'][k]}" for k in group_keys)
            series.setdefault(label, []).append((r["setting"][x_key], r[metric]))
        path = out / f"{task}.png"
        with figure(path) as ax:
            lines(ax, series, xlabel=x_key, ylabel=metric.replace("_", " "), title=task, ylim=(-0.02, 1.02))
        paths.append(path)
    return paths


@exit_on_usage_error
def main(argv=None) -> int:
    from cplm_dist.checkpoint import load_checkpoint_config, load_model
    from cplm_dist.data.corpora import stdlib_documents
    from cplm_dist.data.tokenizer import check_tokenizer_fits_model, load_tokenizer
    from cplm_dist.distributed import destroy_distributed, evaluation_tp, init_distributed
    from cplm_dist.errors import ConfigError, DataError

    args = parser().parse_intermixed_args(argv)
    if args.compare:
        return compare(args)
    if not args.checkpoint:
        raise UsageError("give --checkpoint RUN (or --compare RUN_A RUN_B)")
    if any(not o.startswith("data.") for o in args.overrides):
        raise UsageError("evaluate.py takes only data.* overrides (the model is the checkpoint's)")
    if args.samples < 1 or args.valid_batches < 0:
        raise UsageError(f"--samples {args.samples} / --valid-batches {args.valid_batches}: need samples >= 1, "
                         "valid-batches >= 0 (0: no perplexity)")
    cfg, info = load_checkpoint_config(args.checkpoint)
    tasks = args.tasks or list(LONG_TASKS if args.context_lengths else TASKS)
    if args.context_lengths:
        check_lengths(args.context_lengths, cfg.model.max_seq_len, tasks)
    elif set(tasks) - set(TASKS):
        raise UsageError(f"--tasks {' '.join(sorted(set(tasks) - set(TASKS)))}: by context length only "
                         "(add --context-lengths L ...)")
    dims = init_distributed(evaluation_tp(info["layout"]["tp"]))
    model, cfg, info = load_model(args.checkpoint)
    if args.overrides:
        cfg = from_dict(apply_overrides(to_dict(cfg), args.overrides))
        if cfg.data.seq_length > cfg.model.max_seq_len:
            raise ConfigError(f"data.seq_length={cfg.data.seq_length} exceeds the checkpoint's model.max_seq_len="
                              f"{cfg.model.max_seq_len}: evaluate at {cfg.model.max_seq_len} or less")
    try:
        tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_backend) if cfg.data.tokenizer else None
    except DataError as e:
        print(f"note: text tasks skipped: {e}")
        tokenizer = None
    if tokenizer is not None:
        check_tokenizer_fits_model(tokenizer, cfg.model.vocab_size)  # a wrong data.tokenizer is an error, not a skip
    valid, filler = validation(model, cfg, args.valid_batches) if args.valid_batches else (None, [])
    ctx = EvalContext(vocab_size=cfg.model.vocab_size, max_len=cfg.model.max_seq_len, tokenizer=tokenizer,
                      filler=filler or list(stdlib_documents(2_000_000)))
    log = print if dims.is_first else (lambda *a: None)
    out = Path(args.out) if args.out else info["root"].parent / "eval" / info["tag"]
    if args.context_lengths:
        results = run_by_length(model, ctx, args.context_lengths, tasks=tasks, samples=args.samples, seed=args.seed, log=log)
        if dims.is_first:
            write_by_length(out, results, cfg, info, args, valid)
        destroy_distributed()
        return 0
    results = run_suite(model, ctx, tasks=tasks, samples=args.samples, seed=args.seed, log=log)
    if dims.is_first:
        out.mkdir(parents=True, exist_ok=True)
        report = {"checkpoint": str(info["root"] / info["tag"]), "step": info.get("step"), "model": cfg.model.name,
                  "copy": f"{cfg.copy.mix}/{cfg.copy.paste}" if cfg.copy.enabled else "off", "samples": args.samples,
                  "seed": args.seed, "validation": valid, "tasks": results}
        (out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
        print_table(results, valid)
        for p in plot(results, out):
            print(f"wrote {p}")
        print(f"wrote {out / 'eval.json'}")
    destroy_distributed()
    return 0


def check_lengths(lengths: list[int], max_len: int, tasks: list[str]) -> None:
    """Before anything is loaded: every context length fits the model and holds the tasks."""
    if any(t not in LONG_TASKS for t in tasks):
        raise UsageError(f"--context-lengths runs {' '.join(LONG_TASKS)}; drop --tasks {' '.join(t for t in tasks if t not in LONG_TASKS)}")
    too_long = [n for n in lengths if n > max_len]
    if too_long:
        raise UsageError(f"--context-lengths {too_long[0]} exceeds the checkpoint's model.max_seq_len={max_len}: give "
                         f"lengths up to {max_len}, or extend the model's context first (model.init_from with a longer "
                         "model.max_seq_len, docs/training.md)")
    too_short = [n for n in lengths if n < MIN_LENGTH]
    if too_short:
        raise UsageError(f"--context-lengths {too_short[0]} is too short for the tasks' facts: give {MIN_LENGTH} or more")


def write_by_length(out: Path, results: dict, cfg, info: dict, args, valid: dict | None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    report = {"checkpoint": str(info["root"] / info["tag"]), "step": info.get("step"), "model": cfg.model.name,
              "copy": f"{cfg.copy.mix}/{cfg.copy.paste}" if cfg.copy.enabled else "off",
              "document_mask": cfg.data.document_mask, "train_seq_length": cfg.data.seq_length,
              "max_seq_len": cfg.model.max_seq_len, "lengths": args.context_lengths, "samples": args.samples,
              "seed": args.seed, "validation": valid, "tasks": results}
    (out / BY_LENGTH).write_text(json.dumps(report, indent=2) + "\n")
    plot_by_length({report["copy"]: report}, out / "by_length.png")
    print(f"wrote {out / BY_LENGTH} and {out / 'by_length.png'}")
    return out / BY_LENGTH


def plot_by_length(reports: dict[str, dict], path: Path) -> None:
    """One panel per task: accuracy (or exact match) against context length, a line per report."""
    from cplm_dist.plotting import figure, lines

    tasks = sorted({t for r in reports.values() for t in r["tasks"]})
    with figure(path, ncols=max(1, len(tasks)), size=(3.4 * max(1, len(tasks)), 3.2)) as axes:
        for ax, task in zip(axes if len(tasks) > 1 else [axes], tasks):
            series = {label: [(int(n), row["accuracy"]) for n, row in r["tasks"].get(task, {}).items()]
                      for label, r in reports.items()}
            lines(ax, series, xlabel="context length (tokens)", ylabel="accuracy / exact match", title=task,
                  ylim=(-0.02, 1.02))
            ax.set_xscale("log", base=2)


def compare(args) -> int:
    """Two runs by context length side by side; a run without its eval_by_length.json is
    evaluated first (in a subprocess, at --context-lengths)."""
    import subprocess

    out = Path(args.out or "runs/compare")
    reports = {}
    for i, item in enumerate(args.compare):
        path = Path(item)
        found = path if path.is_file() else next((p for p in [path / BY_LENGTH, *sorted(path.glob(f"eval/*/{BY_LENGTH}"))]
                                                  if p.is_file()), None)
        if found is None:
            if not args.context_lengths:
                raise UsageError(f"--compare {item}: no {BY_LENGTH} there; add --context-lengths L ... to evaluate it")
            found = out / f"run{'ab'[i]}" / BY_LENGTH
            cmd = [sys.executable, __file__, "--checkpoint", item, "--context-lengths", *map(str, args.context_lengths),
                   "--samples", str(args.samples), "--seed", str(args.seed), "--valid-batches", str(args.valid_batches),
                   "--out", str(found.parent), *(["--tasks", *args.tasks] if args.tasks else []), *args.overrides]
            if subprocess.run(cmd).returncode != 0:
                raise UsageError(f"--compare {item}: its evaluation failed (above)")
        report = json.loads(found.read_text())
        reports[f"{'AB'[i]}: {Path(report['checkpoint']).parent.parent.name} (copy {report['copy']})"] = report
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(reports, indent=2) + "\n")
    plot_by_length(reports, out / "compare.png")
    for task in sorted({t for r in reports.values() for t in r["tasks"]}):
        cells = [" ".join(f"{n}:{row['accuracy']:.2f}" for n, row in r["tasks"].get(task, {}).items()) for r in reports.values()]
        print(f"  {task:<10} " + "   |   ".join(cells))
    print(f"wrote {out / 'compare.json'} and {out / 'compare.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
