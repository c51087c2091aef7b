"""Tokenize raw text into a Megatron indexed dataset (<prefix>.bin / .idx, plus .meta.json).

    python tools/preprocess_data.py --input corpus.jsonl --tokenizer data/tokenizer.model \
        --output-prefix data/corpus --workers 8
    cplm-preprocess-data --input docs/ --tokenizer tok.model --output-prefix data/docs --on-bad-record skip
    cplm-preprocess-data --input saved/ --split train ...        # a datasets save_to_disk directory
    cplm-preprocess-data --hf-dataset org/name [--hf-config C] --split train ...   # load_dataset, offline

Inputs are files and directories as cplm_dist.data.sources reads them, a directory written by
`datasets`' save_to_disk (`--split` picks a DatasetDict's split), and `--hf-dataset`: what
`datasets.load_dataset` takes (a local dataset repository, or a hub name already in the local
cache; the hub is never contacted), read by cplm_dist.data.hf_datasets. Streams the inputs (never
the whole corpus in memory), encodes with `--workers` processes,
appends the end-of-document id to every document, shows documents/s and tokens/s, and writes
the output under a temporary name, renamed when complete. Existing output is never replaced
without --overwrite. Every document written decodes back to exactly its text; a bad record (see
cplm_dist/data/sources.py), or a text the tokenizer would not give back exactly, stops the run
with one line naming its file and line and exit code 2, or with --on-bad-record skip is skipped
and counted.
"""

from __future__ import annotations

import argparse
import sys

from cplm_dist.config.cli import exit_on_usage_error
from cplm_dist.data.indexed_data import write_indexed_dataset
from cplm_dist.data.sources import ReadStats, add_input_arguments, inputs_from_args, iter_documents
from cplm_dist.data.tokenizer import load_tokenizer


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_input_arguments(p)
    p.add_argument("--tokenizer", required=True, help="SentencePiece .model or Hugging Face tokenizer directory")
    p.add_argument("--tokenizer-backend", choices=["sentencepiece", "huggingface"], default="sentencepiece")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--no-eod", action="store_true", help="do not append the end-of-document id")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset at --output-prefix")
    p.add_argument("--no-progress", action="store_true")
    return p


@exit_on_usage_error
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer, args.tokenizer_backend)
    files = inputs_from_args(args)
    stats = ReadStats()
    summary = write_indexed_dataset(
        iter_documents(files, args.text_key, args.on_bad_record, stats), tokenizer, args.output_prefix,
        workers=args.workers, append_eod=not args.no_eod, overwrite=args.overwrite,
        progress=not args.no_progress, sources=[str(f) for f in files], on_bad=args.on_bad_record, stats=stats,
    )
    print(f"wrote {summary.line()}; skipped: {stats.describe_skipped()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
