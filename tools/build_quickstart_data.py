"""Build the quickstart dataset from the embedded corpora: raw JSON lines, a SentencePiece
tokenizer trained on them, and one Megatron indexed dataset per corpus.

    python tools/build_quickstart_data.py                 # -> data/quickstart/ (a minute or two on 2 cores)
    cplm-build-quickstart-data --out /tmp/qs --stdlib-mb 2 --synthetic-docs 5000 --vocab-size 2048

Output (reused when present, rebuilt with --force):
    <out>/raw/stdlib.jsonl, <out>/raw/synthetic-copy.jsonl
    <out>/tokenizer.model (+ .json)
    <out>/stdlib.{bin,idx,meta.json}, <out>/synthetic-copy.{bin,idx,meta.json}
Both corpora take exactly the path user data takes (train_tokenizer, preprocess_data).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from cplm_dist.cli import exit_on_usage_error
from cplm_dist.data.corpora import stdlib_documents, synthetic_copy_documents, write_jsonl
from cplm_dist.data.indexed_data import dataset_files, write_indexed_dataset
from cplm_dist.data.sources import iter_documents
from cplm_dist.data.tokenizer import load_tokenizer, train_sentencepiece


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="data/quickstart")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--stdlib-mb", type=float, default=6.0, help="megabytes of standard-library source")
    p.add_argument("--synthetic-docs", type=int, default=20000)
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic-copy corpus")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--force", action="store_true", help="rebuild everything")
    return p


@exit_on_usage_error
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    out = Path(args.out)
    start = time.perf_counter()
    raw = {"stdlib": out / "raw" / "stdlib.jsonl", "synthetic-copy": out / "raw" / "synthetic-copy.jsonl"}
    makers = {
        "stdlib": lambda: stdlib_documents(int(args.stdlib_mb * 1e6)),
        "synthetic-copy": lambda: synthetic_copy_documents(args.synthetic_docs, args.seed),
    }
    for name, path in raw.items():
        if args.force or not path.exists():
            n = write_jsonl(makers[name](), path)
            print(f"[{time.perf_counter() - start:5.1f}s] {path}: {n:,} documents")
    tok_path = out / "tokenizer.model"
    if args.force or not tok_path.exists():
        meta = train_sentencepiece(iter_documents(list(raw.values())), tok_path, vocab_size=args.vocab_size,
                                   sources=[str(p) for p in raw.values()])
        print(f"[{time.perf_counter() - start:5.1f}s] {tok_path}: vocabulary {meta['vocab_size']} "
              f"from {meta['training_lines']:,} lines")
    tokenizer = load_tokenizer(tok_path)
    for name, path in raw.items():
        prefix = out / name
        if args.force or not dataset_files(prefix)["idx"].exists():
            summary = write_indexed_dataset(iter_documents([path]), tokenizer, prefix, workers=args.workers,
                                            overwrite=True, progress=False, sources=[str(path)])
            print(f"[{time.perf_counter() - start:5.1f}s] {summary.line()}")
    print(f"quickstart data ready in {out} ({time.perf_counter() - start:.1f}s); config:\n"
          f"data:\n  tokenizer: {tok_path}\n  blend:\n"
          + "".join(f"    - {{path: {out / name}, weight: 0.5}}\n" for name in raw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
