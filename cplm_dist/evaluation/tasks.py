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

Each task is generated and scored here once, for the suite and for evaluation by context length
(cplm_dist.evaluation.long_context, which lays the same facts out in about L tokens of filler):
`mqar_sample`, `phone_book`, `needle_facts` spliced into a `Haystack` by `compose`, `sample_rng`;
`position_totals` and `exact_matches` score them.
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


def sample_rng(seed: int, task: str, key, i: int) -> random.Random:
    """The generator of sample `i`: the suite keys it by its setting's items, evaluation by context
    length by `long-<task>` and the length, the lm-eval group cplm_local_long by
    `lm-eval-long-<task>` and the length in characters."""
    return random.Random(f"{seed}|{task}|{key}|{i}")


def _rng(seed: int, task: str, setting: dict, i: int) -> random.Random:
    return sample_rng(seed, task, sorted(setting.items()), i)


def induction(ctx: EvalContext, setting: dict, n: int, seed: int) -> list[Sample]:
    span = setting["span"]
    out = []
    for i in range(n):
        r = _rng(seed, "induction", setting, i)
        s = [r.randrange(ctx.first_id, ctx.vocab_size) for _ in range(span)]
        out.append(Sample(s + s, scored=list(range(span, 2 * span - 1))))
    return out


def draw_pairs(r: random.Random, ctx: EvalContext, pairs: int) -> tuple[list[int], list[int], list[int]]:
    """(the ids shuffled, `pairs` distinct keys: the pool's first, a random value for each)."""
    pool = list(range(ctx.first_id, ctx.vocab_size))
    r.shuffle(pool)
    return pool, pool[:pairs], [r.randrange(ctx.first_id, ctx.vocab_size) for _ in range(pairs)]


def mqar_sample(r: random.Random, ctx: EvalContext, pairs: int, length: int, *, spread: bool = False,
                hay: Haystack | None = None) -> Sample:
    """`length` ids holding `pairs` (key, value) pairs, then each key queried once, in a random order,
    its value after it (the scored positions). The suite's (spread=False): the pairs first, the
    queries at random slots of the rest, among noise ids (never a key, so a query is unambiguous).
    By context length (spread=True): filler over the whole length (hay's tokens without the keys'
    ids; without a haystack, noise), the pairs written at random slots of the first half, the
    queries at random slots of the second."""
    pool, keys, values = draw_pairs(r, ctx, pairs)
    noise, order = pool[pairs:], list(range(pairs))
    if spread:
        if hay is not None:
            taken = set(keys)
            ids = [t for t in hay.window(2 * length, r) if t not in taken]
            ids = (ids * (1 + length // max(1, len(ids))))[:length]
        else:
            ids = [r.choice(noise) for _ in range(length)]
        r.shuffle(order)
        first = length // 2
        key_slots = sorted(r.sample(range(first // 2), pairs))
        query_slots = sorted(r.sample(range((length - first) // 2), pairs))
    else:
        first = 2 * pairs
        query_slots = sorted(r.sample(range((length - first) // 2), pairs))  # non-overlapping (key, value) slots
        r.shuffle(order)
        ids, key_slots = [0] * first + [r.choice(noise) for _ in range(length - first)], range(pairs)
    for k, slot in enumerate(key_slots):
        ids[2 * slot], ids[2 * slot + 1] = keys[k], values[k]
    scored = []
    for k, slot in zip(order, query_slots):
        at = first + 2 * slot
        ids[at], ids[at + 1] = keys[k], values[k]
        scored.append(at)
    return Sample(ids, scored=scored)


def mqar(ctx: EvalContext, setting: dict, n: int, seed: int) -> list[Sample]:
    pairs, length = setting["pairs"], setting["length"]
    if length < 4 * pairs:
        raise ValueError(f"mqar: length {length} too short for {pairs} pairs")
    return [mqar_sample(_rng(seed, "mqar", setting, i), ctx, pairs, length) for i in range(n)]


def _name(r: random.Random) -> str:
    syllables = ["ka", "lo", "mi", "ren", "tas", "vo", "bel", "dor", "fin", "gar", "hul", "jen", "pra", "sol", "tir", "zu"]
    return "".join(r.choice(syllables) for _ in range(r.randint(2, 3))).capitalize()


def phone_book(r: random.Random, entries: int) -> tuple[list[str], list[str]]:
    """(`entries` distinct names, a ddd-dddd number for each)."""
    names: list[str] = []
    while len(names) < entries:
        name = _name(r)
        if name not in names:
            names.append(name)
    return names, [f"{r.randint(200, 999)}-{r.randint(0, 9999):04d}" for _ in names]


def _encode(ctx: EvalContext, text: str) -> list[int]:
    if ctx.tokenizer is None:
        raise ValueError("the text tasks (phonebook, needle) need a tokenizer")
    return ctx.tokenizer.encode(text)


def phonebook(ctx: EvalContext, setting: dict, n: int, seed: int) -> list[Sample]:
    entries = setting["entries"]
    out = []
    for i in range(n):
        r = _rng(seed, "phonebook", setting, i)
        names, numbers = phone_book(r, entries)
        who = r.randrange(entries)
        prompt = "".join(f"{a}: {b}\n" for a, b in zip(names, numbers)) + f"The number of {names[who]} is "
        p, a = _encode(ctx, prompt), _encode(ctx, numbers[who])
        out.append(Sample(p + a, prompt_len=len(p), answer=numbers[who]))
    return out


# --- facts hidden in filler (the needle here; by context length every text task) -----------------


class Haystack:
    """A stream of filler units (a list of token ids, or a str of characters) to cut windows from."""

    def __init__(self, stream, wrap: bool = True):
        if not stream:
            raise ValueError("a haystack needs filler")
        self.stream, self.wrap = stream, wrap

    def window(self, n: int, rng: random.Random):
        """n units from a random start (anywhere, wrapping round the stream; wrap=False: one from
        which n fit), the stream repeated when shorter than n."""
        s = self.stream
        start = rng.randrange(len(s)) if self.wrap else rng.randrange(max(1, len(s) - n))
        out = s[start:start + n]
        while len(out) < n:
            out += s[: n - len(out)]
        return out


def token_haystack(ctx: EvalContext, need: int, wrap: bool = True) -> Haystack:
    """The filler documents (ctx.filler, in order) tokenized until there are `need` tokens."""
    ids: list[int] = []
    for doc in ctx.filler:
        ids += _encode(ctx, doc + "\n")
        if len(ids) >= need:
            break
    return Haystack(ids, wrap)


@dataclass
class Facts:
    pieces: list[tuple[float, str]]  # (where in the filler, 0..1; the text), in the order they must come
    question: str  # asked after the filler
    answer: str  # what the generation must start with
    choices: list[str] | None = None  # multiple choice (lm-eval): the answer among others


def needle_facts(r: random.Random, depth: float, around: str = "\n") -> Facts:
    """A secret code's sentence (between two `around`) at `depth` of the filler, and the question."""
    code = f"{r.randint(10000, 99999)}"
    return Facts([(depth, f"{around}The secret code is {code}.{around}")],
                 "\nWhat is the secret code? The secret code is ", code)


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


def needle(ctx: EvalContext, setting: dict, n: int, seed: int) -> list[Sample]:
    length, depth = setting["length"], setting["depth"]
    if not ctx.filler:
        raise ValueError("needle needs filler documents")
    hay = token_haystack(ctx, 4 * length + 1, wrap=False)
    out = []
    for i in range(n):
        r = _rng(seed, "needle", setting, i)
        facts = needle_facts(r, depth, around=" ")
        prompt, answer = compose(facts, hay, length, lambda text: _encode(ctx, text), r, "needle")
        out.append(Sample(prompt + answer, prompt_len=len(prompt), answer=facts.answer))
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
def whole_score(model, ids: torch.Tensor, targets: torch.Tensor):
    """(log p(targets), whether each is the most likely id), each (B, T), from the model's full
    (B, T, V) distribution. Targets below 0 (IGNORE_INDEX): 0, False."""
    lp = model.next_token_logprobs(ids)
    safe = targets.clamp(min=0)
    logp = lp.gather(-1, safe[..., None]).squeeze(-1)
    return logp.masked_fill(targets < 0, 0.0), (lp.argmax(-1) == safe) & (targets >= 0)


PARTS = ("lm_accuracy", "copy_pointer_accuracy", "copy_share")  # next_token.components


@torch.no_grad()
def parts_score(model, ids: torch.Tensor, targets: torch.Tensor):
    """whole_score's pair and, for a CPLM, next_token.components at the targets (where the answer's
    probability comes from: the LM head alone, the copy head's pointer, the mix's copy share);
    a model without `score` (the reference models in tests): whole_score's pair and no parts."""
    if not hasattr(model, "score"):
        return (*whole_score(model, ids, targets), {})
    return model.score(ids, targets, parts=True)


@torch.no_grad()
def position_totals(model, samples: list[Sample], batch_size: int, score: Callable = whole_score,
                    parts: dict | None = None) -> tuple[float, int, int]:
    """(negative log-likelihood, correct, count) summed over every sample's scored positions'
    next ids, `batch_size` samples (of one length) a batch through `score(model, ids, targets)`:
    whole_score, parts_score, or the by-length prefill in chunks (long_context.chunked_score). A
    score that also gives per-position parts (parts_score) has them summed into `parts`."""
    nll, correct, count, device = 0.0, 0, 0, device_of(model)
    for start in range(0, len(samples), batch_size):
        batch = samples[start:start + batch_size]
        ids = torch.tensor([s.ids for s in batch], device=device)
        targets, positions = torch.full_like(ids, -100), [torch.tensor(s.scored, device=device) for s in batch]
        for b, pos in enumerate(positions):
            targets[b, pos] = ids[b, pos + 1]
        logp, greedy, *more = score(model, ids, targets)
        for b, pos in enumerate(positions):
            nll -= float(logp[b, pos].sum())
            correct += int(greedy[b, pos].sum())
            count += len(pos)
            for name, values in (more[0] if more and parts is not None else {}).items():
                parts[name] = parts.get(name, 0.0) + float(values[b, pos].sum())
    return nll, correct, count


def score_positions(model, samples: list[Sample], batch_size: int = 16) -> dict:
    """Loss and accuracy at the scored positions and, for a CPLM, the PARTS' means there."""
    parts: dict = {}
    nll, correct, count = position_totals(model, samples, batch_size, parts_score, parts)
    return {"loss": nll / count, "accuracy": correct / count, "n": count, **{k: v / count for k, v in parts.items()}}


@torch.no_grad()
def exact_matches(model, samples: list[Sample], tokenizer, chunk: int | None = None) -> int:
    """How many greedy generations (the prompt prefilled `chunk` tokens at a time; None: whole),
    one sample at a time, start with their sample's answer."""
    hits, device = 0, device_of(model)
    for s in samples:
        answer_len = len(s.ids) - s.prompt_len
        out = generate(model, torch.tensor([s.ids[: s.prompt_len]], device=device), answer_len + 1, prefill_chunk=chunk)
        hits += tokenizer.decode(out.tokens[0].tolist()).strip().startswith(s.answer)
    return hits


def score_generation(model, samples: list[Sample], tokenizer) -> dict:
    return {"exact_match": exact_matches(model, samples, tokenizer) / len(samples), "n": len(samples)}


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
