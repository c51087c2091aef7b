"""Embedded corpora, so that the quickstart and the tests need nothing from the network.

- `stdlib`: the Python standard library's source files, from the running interpreter. Real code,
  rich in copying (identifiers, names, repeated calls), one document per file, sorted by path.
- `synthetic-copy`: seeded documents built to reward copying from the context: a span repeated
  after filler, key-value facts then questions about them, a list then the list again, a phone
  book then a lookup. Deterministic: one seed, one corpus.

Both are written as JSON lines (`{"text": ...}`) and go through the same tokenizer training and
preprocessing as any user corpus (tools/build_quickstart_data.py).
"""

from __future__ import annotations

import json
import os
import random
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator

from cplm_dist.errors import DataError

CORPORA = ("stdlib", "synthetic-copy")
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "turtledemo"}


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        if _STDLIB_SKIP.isdisjoint(path.relative_to(root).parts[:-1]):
            files.append(path)
    if not files:
        raise DataError(f"no Python sources under {root}: this interpreter ships without its standard library")
    return files


def stdlib_documents(max_bytes: int | None = None) -> Iterator[str]:
    """The standard library's .py files (UTF-8 ones), in path order, up to max_bytes of text."""
    total = 0
    for path in stdlib_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        total += len(text.encode("utf-8"))
        if max_bytes is not None and total > max_bytes:
            return
        yield text


# --- synthetic-copy ---------------------------------------------------------------------------

_ONSETS = ["b", "br", "c", "ch", "d", "f", "g", "gr", "h", "j", "k", "l", "m", "n", "p", "pl", "r", "s", "st", "t",
           "tr", "v", "w", "z"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou"]
_CODAS = ["", "", "n", "r", "s", "l", "m", "x", "nd", "st"]
_FILLER = ["the", "a", "of", "and", "to", "in", "is", "was", "it", "for", "on", "with", "as", "by", "at", "from",
           "that", "this", "which", "then", "there", "after", "before", "some", "many", "every"]


def lexicon(rng: random.Random, n: int) -> list[str]:
    words: set[str] = set()
    while len(words) < n:
        words.add("".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(1, 3))))
    return sorted(words)


def filler(rng: random.Random, lexicon: list[str], n: int) -> str:
    words = [rng.choice(_FILLER) if rng.random() < 0.5 else rng.choice(lexicon) for _ in range(n)]
    return " ".join(words).capitalize() + "."


def _repeat_doc(rng, lex):
    span = " ".join(rng.choice(lex) for _ in range(rng.randint(5, 25)))
    return f"{filler(rng, lex, rng.randint(5, 30))} Remember this: {span}. {filler(rng, lex, rng.randint(10, 60))} Once more: {span}."


def _kv_doc(rng, lex):
    keys = rng.sample(lex, rng.randint(3, 12))
    values = {k: str(rng.randint(0, 9999)) if rng.random() < 0.5 else rng.choice(lex) for k in keys}
    facts = " ".join(f"The {k} is {v}." for k, v in values.items())
    queries = " ".join(f"What is the {k}? The {k} is {values[k]}." for k in rng.sample(keys, rng.randint(1, len(keys))))
    return f"{facts} {filler(rng, lex, rng.randint(0, 20))} {queries}"


def _list_doc(rng, lex):
    items = ", ".join(rng.choice(lex) for _ in range(rng.randint(4, 15)))
    return f"Items: {items}. {filler(rng, lex, rng.randint(5, 40))} The items again: {items}."


def _phonebook_doc(rng, lex):
    names = rng.sample(lex, rng.randint(3, 10))
    book = {n.capitalize(): f"{rng.randint(200, 999)}-{rng.randint(0, 9999):04d}" for n in names}
    entries = "\n".join(f"{n}: {p}" for n, p in book.items())
    who = rng.choice(list(book))
    return f"Phone book\n{entries}\n{filler(rng, lex, rng.randint(0, 15))}\nThe number of {who} is {book[who]}."


_KINDS = (_repeat_doc, _kv_doc, _list_doc, _phonebook_doc)


def synthetic_copy_documents(n_docs: int, seed: int = 0) -> Iterator[str]:
    """`n_docs` documents; document i depends only on (seed, i)."""
    lex = lexicon(random.Random(seed), 3000)
    for i in range(n_docs):
        rng = random.Random(f"{seed}-{i}")
        yield rng.choice(_KINDS)(rng, lex)


# --- materialising ----------------------------------------------------------------------------


def write_jsonl(documents: Iterable[str], path: str | Path, text_key: str = "text") -> int:
    """Write documents as JSON lines, atomically (a temporary file renamed when complete)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    n = 0
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for doc in documents:
                f.write(json.dumps({text_key: doc}, ensure_ascii=False) + "\n")
                n += 1
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return n
