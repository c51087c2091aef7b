"""The quickstart dataset from the embedded corpora (cplm_dist.data.corpora): raw JSON lines, a
SentencePiece tokenizer trained on them, and one Megatron indexed dataset per corpus, through the
path user data takes (sources -> tokenizer -> indexed_data). tools/build_quickstart_data.py is its
command; experiments build it in-process when a run reads it.

    <out>/raw/stdlib.jsonl, <out>/raw/synthetic-copy.jsonl
    <out>/tokenizer.model (+ .json)
    <out>/stdlib.{bin,idx,meta.json}, <out>/synthetic-copy.{bin,idx,meta.json}

What exists is reused; `force` rebuilds everything.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from cplm_dist.data.corpora import stdlib_documents, synthetic_copy_documents, write_jsonl
from cplm_dist.data.indexed_data import dataset_files, write_indexed_dataset
from cplm_dist.data.sources import iter_documents
from cplm_dist.data.tokenizer import load_tokenizer, train_sentencepiece

CORPORA = ("stdlib", "synthetic-copy")


def build_quickstart_data(out: str | Path = "data/quickstart", *, vocab_size: int = 4096, stdlib_mb: float = 6.0,
                          synthetic_docs: int = 20000, seed: int = 0, workers: int = 2, force: bool = False,
                          log: Callable[[str], None] = print) -> Path:
    """Build (or reuse) the quickstart data in `out`; returns its tokenizer's path."""
    out, start = Path(out), time.perf_counter()
    stamp = lambda: f"[{time.perf_counter() - start:5.1f}s]"  # noqa: E731
    raw = {name: out / "raw" / f"{name}.jsonl" for name in CORPORA}
    makers = {"stdlib": lambda: stdlib_documents(int(stdlib_mb * 1e6)),
              "synthetic-copy": lambda: synthetic_copy_documents(synthetic_docs, seed)}
    for name, path in raw.items():
        if force or not path.exists():
            n = write_jsonl(makers[name](), path)
            log(f"{stamp()} {path}: {n:,} documents")
    tok_path = out / "tokenizer.model"
    if force or not tok_path.exists():
        meta = train_sentencepiece(iter_documents(list(raw.values())), tok_path, vocab_size=vocab_size,
                                   sources=[str(p) for p in raw.values()])
        log(f"{stamp()} {tok_path}: vocabulary {meta['vocab_size']} from {meta['training_lines']:,} lines")
    tokenizer = load_tokenizer(tok_path)
    for name, path in raw.items():
        prefix = out / name
        if force or not dataset_files(prefix)["idx"].exists():
            summary = write_indexed_dataset(iter_documents([path]), tokenizer, prefix, workers=workers,
                                            overwrite=True, progress=False, sources=[str(path)])
            log(f"{stamp()} {summary.line()}")
    log(f"quickstart data ready in {out} ({time.perf_counter() - start:.1f}s); config:\n"
        f"data:\n  tokenizer: {tok_path}\n  blend:\n" + "".join(f"    - {{path: {out / name}, weight: 0.5}}\n" for name in raw))
    return tok_path
