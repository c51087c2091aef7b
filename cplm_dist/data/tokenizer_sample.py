"""The documents a tokenizer learns from: a seeded sample across every input (shard), read boundedly.

    sample = sample_documents(inputs, 100_000, seed=1234)   # a list of Documents, shards interleaved
    sample.per_source                                       # {input: documents it gave}

A tokenizer learnt from the start of the first shard knows that shard's language, code or domain
and byte-falls-back on the rest. So every input (a file, or a dataset: what
cplm_dist.data.sources.expand_inputs gives) gets its share of the sample: input i of n is asked for
ceil(still needed / inputs left), so an input with fewer documents leaves its shortfall to the
later ones. Its share is a seeded reservoir (algorithm R, seed `seed:i`) over its first
READ_FACTOR x share documents, never the whole input: on 100B tokens a reservoir over everything
would read the whole corpus (hours) to keep a few hundred thousand documents, while this reads about
READ_FACTOR x the sample. The trade-off: inside a shard only its head is seen, so a shard sorted
by something that matters (a URL, a date) is sampled from its first records only; corpora split
into shards are usually shuffled within them, and what a tokenizer misses most is a whole shard
(another language, code) -- more, smaller shards sample more evenly. The sample is shuffled (seed
`seed`) before SentencePiece sees it, so a --max-lines cut keeps every shard's share in proportion.

`sample_docs=0` keeps the old reading: every document in input order, up to --max-lines (no
sample is held in memory); the per-source counts are then of the documents read.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from cplm_dist.data.sources import Document, Input, ReadStats, expand_inputs, iter_documents
from cplm_dist.errors import DataError

READ_FACTOR = 4  # an input's share is drawn from its first READ_FACTOR x share documents


@dataclass
class Sample:
    """The documents to learn from (iterate it once) and how many each input gave."""

    documents: Iterable[Document]
    per_source: dict[str, int] = field(default_factory=dict)  # filled as `documents` is consumed when not sampled
    size: int = 0  # the requested sample (0: no sampling, every document in order)
    seed: int = 0

    def as_json(self) -> dict:
        return {"documents": self.size, "seed": self.seed, "read_factor": READ_FACTOR if self.size else None,
                "per_source": dict(self.per_source)}


def _reservoir(documents: Iterator[Document], k: int, rng: random.Random) -> list[Document]:
    """k documents drawn uniformly from `documents` (all of them when there are fewer)."""
    kept: list[Document] = []
    for seen, doc in enumerate(documents):
        if seen < k:
            kept.append(doc)
        else:
            j = rng.randrange(seen + 1)
            if j < k:
                kept[j] = doc
    return kept


def _in_order(inputs: list[Input], per_source: dict[str, int], text_key: str, on_bad: str, stats: ReadStats,
              split: str | None) -> Iterator[Document]:
    for inp in inputs:
        for doc in iter_documents([inp], text_key, on_bad, stats, split):
            per_source[str(inp)] += 1
            yield doc


def sample_documents(paths: Iterable, sample_docs: int, seed: int = 1234, text_key: str = "text",
                     on_bad: str = "stop", stats: ReadStats | None = None, split: str | None = None) -> Sample:
    """`sample_docs` documents drawn across every input (module docstring), shuffled; 0: all, in order."""
    if sample_docs < 0:
        raise DataError(f"sample_docs={sample_docs}: give a number of documents >= 1, or 0 for every document in order")
    stats = stats if stats is not None else ReadStats()
    inputs = expand_inputs(paths, split)
    per_source = dict.fromkeys((str(i) for i in inputs), 0)
    if sample_docs == 0:
        return Sample(_in_order(inputs, per_source, text_key, on_bad, stats, split), per_source, 0, seed)
    picked: list[Document] = []
    for i, inp in enumerate(inputs):
        share = math.ceil((sample_docs - len(picked)) / (len(inputs) - i))
        if share <= 0:
            continue
        reader = iter_documents([inp], text_key, on_bad, stats, split)
        try:
            kept = _reservoir(itertools.islice(reader, READ_FACTOR * share), share, random.Random(f"{seed}:{i}"))
        finally:
            reader.close()  # stop reading this input: its file closes now
        per_source[str(inp)] = len(kept)
        picked += kept
    random.Random(seed).shuffle(picked)
    return Sample(picked, per_source, sample_docs, seed)
