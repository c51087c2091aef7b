"""Runs side by side over steps: per-source loss and copy share, the live bottleneck, in-loop accuracy.

    python tools/plot_runs.py runs/quickstart runs/quickstart-nocopy --labels "copy on" "copy off" --out curves.png

Reads each run's logs/metrics.jsonl (train.diagnostics_interval and train.eval_tasks add the
bottleneck and in-loop panels; docs/training.md, "Watching the copy head learn").
"""

from __future__ import annotations

import argparse
import sys

from cplm_dist.config.cli import exit_on_usage_error
from cplm_dist.errors import UsageError


@exit_on_usage_error
def main(argv=None) -> int:
    from cplm_dist.experiments.run_curves import plot_curves, run_curves

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="run directories (train.out_dir)")
    p.add_argument("--labels", nargs="+", help="one per run (default: the directory names)")
    p.add_argument("--out", required=True, help="the PNG to write")
    args = p.parse_args(argv)
    labels = args.labels or [r.rstrip("/").split("/")[-1] for r in args.runs]
    if len(labels) != len(args.runs):
        raise UsageError(f"--labels gives {len(labels)} labels for {len(args.runs)} runs: give one per run")
    try:
        panels = plot_curves(run_curves(dict(zip(labels, args.runs))), args.out)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from None
    print(f"wrote {args.out}: {', '.join(panels)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
