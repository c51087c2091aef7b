"""Preprocessing throughput on sharded JSON lines of the `stdlib` corpus, ours for each worker
count against the peer a user would otherwise reach for (`datasets`' `map`, batched encoding,
`num_proc`), same files, same tokenizer (a benchmark: the figures go to the console and
docs/benchmarks.md, never into a test's pass/fail).

    python tools/bench_preprocess.py                      # workers 1 and 2, 8 shards, the peer too
    python tools/bench_preprocess.py --workers 1 2 4 8 --repeat 20 --shards 32 --tokenizer data/tok.model

Ours is tools/preprocess_data.py's path (cplm_dist.data.preprocess: a shard a worker, read,
parsed, round-trip checked, encoded and written there, joined at the end); the peer reads the
shards with `load_dataset("json")` and encodes with `map(batched=True, num_proc=W)` into its Arrow
cache (no round-trip check, no .bin/.idx: less work than ours). SentencePiece encodes on one
thread in every process (workers 1 included), so per core = tokens/s over the
processes working (min(workers, cores)); the last column is what 100B tokens cost at that rate.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from cplm_dist.config.cli import exit_on_usage_error
from cplm_dist.data.corpora import stdlib_documents, write_jsonl
from cplm_dist.data.preprocess import Options, preprocess
from cplm_dist.data.sources import iter_documents
from cplm_dist.data.tokenizer import load_tokenizer, train_sentencepiece


def peer(shards: list[Path], tok_path: Path, workers: int, cache: Path) -> tuple[int, float]:
    """(tokens, seconds) of datasets' map over the shards with `workers` processes."""
    import datasets
    import sentencepiece as spm

    datasets.disable_progress_bars()
    start = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=[str(s) for s in shards], split="train", cache_dir=str(cache))
    sp = spm.SentencePieceProcessor(model_file=str(tok_path))

    def encode(batch):
        return {"ids": [ids + [sp.eos_id()] for ids in sp.encode(batch["text"], num_threads=1)]}

    out = ds.map(encode, batched=True, batch_size=64, num_proc=workers if workers > 1 else None,
                 remove_columns=ds.column_names)
    tokens = sum(len(x) for x in out.with_format("arrow")["ids"].to_pylist())
    return tokens, time.perf_counter() - start


def row(tool: str, workers: int, tokens: int, seconds: float) -> str:
    per_core = tokens / seconds / min(workers, os.cpu_count() or 1)
    return (f"| {tool} | {workers} | {tokens:,} | {seconds:.2f} | {tokens / seconds:,.0f} | {per_core:,.0f} | "
            f"{1e11 / per_core / 3600:,.0f} |")


@exit_on_usage_error
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--shards", type=int, default=8, help="JSON-lines files the corpus is written as")
    p.add_argument("--stdlib-mb", type=float, default=None, help="cap on the stdlib text (default: all of it)")
    p.add_argument("--repeat", type=int, default=5, help="the corpus this many times over the shards")
    p.add_argument("--tokenizer", help="a SentencePiece .model (default: train a 4096-entry BPE on the corpus)")
    p.add_argument("--no-peer", action="store_true", help="ours only")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cplm-bench-") as tmp:
        docs = list(stdlib_documents(int(args.stdlib_mb * 1e6) if args.stdlib_mb else None)) * args.repeat
        shards = [Path(tmp) / f"shard-{i:03d}.jsonl" for i in range(args.shards)]
        for i, s in enumerate(shards):
            write_jsonl(docs[i::args.shards], s)
        tok_path = Path(args.tokenizer or Path(tmp) / "tok.model")
        if not args.tokenizer:
            train_sentencepiece(iter_documents(shards[:1]), tok_path, vocab_size=4096)
        tok = load_tokenizer(tok_path)
        tok.threads = 1  # one core a process, as in the workers: per-core figures are per core
        size = sum(s.stat().st_size for s in shards)
        print(f"stdlib corpus x{args.repeat}: {len(docs)} documents in {args.shards} shards, {size / 1e6:.1f} MB of JSON "
              f"lines; tokenizer {tok.vocab_size} ids; {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}")
        print("| tool | workers | tokens | seconds | tokens/s | tokens/s per core | core-hours per 100B tokens |")
        print("|---|---|---|---|---|---|---|")
        for w in args.workers:
            s, _ = preprocess(shards, tok, Path(tmp) / f"w{w}", opts=Options(), workers=w, progress=False,
                              report=lambda _: None)
            print(row("cplm_dist preprocess", w, s.tokens, s.seconds), flush=True)
        for w in [] if args.no_peer else args.workers:
            tokens, seconds = peer(shards, tok_path, w, Path(tmp) / f"hf-{w}")
            print(row("datasets map", w, tokens, seconds), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
