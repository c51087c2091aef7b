"""A chaos run: one training under automatic restart with K random faults, compared bit for bit
with a straight run of the same config (docs/reliability.md, "Unattended runs").

    python tools/chaos.py --faults 20 --seed 0 -- --config configs/quickstart.yaml train.out_dir=runs/chaos \
        train.train_steps=200 train.save_interval=10 train.collective_timeout_minutes=0.2 ...

The run goes through the installed `launch/torchrun.sh --max-restarts R` (each elastic restart resumes) inside a
loop that relaunches it after a clean stop before train.train_steps (a SIGTERM'd rank makes all
save and exit 0, as at a Slurm preemption) until the latest checkpoint holds the last step. The
seeded faults come one at a time, each a random number of steps (and part of one) after the run
recovered from the last: kill (SIGKILL of a random rank), term (SIGTERM), save-kill (SIGKILL while
a step-* directory without complete.json is written), hang (SIGSTOP: the others exit 4 after
train.collective_timeout_minutes, torchrun kills it and restarts all).

Then every tensor of the final mp_rank_*_model_states.pt "module" is compared (torch.equal) with
the straight run's (run first into <out_dir>-reference, or --reference DIR); a table and a JSON
report (<out_dir>/chaos/report.json) give the faults injected and survived, the steps lost (the
"resume" records' recomputed steps, plus those of a restart before any checkpoint), restarts and
wall time; each launch's output is in <out_dir>/chaos/launch-N.log. Exit 0 only when every fault
was injected and survived and the weights are equal, 1 otherwise, 2 for bad arguments (one line).
The supervision, the faults and the report are cplm_dist.experiments.chaos'; the comparison of
weights and the final checkpoint are cplm_dist.checkpoint's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from cplm_dist.errors import UsageError
from cplm_dist.experiments.chaos import SIGNALS, Chaos, ChaosPlan, config_differences, report, straight_run, table


class Refused(UsageError):
    """A bad argument: one line, exit 2."""


def refuse(message: str):
    raise Refused(message)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.error = refuse  # one line, not argparse's usage and message
    p.add_argument("--faults", type=int, default=4, help="how many faults to inject (default 4)")
    p.add_argument("--kinds", default=",".join(SIGNALS), help=f"comma-separated, of {','.join(SIGNALS)} (default all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--max-restarts", type=int, help="torchrun's restarts per launch (default: --faults)")
    p.add_argument("--reference", help="a finished straight run of the same config (default: run one)")
    p.add_argument("--report", help="the JSON report (default <out_dir>/chaos/report.json)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds for the chaos run (default 3600)")
    p.add_argument("train", nargs=argparse.REMAINDER, help="-- then the training arguments")
    args = p.parse_args(argv)
    args.train = args.train[1:] if args.train[:1] == ["--"] else args.train
    args.kinds = [k for k in args.kinds.split(",") if k]
    if args.faults < 0 or args.nproc_per_node < 1 or (args.max_restarts or 0) < 0 or args.timeout <= 0:
        refuse("--faults and --max-restarts must be >= 0, --nproc-per-node >= 1, --timeout > 0")
    if not args.kinds or set(args.kinds) - set(SIGNALS):
        refuse(f"--kinds {','.join(args.kinds)!r}: give a comma-separated list of {', '.join(SIGNALS)}")
    if not args.train or any(a == "--resume" or a.startswith("--resume=") for a in args.train):
        refuse("give the training arguments after -- (a --config and overrides; no --resume: the tool resumes)")
    args.max_restarts = args.faults if args.max_restarts is None else args.max_restarts
    return args


def config_of(args: argparse.Namespace):
    """The run's config (cplm-train's other options are left to it: importing it takes seconds)."""
    from cplm_dist.config.cli import config_parser, load_from_args

    parser = config_parser("")
    parser.error = lambda message: refuse(f"training arguments: {message}")
    cfg = load_from_args(parser.parse_known_intermixed_args(args.train)[0])
    if "hang" in args.kinds and args.faults and cfg.train.collective_timeout_minutes > 2:
        refuse(f"hang faults wait train.collective_timeout_minutes={cfg.train.collective_timeout_minutes} each: "
               "set it small (e.g. 0.2) or leave hang out of --kinds")
    return cfg


def check_fresh(out: Path, what: str) -> None:
    if out.exists() and any(out.iterdir()):
        refuse(f"{what} {out} already exists: remove it (a chaos run starts fresh)"
               + (", or pass it as --reference" if what == "the reference" else ""))


def check_reference(ref: Path, cfg) -> Path:
    from cplm_dist.checkpoint.manifest import final_checkpoint, read_manifest

    step_dir = final_checkpoint(ref, cfg.train.train_steps)
    if step_dir is None:
        refuse(f"--reference {ref}: no complete checkpoint at train.train_steps={cfg.train.train_steps}")
    differ = config_differences(read_manifest(step_dir).config, cfg)
    if differ:
        refuse(f"--reference {ref} was trained with another config ({', '.join(differ)})")
    return step_dir


def prepare(argv: list[str]):
    """(arguments, config, run dir, the reference's final step dir or None): checked, or Refused."""
    args = parse(argv)
    args.argv = argv
    cfg = config_of(args)
    out = Path(cfg.train.out_dir)
    check_fresh(out, "train.out_dir")
    args.ref = Path(args.reference) if args.reference else out.with_name(out.name + "-reference")
    if not args.reference:
        check_fresh(args.ref, "the reference")
    return args, cfg, out, check_reference(args.ref, cfg) if args.reference else None


def main(argv=None) -> int:
    try:
        args, cfg, out, ref_dir = prepare(sys.argv[1:] if argv is None else argv)
    except UsageError as e:  # a bad argument or config: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    from cplm_dist.checkpoint import final_checkpoint, same_weights

    plan = ChaosPlan(args.train, args.faults, args.kinds, args.seed, args.nproc_per_node, args.max_restarts, args.timeout)
    steps, ref_wall = cfg.train.train_steps, None
    if ref_dir is None:
        ref_dir, ref_wall = straight_run(plan, args.ref, steps)
    chaos, start = Chaos(plan, out, steps), time.monotonic()
    finished = chaos.run()
    wall = time.monotonic() - start
    weights = same_weights(final_checkpoint(out, steps), ref_dir) if finished else (False, 0)
    r = report(chaos, finished, weights, wall, None if ref_wall is None else round(ref_wall, 1), ["tools/chaos.py", *args.argv])
    path = Path(args.report) if args.report else out / "chaos" / "report.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(r, indent=1) + "\n")
    print(table(r) + f"\n  report      {path}")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
