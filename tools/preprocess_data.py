"""Tokenize raw text into a Megatron indexed dataset (<prefix>.bin / .idx, plus .meta.json).

    python tools/preprocess_data.py --input corpus.jsonl --tokenizer data/tokenizer.model \
        --output-prefix data/corpus --workers 8
    cplm-preprocess-data --input shards/ --tokenizer tok.model --output-prefix data/web --workers 16 \
        --partition $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT --dedup exact    # one part of many
    cplm-preprocess-data --input docs/ --pattern '*.py' --tokenizer tok.model --output-prefix data/code
    cplm-preprocess-data --input saved/ --split train ...        # a datasets save_to_disk directory
    cplm-preprocess-data --hf-dataset org/name [--hf-config C] --split train ...   # load_dataset, offline

Inputs are files and directories as cplm_dist.data.sources reads them (.jsonl, .jsonl.gz,
.jsonl.zst, .json, .csv, .parquet, .arrow, .txt; a directory gives only those, or the files
matching --pattern, and says what it skipped), a directory written by `datasets`' save_to_disk
(`--split` picks a DatasetDict's split), and `--hf-dataset`: what `datasets.load_dataset` takes (a
local dataset repository, or a hub name already in the local cache; the hub is never contacted).

Each input file (a byte range of a large .jsonl: --split-mb) is a work unit that one of --workers
processes reads, parses, encodes and writes on its own; the units are joined in input order at the
end, so the bytes never depend on --workers. An interrupted run (a crash, SIGKILL, a bad record)
keeps every finished unit in <prefix>.work/: the same command continues from them and ends with
the bytes an uninterrupted run writes (cplm_dist/data/preprocess.py). --partition I/N writes part I
of N of the inputs to <prefix>-0000I-of-0000N (merge the parts with tools/merge_data.py, or give
them as a glob in data.blend); a part already complete is not redone. Every document written
decodes back to exactly its text; a bad record (see cplm_dist/data/sources.py), or a text the
tokenizer would not give back exactly, stops the run with one line naming its file and line and
exit code 2, or with --on-bad-record skip is skipped, counted, and written to <prefix>.rejects.jsonl.
--dedup exact drops documents whose text appeared before (also across partitions, by the merge).
Existing output is never replaced without --overwrite.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cplm_dist.config.cli import exit_on_usage_error
from cplm_dist.data.input_files import parse_partition, partition as cut, partition_units, size_of
from cplm_dist.data.preprocess import Options, partition_prefix, preprocess
from cplm_dist.data.sources import add_input_arguments, inputs_from_args
from cplm_dist.data.tokenizer import load_tokenizer
from cplm_dist.errors import UsageError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_input_arguments(p)
    p.add_argument("--tokenizer", required=True, help="SentencePiece .model or Hugging Face tokenizer directory")
    p.add_argument("--tokenizer-backend", choices=["sentencepiece", "huggingface"], default="sentencepiece")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--workers", type=int, default=1, help="processes, each working a unit (an input file) at a time")
    p.add_argument("--partition", metavar="I/N", help="write part I of N of the inputs (0 <= I < N; a .jsonl is cut "
                   "by lines where the files are fewer than N), to "
                   "<output-prefix>-0000I-of-0000N; a Slurm array: $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT")
    p.add_argument("--dedup", choices=["exact"], help="drop documents whose exact text came before (first stays)")
    p.add_argument("--split-mb", type=float, default=1024.0, help="cut an uncompressed .jsonl larger than this "
                   "into units of about this size (parallelism and restarts within one file)")
    p.add_argument("--no-eod", action="store_true", help="do not append the end-of-document id")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset at --output-prefix")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--check", action="store_true", help="resolve the inputs, cut them into the --partition parts, "
                   "load the tokenizer, print the plan and exit (launch/submit_preprocess.sh runs it before sbatch)")
    return p


def print_plan(files, partition, output_prefix, split_bytes: int) -> None:
    """Each part's inputs and bytes (every part of --partition's N), or the whole input."""
    count = partition[1] if partition else 1
    units = partition_units(files, count, split_bytes)
    for i in range(count):
        part = cut(units, i, count)
        size = sum(size_of(u) for u in part if isinstance(u.input, Path))
        name = partition_prefix(output_prefix, (i, count) if partition else None)
        print(f"{name}: {len(part)} units, {size / 1e9:.3f} GB ({part[0].name} ... {part[-1].name})")


@exit_on_usage_error
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.workers < 1 or args.split_mb <= 0:
        raise UsageError(f"--workers {args.workers} / --split-mb {args.split_mb}: give a positive number")
    partition = parse_partition(args.partition) if args.partition else None
    tokenizer = load_tokenizer(args.tokenizer, args.tokenizer_backend)
    files = inputs_from_args(args, report=lambda line: print(line, file=sys.stderr))
    if args.check:
        print_plan(files, partition, args.output_prefix, int(args.split_mb * (1 << 20)))
        return 0
    opts = Options(text_key=args.text_key, on_bad=args.on_bad_record, append_eod=not args.no_eod,
                   dedup=args.dedup == "exact", split_bytes=int(args.split_mb * (1 << 20)))
    summary, skipped = preprocess(files, tokenizer, args.output_prefix, opts=opts, workers=args.workers,
                                  partition=partition, overwrite=args.overwrite, progress=not args.no_progress)
    described = ", ".join(f"{n} {why}" for why, n in sorted(skipped.items())) or "none"
    rejects = f" (listed in {args.output_prefix}*.rejects.jsonl)" if any(k != "empty documents" for k in skipped) else ""
    print(f"wrote {summary.line()}; skipped: {described}{rejects}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
