"""Datasets of the lm-eval group `cplm_local_long`: evaluation by context length's text tasks
(cplm_dist.evaluation.long_context: needle, phonebook, multi-hop variable tracking), with the same
fact generators and splicing, in characters of the standard-library corpus instead of tokens, at
each of the task's `lengths` (characters; about 3-4 a token). Built from a seed, nothing read from
the network. MQAR is a token task (random ids) and stays in tools/evaluate.py --context-lengths.

Each row: context (the prompt), answer, length (its characters, for grouping the samples by length).
"""

from __future__ import annotations

from datasets import Dataset, DatasetDict

from cplm_dist.data.corpora import stdlib_documents
from cplm_dist.evaluation.long_context import FACTS, SHORT, SHORT_FACTS
from cplm_dist.evaluation.tasks import Haystack, compose, sample_rng

SEED = 1002
LENGTHS = (2000, 8000, 32000)
CHARS_PER_TOKEN = 4  # what SHORT (tokens) is in characters, for the fewer facts of a short context


def _haystack(chars: int) -> Haystack:
    text, docs = "", stdlib_documents()
    while len(text) < chars:
        text += next(docs) + "\n"
    return Haystack(text)


def rows(task: str, n: int, seed: int, lengths) -> list[dict]:
    hay = _haystack(2 * max(lengths))
    out = []
    for length in lengths:
        fewer = SHORT_FACTS.get(task, {}) if length < SHORT * CHARS_PER_TOKEN else {}
        for i in range(n):
            r = sample_rng(seed, f"lm-eval-long-{task}", length, i)
            facts = FACTS[task](r, i, **fewer)
            prompt, answer = compose(facts, hay, length, lambda text: text, r, task)
            out.append({"context": prompt.rstrip(" "), "answer": answer, "length": length})
    return out


def _dataset(task: str, n: int, seed: int, lengths) -> DatasetDict:
    return DatasetDict({"test": Dataset.from_list(rows(task, n, seed, lengths or LENGTHS))})


def needle(n: int = 10, seed: int = SEED, lengths=None, **_) -> DatasetDict:
    return _dataset("needle", n, seed, lengths)


def phonebook(n: int = 10, seed: int = SEED, lengths=None, **_) -> DatasetDict:
    return _dataset("phonebook", n, seed, lengths)


def vartrack(n: int = 10, seed: int = SEED, lengths=None, **_) -> DatasetDict:
    return _dataset("vartrack", n, seed, lengths)
