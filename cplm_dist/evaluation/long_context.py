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
group `cplm_local_long` (harness_tasks/long_tasks.py), so both share every generator. A text
sample is exactly L tokens with its answer and the token generated after it; an mqar sample is
L tokens. Each is deterministic in (seed, task, length, index).

Scoring never makes a (T, V) tensor: prompts are fed `chunk` tokens at a time into one decode
state (`generation.prefill`: the last position's (B, 1, V) only; `chunked_score`: CPLM.score,
which reads the targets' log-probabilities about 512 rows at a time), so the largest tensors of a
16k prompt are a chunk's activations and its attention over the cache.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Callable

import torch

from cplm_dist.evaluation.generation import device_of, generate
from cplm_dist.evaluation.tasks import EvalContext, Sample, _name, draw_pairs

LONG_TASKS = ("needle", "phonebook", "mqar", "vartrack")
TEXT_TASKS = ("needle", "phonebook", "vartrack")
PREFILL_CHUNK = 1024
MIN_LENGTH = 128  # the shortest context every task fits in (phonebook takes about 90 tokens with a 512-id tokenizer)
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
PHONEBOOK_ENTRIES, MQAR_PAIRS, VAR_CHAINS, VAR_HOPS = 4, 8, 2, 2


# --- filler ----------------------------------------------------------------------------------------


class Haystack:
    """A stream of filler units (a list of token ids, or a str of characters) to cut windows from."""

    def __init__(self, stream):
        if not stream:
            raise ValueError("a haystack needs filler")
        self.stream = stream

    def window(self, n: int, rng: random.Random):
        """n units from a random start, wrapping round the stream (repeated when shorter than n)."""
        s, start = self.stream, rng.randrange(len(self.stream))
        out = s[start:start + n]
        while len(out) < n:
            out += s[: n - len(out)]
        return out


def token_haystack(ctx: EvalContext, need: int) -> Haystack:
    """The filler documents (ctx.filler, in order) tokenized until there are `need` tokens."""
    ids: list[int] = []
    for doc in ctx.filler:
        ids += ctx.tokenizer.encode(doc + "\n")
        if len(ids) >= need:
            break
    return Haystack(ids)


# --- the text tasks' facts ------------------------------------------------------------------------


@dataclass
class Facts:
    pieces: list[tuple[float, str]]  # (where in the filler, 0..1; the text), in the order they must come
    question: str  # asked after the filler
    answer: str  # what the generation must start with
    choices: list[str] | None = None  # multiple choice (lm-eval): the answer among others


def needle_facts(r: random.Random, i: int) -> Facts:
    code = f"{r.randint(10000, 99999)}"
    return Facts([(DEPTHS[i % len(DEPTHS)], f"\nThe secret code is {code}.\n")],
                 "\nWhat is the secret code? The secret code is ", code)


def phonebook_facts(r: random.Random, i: int, entries: int = PHONEBOOK_ENTRIES) -> Facts:
    names: list[str] = []
    while len(names) < entries:
        name = _name(r)
        if name not in names:
            names.append(name)
    numbers = [f"{r.randint(200, 999)}-{r.randint(0, 9999):04d}" for _ in names]
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


FACTS: dict[str, Callable[[random.Random, int], Facts]] = {"needle": needle_facts, "phonebook": phonebook_facts,
                                                           "vartrack": vartrack_facts}


def _rng(seed: int, task: str, length: int, i: int) -> random.Random:
    return random.Random(f"{seed}|long-{task}|{length}|{i}")


def splice(hay, pieces: list[tuple[float, object]]):
    """`hay` (a list or a str) with each piece inserted at its fraction of the way through, in
    order; in text, at the start of the line there."""
    out, last = hay[:0], 0
    for frac, piece in pieces:
        at = round(frac * len(hay))
        if isinstance(hay, str):
            at = hay.rfind("\n", 0, at) + 1
        at = max(last, at)
        out, last = out + hay[last:at] + piece, at
    return out + hay[last:]


def compose(facts: Facts, hay: Haystack, length: int, encode: Callable, r: random.Random, task: str):
    """(prompt, answer) in units of `hay` (encode: text -> those units): the facts spliced into a
    window of filler and the question after it, length units in all with the answer and one more
    (the token generated after it)."""
    pieces = [(frac, encode(text)) for frac, text in facts.pieces]
    question, answer = encode(facts.question), encode(facts.answer)
    room = length - sum(len(p) for _, p in pieces) - len(question) - len(answer) - 1
    if room < 1:
        raise ValueError(f"{task}: length {length} leaves no room for filler ({length - room} for the facts and question)")
    return splice(hay.window(room, r), pieces) + question, answer


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
    once, in a random order, at random slots of the second half."""
    half = length // 2
    if half < 2 * pairs:
        raise ValueError(f"mqar: length {length} too short for {pairs} pairs")
    out = []
    for i in range(n):
        r = _rng(seed, "mqar", length, i)
        pool, keys, values = draw_pairs(r, ctx, pairs)
        if hay is not None:
            taken = set(keys)
            ids = [t for t in hay.window(2 * length, r) if t not in taken]
            ids = (ids * (1 + length // max(1, len(ids))))[:length]
        else:
            ids = [r.choice(pool[pairs:]) for _ in range(length)]
        order = list(range(pairs))
        r.shuffle(order)
        scored = []
        for k, slot in enumerate(sorted(r.sample(range(half // 2), pairs))):
            ids[2 * slot], ids[2 * slot + 1] = keys[k], values[k]
        for k, slot in zip(order, sorted(r.sample(range((length - half) // 2), pairs))):
            at = half + 2 * slot
            ids[at], ids[at + 1] = keys[k], values[k]
            scored.append(at)
        out.append(Sample(ids, scored=scored))
    return out


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
        lp = model.next_token_logprobs(ids)
        safe = targets.clamp(min=0)
        logp = lp.gather(-1, safe[..., None]).squeeze(-1)
        return logp.masked_fill(targets < 0, 0.0), (lp.argmax(-1) == safe) & (targets >= 0)
    state = model.new_decode_state(*ids.shape)
    parts = [model.score(ids[:, t:t + chunk], targets[:, t:t + chunk], state) for t in range(0, ids.shape[1], chunk)]
    return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1)


@torch.no_grad()
def score_tokens(model, samples: list[Sample], chunk: int = PREFILL_CHUNK, batch_size: int = 4) -> dict:
    """Accuracy and loss of the value after each scored position; samples of equal length."""
    nll, correct, count, device = 0.0, 0, 0, device_of(model)
    for start in range(0, len(samples), batch_size):
        batch = samples[start:start + batch_size]
        ids = torch.tensor([s.ids for s in batch], device=device)
        targets = torch.full_like(ids, -100)
        for b, s in enumerate(batch):
            pos = torch.tensor(s.scored, device=device)
            targets[b, pos] = ids[b, pos + 1]
        logp, greedy = chunked_score(model, ids, targets, chunk)
        scored = targets >= 0
        nll -= float(logp[scored].sum())
        correct += int(greedy[scored].sum())
        count += int(scored.sum())
    return {"accuracy": correct / count, "loss": nll / count, "metric": "accuracy", "samples": len(samples),
            "queries": count, "tokens": max(len(s.ids) for s in samples)}


@torch.no_grad()
def score_text(model, samples: list[Sample], tokenizer, chunk: int = PREFILL_CHUNK) -> dict:
    """Exact match of the greedy generation (the prompt prefilled in chunks), one sample at a time."""
    hits, device = 0, device_of(model)
    for s in samples:
        answer_len = len(s.ids) - s.prompt_len
        out = generate(model, torch.tensor([s.ids[: s.prompt_len]], device=device), answer_len + 1, prefill_chunk=chunk)
        hits += tokenizer.decode(out.tokens[0].tolist()).strip().startswith(s.answer)
    return {"accuracy": hits / len(samples), "metric": "exact_match", "samples": len(samples),
            "tokens": max(len(s.ids) + 1 for s in samples)}


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
