"""Build the quickstart dataset from the embedded corpora: raw JSON lines, a SentencePiece
tokenizer trained on them, and one Megatron indexed dataset per corpus.

    python tools/build_quickstart_data.py                 # -> data/quickstart/ (a minute or two on 2 cores)
    cplm-build-quickstart-data --out /tmp/qs --stdlib-mb 2 --synthetic-docs 5000 --vocab-size 2048

Output (reused when present, rebuilt with --force):
    <out>/raw/stdlib.jsonl, <out>/raw/synthetic-copy.jsonl
    <out>/tokenizer.model (+ .json)
    <out>/stdlib.{bin,idx,meta.json}, <out>/synthetic-copy.{bin,idx,meta.json}
Both corpora take exactly the path user data takes (train_tokenizer, preprocess_data):
cplm_dist.data.quickstart.
"""

from __future__ import annotations

import argparse
import sys

from cplm_dist.config.cli import exit_on_usage_error
from cplm_dist.data.quickstart import build_quickstart_data


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
    build_quickstart_data(args.out, vocab_size=args.vocab_size, stdlib_mb=args.stdlib_mb, synthetic_docs=args.synthetic_docs,
                          seed=args.seed, workers=args.workers, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
