"""Merge indexed datasets, in order, into one (megatron's merge_datasets, ours).

    python tools/merge_data.py --inputs 'data/web-*-of-00016' --output-prefix data/web
    cplm-merge-data --inputs data/parts/ --output-prefix data/web --dedup exact

--inputs takes dataset prefixes, globs of them (quoted; a shell-expanded glob's .bin/.idx/.meta.json
names work too) or directories (every dataset in them), each in sorted order. The result is byte for
byte what one tools/preprocess_data.py run over the parts' inputs in the same order writes; with
--dedup exact (every part preprocessed with --dedup exact) a document whose text appeared in an
earlier part is left out, as one deduplicated run would. Parts made with different tokenizers or
--no-eod settings are refused; the output is written under a temporary name, checked and renamed,
and the parts are never changed (cplm_dist/data/merge.py).
"""

from __future__ import annotations

import argparse
import sys

from cplm_dist.config.cli import exit_on_usage_error
from cplm_dist.data.merge import merge_datasets


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--inputs", nargs="+", required=True, help="dataset prefixes, globs of them, or directories")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--dedup", choices=["exact"], help="leave out documents whose exact text is in an earlier part")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset at --output-prefix")
    return p


@exit_on_usage_error
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    summary = merge_datasets(args.inputs, args.output_prefix, dedup=args.dedup == "exact", overwrite=args.overwrite)
    print(f"wrote {summary.line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
