"""The long-context ablation: does document masking change the copy head's gain, how large is the
gain on natural text alone, and where does copy on win at long context?

    python tools/ablate_long_context.py                 # CPU default (about an hour of 2 cores)
    python tools/ablate_long_context.py --seeds 1 2 3 --steps 300 --lengths 256 1024 4096 16384

Matched runs {copy off, gate} x {data.document_mask off, on} x {the quickstart corpus, its natural
half alone (the standard-library sources: no synthetic copy documents)} x seeds, trained at
--seq-length (default 1024) with model.max_seq_len --max-seq-len (4096), every run of a seed on the
same data order from the same initial seed; each evaluated by context length
(tools/evaluate.py --context-lengths: needle, phone book, MQAR, variable tracking), beyond the
training length too. All runs train first, then all are evaluated. Writes <out>/report.md,
<out>/summary.json and <out>/by_length.png. Finished runs and evaluations are reused, so an
interrupted ablation continues where it stopped. The runs and the report are
cplm_dist.experiments.long_context_ablation's; the evaluations run as the installed
python -m cplm_dist_tools.evaluate.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cplm_dist.config import load_config
from cplm_dist.config.cli import exit_on_usage_error
from cplm_dist.experiments.long_context_ablation import CORPORA, MASKS, LongContextAblation, plan, run_all, write_report
from cplm_dist.experiments.runs import VARIANTS, ensure_quickstart_data

EVALUATE = "cplm_dist_tools.evaluate"  # this package's evaluate tool, as installed


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-config", default="configs/quickstart.yaml")
    p.add_argument("--variants", nargs="+", default=["off", "gate"], choices=list(VARIANTS))
    p.add_argument("--masks", nargs="+", default=list(MASKS), choices=list(MASKS))
    p.add_argument("--corpora", nargs="+", default=list(CORPORA), choices=list(CORPORA))
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=4, help="also the global batch (one rank)")
    p.add_argument("--lengths", nargs="+", type=int, default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--samples", type=int, default=8, help="evaluation samples per task and length")
    p.add_argument("--out", default="runs/ablation-long")
    p.add_argument("overrides", nargs="*", help="config overrides for every run")
    return p


@exit_on_usage_error
def main(argv=None) -> int:
    args = parser().parse_intermixed_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "ablation.log"
    ensure_quickstart_data(load_config(args.base_config, args.overrides), log)
    ablation = LongContextAblation(args.base_config, args.variants, args.masks, args.corpora, args.seeds, args.steps,
                                   args.seq_length, args.max_seq_len, args.micro_batch, args.lengths, args.samples,
                                   args.overrides, out)
    runs = plan(ablation)
    run_all(runs, ablation, [sys.executable, "-m", EVALUATE], log)
    summary = [{k: (str(v) if isinstance(v, Path) else v) for k, v in r.items() if k != "overrides"} for r in runs]
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    report = write_report(runs, ablation, out)
    print(report)
    print(f"wrote {out / 'report.md'}, {out / 'summary.json'} and {out / 'by_length.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
