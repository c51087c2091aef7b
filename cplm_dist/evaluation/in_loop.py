"""In-loop evaluation (train.eval_tasks): the copy/retrieval suite (cplm_dist.evaluation.tasks) and
a by-length subset (mqar in filler at train.eval_task_lengths: cplm_dist.evaluation.long_context)
on the live model every train.eval_interval steps, so that a ladder's runs have curves, not end points.

    figures = in_loop_eval(engine.module, cfg, dims, tokenizer)   # {"tasks": ..., "by_length": ..., "seconds": ...}

Bounded: per task at most three of its default settings that fit data.seq_length (the shortest,
the middle and the longest), train.eval_task_samples samples each. dp-sharded: dp rank r scores
samples r, r + dp, ...; the sums (nll, hits, scored positions, and where the answers' probability
comes from: tasks.PARTS, `lm_accuracy`, `copy_pointer_accuracy`, `copy_share`) are all-reduced over dp, so every
rank has the figures one process would compute on all the samples. Every tp rank of a replica
scores the same samples (the model is tp-sharded). The seeds are fixed: every evaluation of a run
sees the same samples. It draws no random number from torch and leaves no gradient, so training
is the same with it on or off. The whole model must be on the tp group: parallel.pp = 1, cp = 1,
ZeRO <= 2, refused at start-up otherwise (cplm_dist.config.validation).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from cplm_dist.evaluation.long_context import long_samples, score_tokens
from cplm_dist.evaluation.tasks import (
    GENERATORS, PARTS, EvalContext, default_settings, score_generation, score_positions,
)

SEED = 0
MAX_SETTINGS = 3
COLUMNS = 3 + len(PARTS)


def task_settings(task: str, max_len: int) -> list[dict]:
    """At most MAX_SETTINGS of the task's default settings: the first, the middle and the last."""
    settings = default_settings(task, max_len)
    picks = sorted({0, len(settings) // 2, len(settings) - 1}) if settings else []
    return [settings[i] for i in picks][:MAX_SETTINGS]


def _label(setting: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in setting.items())


def _sums(model, task: str, samples: list, tokenizer) -> list[float]:
    """[summed nll, hits, scored, then the PARTS summed (tasks.score_positions)] of this rank's
    samples (zeros for none, and for the parts of what does not give them)."""
    if not samples:
        return [0.0] * COLUMNS
    if samples[0].prompt_len:  # a generation task: exact match, no loss
        hits = score_generation(model, samples, tokenizer)["exact_match"] * len(samples)
        return [0.0, round(hits), float(len(samples))] + [0.0] * len(PARTS)
    score = score_positions(model, samples) if task != "by_length" else score_tokens(model, samples)
    n = score["n"] if "n" in score else score["queries"]
    return [score["loss"] * n, round(score["accuracy"] * n), float(n)] + [score.get(k, 0.0) * n for k in PARTS]


def _figures(sums: list[float], generation: bool, parts: bool) -> dict:
    nll, hits, n = sums[:3]
    out = {"accuracy": hits / n if n else float("nan"), "n": int(n)}
    if generation:
        return out
    out = {"loss": nll / n if n else float("nan"), **out}
    return {**out, **{k: v / n if n else float("nan") for k, v in zip(PARTS, sums[3:])}} if parts else out


@torch.no_grad()
def in_loop_eval(model, cfg, dims, tokenizer=None) -> dict:
    """The suite on `model` (a CPLM, tp-sharded), the same figures on every rank."""
    start, t = time.perf_counter(), cfg.train
    was_training = model.training
    model.eval()
    ctx = EvalContext(vocab_size=cfg.model.vocab_size, max_len=cfg.data.seq_length, tokenizer=tokenizer)
    runs = []  # (section, task, label, generation, this rank's samples)
    for task in t.eval_tasks:
        if task == "phonebook" and tokenizer is None:
            continue
        for setting in task_settings(task, ctx.max_len):
            samples = GENERATORS[task](ctx, setting, t.eval_task_samples, SEED)
            if max(len(x.ids) + (1 if x.prompt_len else 0) for x in samples) > ctx.max_len:
                continue  # longer than the run's sequences (as run_suite skips it)
            runs.append(("tasks", task, _label(setting), bool(samples[0].prompt_len), samples))
    for length in t.eval_task_lengths:
        runs.append(("by_length", "mqar", str(length), False, long_samples("mqar", ctx, None, length, t.eval_task_samples, SEED)))
    rank, size = dims.dp_rank, dims.dp_size
    sums = [_sums(model, "by_length" if section == "by_length" else task, samples[rank::size], tokenizer)
            for section, task, _, _, samples in runs]
    totals = torch.tensor(sums, dtype=torch.float64).reshape(-1, COLUMNS)
    if size > 1 and len(runs):
        totals = totals.to(next(model.parameters()).device)
        dist.all_reduce(totals, group=dims.dp_group)
    out = {"tasks": {}, "by_length": {}}
    for (section, task, label, generation, _), row in zip(runs, totals.cpu().tolist()):
        out[section].setdefault(task, {})[label] = _figures(row, generation, section == "tasks")
    model.train(was_training)
    out["seconds"] = time.perf_counter() - start
    return out
