"""Datasets of the shipped lm-eval tasks (`cplm_local`), built here from a seed: nothing is read
from the network or from disk, so they run on an offline cluster as they do on a laptop.

- cplm_kv_mc: retrieval. Key-value facts, filler, then "What is the K? The K is" and four of the
  context's values to choose from.
- cplm_list_mc: copying. A list, filler, then the list again up to a point; the next item is one
  of four items of the list.
- cplm_phonebook_gen: retrieval by generation. A phone book, then "The number of N is"; exact match.
- cplm_corpus_ppl: perplexity over documents of the embedded corpus (synthetic copy documents and
  standard-library source, as the quickstart trains on; other seeds than the quickstart's data).

Each takes `n` (documents) and `seed` from the task's dataset_kwargs.
"""

from __future__ import annotations

import random

from datasets import Dataset, DatasetDict

from cplm_dist.data.corpora import filler, lexicon, stdlib_documents, synthetic_copy_documents

SEED = 1001  # not the quickstart corpus's seed: these documents are not in its training data


def _split(rows: list[dict]) -> DatasetDict:
    return DatasetDict({"test": Dataset.from_list(rows)})


def _lexicon(seed: int) -> list[str]:
    return lexicon(random.Random(seed), 3000)


def _four_options(rng: random.Random, answer: str, others: list[str]) -> dict:
    """The answer and three of `others`, in a random order, and where the answer is."""
    choices = [answer] + rng.sample(others, 3)
    rng.shuffle(choices)
    return {"choices": choices, "label": choices.index(answer)}


def kv_retrieval(n: int = 100, seed: int = SEED, **_) -> DatasetDict:
    lex, rows = _lexicon(seed), []
    for i in range(n):
        rng = random.Random(f"kv-{seed}-{i}")
        keys = rng.sample(lex, rng.randint(4, 10))
        values = dict(zip(keys, rng.sample(lex, len(keys))))  # distinct values: one right answer
        asked = rng.choice(keys)
        options = _four_options(rng, values[asked], [values[k] for k in keys if k != asked])
        facts = " ".join(f"The {k} is {v}." for k, v in values.items())
        rows.append({"context": f"{facts} {filler(rng, lex, rng.randint(0, 20))} What is the {asked}? The {asked} is",
                     **options})
    return _split(rows)


def list_copy(n: int = 100, seed: int = SEED, **_) -> DatasetDict:
    lex, rows = _lexicon(seed), []
    for i in range(n):
        rng = random.Random(f"list-{seed}-{i}")
        items = rng.sample(lex, rng.randint(5, 12))
        cut = rng.randint(1, len(items) - 1)
        options = _four_options(rng, items[cut], [x for x in items if x != items[cut]])
        rows.append({"context": f"Items: {', '.join(items)}. {filler(rng, lex, rng.randint(5, 30))} The items again: "
                                f"{', '.join(items[:cut])},", **options})
    return _split(rows)


def phonebook(n: int = 50, seed: int = SEED, **_) -> DatasetDict:
    lex, rows = _lexicon(seed), []
    for i in range(n):
        rng = random.Random(f"phone-{seed}-{i}")
        names = rng.sample(lex, rng.randint(3, 8))
        book = {name.capitalize(): f"{rng.randint(200, 999)}-{rng.randint(0, 9999):04d}" for name in names}
        who = rng.choice(list(book))
        entries = "\n".join(f"{name}: {number}" for name, number in book.items())
        rows.append({"context": f"Phone book\n{entries}\n{filler(rng, lex, rng.randint(0, 15))}\nThe number of {who} is",
                     "answer": book[who]})
    return _split(rows)


def corpus(n: int = 20, seed: int = SEED, max_chars: int = 2000, **_) -> DatasetDict:
    synthetic = list(synthetic_copy_documents(n - n // 2, seed=seed))
    code = [doc[:max_chars] for doc, _ in zip(stdlib_documents(), range(n // 2))]
    return _split([{"text": t} for t in synthetic + code])
