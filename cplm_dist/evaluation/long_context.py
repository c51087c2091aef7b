"""Retrieval and copying by context length: the facts of each task hidden in filler text of about
L tokens, and the by-length runner that prefills long prompts in chunks.

| task | a sample of L tokens | scored |
|---|---|---|
| needle | `The secret code is NNNNN.` at a depth (0, .25, .5, .75, 1 in turn) of the filler, then the question | exact match of the generated code |
| phonebook | 4 (2 below 256 tokens) `Name: ddd-dddd` lines spread over the filler, then `The number of Name is` | exact match of the number |
| mqar | 8 key-value token pairs spread over the first half, each key queried once in the second half (filler tokens with the keys taken out) | accuracy of the value after each queried key |
| vartrack | 2 chains (1 below 256 tokens) `VAR a = NNNNN.` ... `VAR b = VAR a.` ... `VAR c = VAR b.` interleaved in the filler, then `What is the value of VAR c?` | exact match (two hops) |

The text tasks are built from `Facts` (pieces of text with where they go, a question, an answer)
spliced into a window of a `Haystack`, a stream of filler units: token ids here (the run's
validation documents or the standard-library corpus, tokenized), characters in the lm-eval
group `cplm_local_long` (harness_tasks/long_tasks.py), so both share every generator; the needle,
the phone book, MQAR, the haystack and the scoring are the suite's (cplm_dist.evaluation.tasks). A
text sample is exactly L tokens with its answer and the token generated after it; an mqar sample
is L tokens. Each is deterministic in (seed, task, length, index).

Scoring never makes a (T, V) tensor: prompts are fed `chunk` tokens at a time into one decode
state (`generation.prefill`: the last position's (B, 1, V) only; `chunked_score`: CPLM.score,
which reads the targets' log-probabilities about 512 rows at a time), so the largest tensors of a
16k prompt are a chunk's activations and its attention over the cache.
"""

from __future__ import annotations

import random
import string
from typing import Callable

import torch

from cplm_dist.evaluation.tasks import (EvalContext, Facts, Haystack, Sample, compose, exact_matches, mqar_sample,
                                        needle_facts, phone_book, position_totals, sample_rng, token_haystack, whole_score)

LONG_TASKS = ("needle", "phonebook", "mqar", "vartrack")
TEXT_TASKS = ("needle", "phonebook", "vartrack")
PREFILL_CHUNK = 1024
MIN_LENGTH = 128  # the shortest context every task fits in (phonebook takes about 90 tokens with a 512-id tokenizer)
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
PHONEBOOK_ENTRIES, MQAR_PAIRS, VAR_CHAINS, VAR_HOPS = 4, 8, 2, 2


# --- the text tasks' facts ------------------------------------------------------------------------


def needle_at_depth(r: random.Random, i: int) -> Facts:
    """The needle at the depths in turn (DEPTHS[i % 5])."""
    return needle_facts(r, DEPTHS[i % len(DEPTHS)])


def phonebook_facts(r: random.Random, i: int, entries: int = PHONEBOOK_ENTRIES) -> Facts:
    names, numbers = phone_book(r, entries)
    where = sorted(r.random() for _ in names)
    who = r.randrange(entries)
    return Facts([(w, f"\n{a}: {b}\n") for w, a, b in zip(where, names, numbers)],
                 f"\nThe number of {names[who]} is ", numbers[who])


def vartrack_facts(r: random.Random, i: int, chains: int = VAR_CHAINS, hops: int = VAR_HOPS) -> Facts:
    """`chains` chains of hops + 1 variables (a value, then each variable set to the one before),
    interleaved, each in its own order; the question asks for the last variable of one chain."""
    names: list[str] = []
    while len(names) < chains * (hops + 1):
        name = "".join(r.choice(string.ascii_uppercase) for _ in range(3))
        if name not in names:
            names.append(name)
    values = r.sample(range(10000, 100000), chains)
    statements = []
    for c in range(chains):
        chain = names[c * (hops + 1):(c + 1) * (hops + 1)]
        statements.append([f"\nVAR {chain[0]} = {values[c]}.\n"] +
                          [f"\nVAR {b} = VAR {a}.\n" for a, b in zip(chain, chain[1:])])
    turns = [c for c in range(chains) for _ in range(hops + 1)]
    r.shuffle(turns)  # the chains interleaved, each chain's statements in order
    where = sorted(r.random() for _ in turns)
    pieces = [(w, statements[c].pop(0)) for w, c in zip(where, turns)]
    asked = r.randrange(chains)
    last = names[asked * (hops + 1) + hops]
    return Facts(pieces, f"\nWhat is the value of VAR {last}? The value of VAR {last} is ", f"{values[asked]}")


FACTS: dict[str, Callable[[random.Random, int], Facts]] = {"needle": needle_at_depth, "phonebook": phonebook_facts,
                                                           "vartrack": vartrack_facts}


def _rng(seed: int, task: str, length: int, i: int) -> random.Random:
    return sample_rng(seed, f"long-{task}", length, i)


# below SHORT tokens the text tasks hold fewer facts (a 512-id tokenizer spends ~150 tokens on two chains)
SHORT = 256
SHORT_FACTS = {"phonebook": {"entries": 2}, "vartrack": {"chains": 1}}


def text_samples(task: str, ctx: EvalContext, hay: Haystack, length: int, n: int, seed: int) -> list[Sample]:
    out = []
    fewer = SHORT_FACTS.get(task, {}) if length < SHORT else {}
    for i in range(n):
        r = _rng(seed, task, length, i)
        facts = FACTS[task](r, i, **fewer)
        prompt, answer = compose(facts, hay, length, ctx.tokenizer.encode, r, task)
        out.append(Sample(prompt + answer, prompt_len=len(prompt), answer=facts.answer))
    return out


# --- the token task -------------------------------------------------------------------------------


def mqar_samples(ctx: EvalContext, hay: Haystack | None, length: int, n: int, seed: int,
                 pairs: int = MQAR_PAIRS) -> list[Sample]:
    """`length` tokens of filler (hay's tokens without the keys' ids; without a haystack, random
    non-key tokens), the pairs written over it at random slots of the first half, each key queried
    once, in a random order, at random slots of the second half (tasks.mqar_sample, spread)."""
    if length // 2 < 2 * pairs:
        raise ValueError(f"mqar: length {length} too short for {pairs} pairs")
    return [mqar_sample(_rng(seed, "mqar", length, i), ctx, pairs, length, spread=True, hay=hay) for i in range(n)]


def long_samples(task: str, ctx: EvalContext, hay: Haystack | None, length: int, n: int, seed: int) -> list[Sample]:
    if task == "mqar":
        return mqar_samples(ctx, hay, length, n, seed)
    if task not in FACTS:
        raise ValueError(f"unknown task {task!r}: choose from {list(LONG_TASKS)}")
    if hay is None or ctx.tokenizer is None:
        raise ValueError(f"{task} needs a tokenizer and filler text")
    return text_samples(task, ctx, hay, length, n, seed)


# --- scoring, prompts fed in chunks ---------------------------------------------------------------


@torch.no_grad()
def chunked_score(model, ids: torch.Tensor, targets: torch.Tensor, chunk: int = PREFILL_CHUNK):
    """(log p(targets), whether each is the most likely id), each (B, T), as `model.score(ids,
    targets)` gives them, with ids fed `chunk` tokens at a time into one decode state. Targets
    below 0 (IGNORE_INDEX): 0, False. A model without `score` (the reference models in tests):
    from its full (B, T, V) distribution."""
    if not hasattr(model, "score"):
        return whole_score(model, ids, targets)
    state = model.new_decode_state(*ids.shape)
    parts = [model.score(ids[:, t:t + chunk], targets[:, t:t + chunk], state) for t in range(0, ids.shape[1], chunk)]
    return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1)


def score_tokens(model, samples: list[Sample], chunk: int = PREFILL_CHUNK, batch_size: int = 4) -> dict:
    """Accuracy and loss of the value after each scored position; samples of equal length."""
    nll, correct, count = position_totals(model, samples, batch_size, lambda m, ids, t: chunked_score(m, ids, t, chunk))
    return {"accuracy": correct / count, "loss": nll / count, "metric": "accuracy", "samples": len(samples),
            "queries": count, "tokens": max(len(s.ids) for s in samples)}


def score_text(model, samples: list[Sample], tokenizer, chunk: int = PREFILL_CHUNK) -> dict:
    """Exact match of the greedy generation (the prompt prefilled in chunks), one sample at a time."""
    return {"accuracy": exact_matches(model, samples, tokenizer, chunk) / len(samples), "metric": "exact_match",
            "samples": len(samples), "tokens": max(len(s.ids) + 1 for s in samples)}


def run_by_length(model, ctx: EvalContext, lengths: list[int], tasks=LONG_TASKS, samples: int = 16, seed: int = 0,
                  chunk: int = PREFILL_CHUNK, log=print) -> dict:
    """{task: {str(length): {accuracy, metric, samples, tokens[, loss, queries]}}}; the text tasks
    skipped (logged) without a tokenizer or filler."""
    hay = token_haystack(ctx, 2 * max(lengths)) if ctx.tokenizer is not None and ctx.filler else None
    results = {}
    for task in tasks:
        if task in TEXT_TASKS and hay is None:
            log(f"{task}: skipped (needs a tokenizer and filler text)")
            continue
        rows = {}
        for length in lengths:
            batch = long_samples(task, ctx, hay, length, samples, seed)
            rows[str(length)] = (score_text(model, batch, ctx.tokenizer, chunk) if task in TEXT_TASKS
                                 else score_tokens(model, batch, chunk))
            log(f"  {task:<10} {length:>7} tokens  {rows[str(length)]['metric']} {rows[str(length)]['accuracy']:.3f}")
        results[task] = rows
    return results
