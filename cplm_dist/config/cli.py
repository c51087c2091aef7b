"""Command-line plumbing shared by every entry point: `--config FILE [section.field=value ...]`,
and the rule that a usage error (bad config, data, checkpoint, launch) is one line on stderr and
exit code 2."""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Callable, Sequence

import yaml

from cplm_dist.config import Config, load_config, to_dict
from cplm_dist.errors import UsageError


def config_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default="tiny", help="YAML file or shipped config name (default: tiny)")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value",
                        help="dotted overrides, e.g. model.num_layers=4 copy.mix=joint")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return parser


def load_from_args(args: argparse.Namespace) -> Config:
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        sys.exit(0)
    return cfg


def exit_on_usage_error(main: Callable[[Sequence[str] | None], int | None]):
    """Wrap an entry point: UsageError -> 'error: <one line>' on stderr and exit code 2."""

    @functools.wraps(main)
    def wrapped(argv: Sequence[str] | None = None) -> int:
        try:
            return main(argv) or 0
        except UsageError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    return wrapped
