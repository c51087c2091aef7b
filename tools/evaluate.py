"""Evaluate a checkpoint: validation perplexity and the copy / retrieval suite.

    python tools/evaluate.py --checkpoint runs/quickstart-20261130-030950
    python tools/evaluate.py --checkpoint runs/x/checkpoints/step-00000200 --tasks induction mqar --samples 64
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 tools/evaluate.py --checkpoint runs/tp2-run    # its tp

Tasks (cplm_dist/evaluation/tasks.py): induction, mqar, phonebook, needle, spamlang. Writes
<out>/eval.json, one PNG per task (accuracy or exact match against context length, pairs or
depth) and prints a table. The run's own config (stored in the checkpoint) gives the model, the
tokenizer and the validation data; data.* overrides point elsewhere. Without the data the
perplexity is skipped and the needle's filler comes from the standard-library corpus.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from cplm_dist.cli import exit_on_usage_error
from cplm_dist.config import apply_overrides, from_dict, to_dict
from cplm_dist.errors import UsageError
from cplm_dist.evaluation.tasks import TASKS, EvalContext, run_suite


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="a run directory, its checkpoints/, or a step-* directory")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--samples", type=int, default=32, help="samples per task setting")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--valid-batches", type=int, default=16, help="validation batches for the perplexity (0: skip)")
    p.add_argument("--out", help="output directory (default: <run>/eval/<step>)")
    p.add_argument("overrides", nargs="*", metavar="data.field=value")
    return p


@torch.no_grad()
def validation(model, cfg, batches: int) -> tuple[dict | None, list[str]]:
    """({loss, perplexity, tokens} or None, decoded validation documents for the needle's filler)."""
    from cplm_dist.data.gpt_data import build_datasets
    from cplm_dist.data.loader import ResumableLoader
    from cplm_dist.evaluation.generation import device_of
    from cplm_dist.vocab_parallel import IGNORE_INDEX
    from cplm_dist.errors import DataError

    micro = cfg.train.micro_batch_size
    try:
        data = build_datasets(cfg, (0, batches * micro, 0))
    except DataError as e:
        print(f"note: no validation perplexity ({e})")
        return None, []
    total, count, filler, device = 0.0, 0, [], device_of(model)
    for batch in ResumableLoader(data.valid, micro):
        out = model(batch["input_ids"].to(device), batch["labels"].to(device))
        total += float(out.nll.sum())
        count += int((batch["labels"] != IGNORE_INDEX).sum())
        filler += [data.tokenizer.decode(row.tolist()) for row in batch["input_ids"]]
    return {"loss": total / count, "perplexity": math.exp(total / count), "tokens": count}, filler


def print_table(results: dict, valid: dict | None) -> None:
    if valid:
        print(f"validation: loss {valid['loss']:.4f}, perplexity {valid['perplexity']:.2f} ({valid['tokens']:,} tokens)")
    for task, rows in results.items():
        for r in rows:
            setting = " ".join(f"{k}={v}" for k, v in r["setting"].items())
            score = (f"exact match {r['exact_match']:.3f}" if "exact_match" in r
                     else f"accuracy {r['accuracy']:.3f}  loss {r['loss']:.3f}")
            print(f"  {task:<10} {setting:<24} {score}  (n={r['n']})")


def plot(results: dict, out: Path) -> list[Path]:
    """Per task: accuracy (or exact match) against its first setting key, a line per other setting."""
    from cplm_dist.profiling.plotting import figure, lines

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
    from cplm_dist.data.corpora import stdlib_documents
    from cplm_dist.data.tokenizer import check_tokenizer_fits_model, load_tokenizer
    from cplm_dist.errors import ConfigError, DataError
    from cplm_dist.checkpoint import load_checkpoint_config, load_model
    from cplm_dist.parallel import destroy_distributed, evaluation_tp, init_distributed

    args = parser().parse_intermixed_args(argv)
    if any(not o.startswith("data.") for o in args.overrides):
        raise UsageError("evaluate.py takes only data.* overrides (the model is the checkpoint's)")
    if args.samples < 1 or args.valid_batches < 0:
        raise UsageError(f"--samples {args.samples} / --valid-batches {args.valid_batches}: need samples >= 1, "
                         "valid-batches >= 0 (0: no perplexity)")
    cfg, info = load_checkpoint_config(args.checkpoint)
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
    results = run_suite(model, ctx, tasks=args.tasks, samples=args.samples, seed=args.seed,
                        log=print if dims.is_first else (lambda *a: None))
    if dims.is_first:
        out = Path(args.out) if args.out else info["root"].parent / "eval" / info["tag"]
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


if __name__ == "__main__":
    sys.exit(main())
