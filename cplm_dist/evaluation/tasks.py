"""The copy / retrieval suite: seeded generators and their scoring.

| task | a sample | scored |
|---|---|---|
| induction | a random token span, then the same span again | loss and accuracy on the second copy (from its 2nd token) |
| mqar | N key-value token pairs, then each key queried once at a random place among noise tokens | accuracy of the value after each queried key |
| phonebook | N "Name: ddd-dddd" lines, then "The number of Name is" | exact match of the greedily generated number |
| needle | a "secret code" sentence at a chosen depth in filler text, then the question | exact match of the generated code |
| spamlang | one random symbol repeated, drawn from the whole vocabulary | loss and accuracy from the 2nd position on |

Token tasks draw ids from [first_id, vocab_size) (first_id skips the tokenizer's special ids);
text tasks go through the tokenizer. Each generator is deterministic in (seed, setting). A model
is anything with `vocab_size` and `next_token_logprobs(ids) -> (B, T, V)` (a CPLM, or the
the oracle and uniform reference models in tests/reference_models.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

import torch

from cplm_dist.evaluation.generation import device_of, generate

TASKS = ("induction", "mqar", "phonebook", "needle", "spamlang")


@dataclass
class Sample:
    ids: list[int]  # the whole sequence (prompt + answer for generation tasks)
    scored: list[int] = field(default_factory=list)  # positions t whose prediction of ids[t + 1] is scored
    prompt_len: int | None = None  # generation tasks: ids[:prompt_len] is the prompt
    answer: str | None = None  # generation tasks: the text the generation must start with


@dataclass
class EvalContext:
    vocab_size: int
    max_len: int
    first_id: int = 4
    tokenizer: object | None = None  # cplm_dist.data.tokenizer.Tokenizer, for the text tasks
    filler: list[str] | None = None  # needle: documents to hide the fact in (e.g. the validation split)


# --- generators ----------------------------------------------------------------------------------


def _rng(seed: int, task: str, setting: dict, i: int) -> random.Random:
    return random.Random(f"{seed}|{task}|{sorted(setting.items())}|{i}")


def induction(ctx: EvalContext, setting: dict, n: int, seed: int) -> list[Sample]:
    span = setting["span"]
    out = []
    for i in range(n):
        r = _rng(seed, "induction", setting, i)
        s = [r.randrange(ctx.first_id, ctx.vocab_size) for _ in range(span)]
        out.append(Sample(s + s, scored=list(range(span, 2 * span - 1))))
    return out


def draw_pairs(r: random.Random, ctx: EvalContext, pairs: int) -> tuple[list[int], list[int], list[int]]:
    """(the ids shuffled, `pairs` distinct keys: the pool's first, a random value for each): MQAR's
    draw, here and at every context length (cplm_dist.evaluation.long_context)."""
    pool = list(range(ctx.first_id, ctx.vocab_size))
    r.shuffle(pool)
    return pool, pool[:pairs], [r.randrange(ctx.first_id, ctx.vocab_size) for _ in range(pairs)]


def mqar(ctx: EvalContext, setting: dict, n: int, seed: int) -> list[Sample]:
    pairs, length = setting["pairs"], setting["length"]
    if length < 4 * pairs:
        raise ValueError(f"mqar: length {length} too short for {pairs} pairs")
    out = []
    for i in range(n):
        r = _rng(seed, "mqar", setting, i)
        pool, keys, values = draw_pairs(r, ctx, pairs)
        noise = pool[pairs:]  # never a key, so a query is unambiguous
        ids = [t for kv in zip(keys, values) for t in kv]
        region = length - 2 * pairs
        slots = sorted(r.sample(range(region // 2), pairs))  # non-overlapping (key, value) slots
        order = list(range(pairs))
        r.shuffle(order)
        tail = [r.choice(noise) for _ in range(region)]
        scored = []
        for slot, k in zip(slots, order):
            tail[2 * slot], tail[2 * slot + 1] = keys[k], values[k]
            scored.append(2 * pairs + 2 * slot)
        out.append(Sample(ids + tail, scored=scored))
    return out


def _name(r: random.Random) -> str:
    syllables = ["ka", "lo", "mi", "ren", "tas", "vo", "bel", "dor", "fin", "gar", "hul", "jen", "pra", "sol", "tir", "zu"]
    return "".join(r.choice(syllables) for _ in range(r.randint(2, 3))).capitalize()


def _encode(ctx: EvalContext, text: str) -> list[int]:
    if ctx.tokenizer is None:
        raise ValueError("the text tasks (phonebook, needle) need a tokenizer")
    return ctx.tokenizer.encode(text)


def phonebook(ctx: EvalContext, setting: dict, n: int, seed: int) -> list[Sample]:
    entries = setting["entries"]
    out = []
    for i in range(n):
        r = _rng(seed, "phonebook", setting, i)
        names = []
        while len(names) < entries:
            name = _name(r)
            if name not in names:
                names.append(name)
        numbers = [f"{r.randint(200, 999)}-{r.randint(0, 9999):04d}" for _ in names]
        who = r.randrange(entries)
        prompt = "".join(f"{a}: {b}\n" for a, b in zip(names, numbers)) + f"The number of {names[who]} is "
        p, a = _encode(ctx, prompt), _encode(ctx, numbers[who])
        out.append(Sample(p + a, prompt_len=len(p), answer=numbers[who]))
    return out


def needle(ctx: EvalContext, setting: dict, n: int, seed: int) -> list[Sample]:
    length, depth = setting["length"], setting["depth"]
    if not ctx.filler:
        raise ValueError("needle needs filler documents")
    filler_ids = []
    for doc in ctx.filler:
        filler_ids += _encode(ctx, doc + "\n")
        if len(filler_ids) > 4 * length:
            break
    out = []
    for i in range(n):
        r = _rng(seed, "needle", setting, i)
        code = f"{r.randint(10000, 99999)}"
        fact, question = _encode(ctx, f" The secret code is {code}. "), _encode(ctx, "\nWhat is the secret code? The secret code is ")
        answer = _encode(ctx, code)
        room = length - len(fact) - len(question) - len(answer) - 1  # +1: the token generated after the answer
        if room < 1:
            raise ValueError(f"needle: length {length} leaves no room for filler")
        start = r.randrange(0, max(1, len(filler_ids) - room))
        hay = (filler_ids * (1 + room // max(1, len(filler_ids))))[start:start + room]
        at = round(depth * len(hay))
        p = hay[:at] + fact + hay[at:] + question
        out.append(Sample(p + answer, prompt_len=len(p), answer=code))
    return out


def spamlang(ctx: EvalContext, setting: dict, n: int, seed: int) -> list[Sample]:
    length = setting["length"]
    return [Sample([_rng(seed, "spamlang", setting, i).randrange(ctx.first_id, ctx.vocab_size)] * length,
                   scored=list(range(1, length - 1))) for i in range(n)]


GENERATORS: dict[str, Callable] = {"induction": induction, "mqar": mqar, "phonebook": phonebook, "needle": needle,
                                   "spamlang": spamlang}


def default_settings(task: str, max_len: int) -> list[dict]:
    """Settings that fit in max_len tokens; the first key is the plot's x axis."""
    if task == "induction":
        return [{"span": s} for s in (8, 16, 32, 64, 128, 256) if 2 * s <= max_len]
    if task == "mqar":
        lengths = [L for L in (64, 128, 256, 512) if L <= max_len]
        return [{"pairs": p, "length": L} for L in lengths for p in (2, 4, 8, 16) if 4 * p <= L]
    if task == "phonebook":
        return [{"entries": e} for e in (2, 4, 8, 16, 32) if 12 * e + 16 <= max_len]
    if task == "needle":
        return [{"depth": d, "length": L} for L in (64, 128, 256, 512) if L <= max_len for d in (0.0, 0.25, 0.5, 0.75, 1.0)]
    if task == "spamlang":
        return [{"length": L} for L in (8, 32, 128, 512) if L <= max_len]
    raise ValueError(f"unknown task {task!r}: choose from {list(TASKS)}")


# --- scoring -------------------------------------------------------------------------------------


@torch.no_grad()
def score_positions(model, samples: list[Sample], batch_size: int = 16) -> dict:
    nll, correct, count, device = 0.0, 0, 0, device_of(model)
    for start in range(0, len(samples), batch_size):
        batch = samples[start:start + batch_size]
        ids = torch.tensor([s.ids for s in batch], device=device)
        logprobs = model.next_token_logprobs(ids)  # (B, T, V)
        for b, s in enumerate(batch):
            pos = torch.tensor(s.scored, device=device)
            target = ids[b, pos + 1]
            lp = logprobs[b, pos]
            nll -= float(lp.gather(-1, target[:, None]).sum())
            correct += int((lp.argmax(-1) == target).sum())
            count += len(s.scored)
    return {"loss": nll / count, "accuracy": correct / count, "n": count}


@torch.no_grad()
def score_generation(model, samples: list[Sample], tokenizer) -> dict:
    hits, device = 0, device_of(model)
    for s in samples:
        answer_len = len(s.ids) - s.prompt_len
        out = generate(model, torch.tensor([s.ids[: s.prompt_len]], device=device), answer_len + 1)
        text = tokenizer.decode(out.tokens[0].tolist())
        hits += text.strip().startswith(s.answer)
    return {"exact_match": hits / len(samples), "n": len(samples)}


def run_suite(model, ctx: EvalContext, tasks=TASKS, samples: int = 32, seed: int = 0, settings: dict | None = None,
              log=print) -> dict:
    """{task: [{"setting": ..., "loss"/"accuracy" or "exact_match": ..., "n": ...}, ...]}"""
    results = {}
    for task in tasks:
        if task in ("phonebook", "needle") and (ctx.tokenizer is None or (task == "needle" and not ctx.filler)):
            log(f"{task}: skipped (needs a tokenizer{' and filler text' if task == 'needle' else ''})")
            continue
        rows = []
        for setting in (settings or {}).get(task) or default_settings(task, ctx.max_len):
            batch = GENERATORS[task](ctx, setting, samples, seed)
            if max(len(s.ids) + (1 if s.prompt_len else 0) for s in batch) > ctx.max_len:
                continue  # a setting longer than the model's context
            score = score_generation(model, batch, ctx.tokenizer) if batch[0].prompt_len else score_positions(model, batch)
            rows.append({"setting": setting, **score})
        results[task] = rows
    return results
