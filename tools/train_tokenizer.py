"""Train a SentencePiece tokenizer (BPE or unigram, byte fallback) from local files.

    python tools/train_tokenizer.py --input corpus.jsonl more/*.parquet --vocab-size 32000 \
        --output data/tokenizer.model
    cplm-train-tokenizer --input docs/ --model-type unigram --vocab-size 8192 --output tok.model
    cplm-train-tokenizer --hf-dataset org/name --split train --vocab-size 32000 --output tok.model

Inputs are files or directories: JSON lines, JSON, Parquet, CSV, Arrow (the `--text-key` field),
or plain text (one document per file), read as cplm_dist.data.sources describes; a directory
written by `datasets`' save_to_disk (`--split` for a DatasetDict), or `--hf-dataset NAME_OR_PATH
[--hf-config C] --split S` (what datasets.load_dataset takes, offline). Writes the
model and `<output minus .model>.json` metadata (ids: unk 0, bos 1, eod 2, pad 3, then
`--special-tokens`). Bad input gives one line and exit code 2.

It learns from `--sample-docs` documents (default 100,000) drawn across every input -- each file
or shard its share, a seeded reservoir over that shard's first records (`--seed`;
cplm_dist.data.tokenizer_sample says why only the first ones) -- shuffled, then cut at
`--max-lines` lines. The metadata's "sample" records how many documents each input gave.
`--sample-docs 0`: every document in input order, up to --max-lines.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from cplm_dist.config.cli import exit_on_usage_error
from cplm_dist.data.sources import ReadStats, add_input_arguments, inputs_from_args
from cplm_dist.data.tokenizer import train_sentencepiece
from cplm_dist.data.tokenizer_sample import sample_documents
from cplm_dist.errors import UsageError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_input_arguments(p)
    p.add_argument("--output", required=True, help="the .model file to write")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--special-tokens", nargs="*", default=[], help="extra tokens kept whole, e.g. '<|im_start|>'")
    p.add_argument("--no-byte-fallback", action="store_true", help="map unknown characters to <unk> instead of bytes")
    p.add_argument("--max-lines", type=int, default=2_000_000, help="train on at most this many lines (of the sample)")
    p.add_argument("--sample-docs", type=int, default=100_000, help="documents drawn across all inputs, each its "
                   "share from its first records (0: every document in order, up to --max-lines)")
    p.add_argument("--seed", type=int, default=1234, help="the sample's seed")
    p.add_argument("--overwrite", action="store_true", help="replace an existing tokenizer at --output (every "
                   "dataset made with the old one must then be rebuilt)")
    return p


@exit_on_usage_error
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if Path(args.output).exists() and not args.overwrite:
        raise UsageError(f"{args.output} already exists (datasets made with it would no longer match): choose "
                         "another --output or pass --overwrite")
    if args.max_lines < 1:
        raise UsageError(f"--max-lines {args.max_lines}: give at least 1")
    if args.sample_docs < 0:
        raise UsageError(f"--sample-docs {args.sample_docs}: give a number of documents, or 0 for all of them in order")
    stats = ReadStats()
    start = time.perf_counter()
    files = inputs_from_args(args)
    sample = sample_documents(files, args.sample_docs, args.seed, args.text_key, args.on_bad_record, stats, args.split)
    meta = train_sentencepiece(
        sample.documents, args.output, vocab_size=args.vocab_size, model_type=args.model_type,
        special_tokens=args.special_tokens, byte_fallback=not args.no_byte_fallback,
        max_lines=args.max_lines, sources=[str(f) for f in files], sample=sample.as_json,
    )
    drawn = sum(sample.per_source.values())
    how = (f"{drawn:,} documents sampled from {len(files)} input{'s' * (len(files) > 1)} ({stats.documents:,} read)"
           if args.sample_docs else f"{stats.documents:,} documents")
    print(f"wrote {args.output}: {meta['model_type']} vocabulary of {meta['vocab_size']} "
          f"(eod {meta['eod']}, pad {meta['pad']}) from {how}, "
          f"{meta['training_lines']:,} lines, in {time.perf_counter() - start:.1f}s; skipped: {stats.describe_skipped()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
