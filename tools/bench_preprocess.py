"""Preprocessing throughput on the `stdlib` corpus, for each worker count (a benchmark: the
figures go to the console and docs/benchmarks.md, never into a test's pass/fail).

    python tools/bench_preprocess.py                      # workers 1 and 2, the stdlib read 5 times
    python tools/bench_preprocess.py --workers 1 2 4 8 --repeat 20 --tokenizer data/tok.model
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

from cplm_dist.config.cli import exit_on_usage_error
from cplm_dist.data.corpora import stdlib_documents, write_jsonl
from cplm_dist.data.indexed_data import write_indexed_dataset
from cplm_dist.data.sources import iter_documents
from cplm_dist.data.tokenizer import load_tokenizer, train_sentencepiece


@exit_on_usage_error
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--stdlib-mb", type=float, default=None, help="cap on the stdlib text (default: all of it)")
    p.add_argument("--repeat", type=int, default=5, help="read the corpus this many times (amortises pool start-up)")
    p.add_argument("--tokenizer", help="a SentencePiece .model (default: train a 4096-entry BPE on the corpus)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cplm-bench-") as tmp:
        raw = Path(tmp) / "stdlib.jsonl"
        docs = list(stdlib_documents(int(args.stdlib_mb * 1e6) if args.stdlib_mb else None))
        n = write_jsonl(docs * args.repeat, raw)
        tok_path = args.tokenizer or Path(tmp) / "tok.model"
        if not args.tokenizer:
            train_sentencepiece(iter_documents([raw]), tok_path, vocab_size=4096)
        tok = load_tokenizer(tok_path)
        print(f"stdlib corpus x{args.repeat}: {n} files, {raw.stat().st_size / 1e6:.1f} MB as JSON lines; tokenizer {tok.vocab_size} ids; "
              f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}")
        print(f"{'workers':>7} {'documents':>10} {'tokens':>12} {'seconds':>8} {'docs/s':>9} {'tokens/s':>12}")
        for w in args.workers:
            s = write_indexed_dataset(iter_documents([raw]), tok, Path(tmp) / f"w{w}", workers=w, progress=False)
            print(f"{w:>7} {s.documents:>10,} {s.tokens:>12,} {s.seconds:>8.2f} {s.docs_per_s:>9,.0f} {s.tokens_per_s:>12,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
