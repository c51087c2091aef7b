"""What a job submission can check before it waits in a queue: the config resolves and validates,
tp x cp x pp divides the job's world, a sparse model's ep x expert_tp divides a pipeline stage's
ranks (cplm_dist.config.sparse), and the batch arithmetic holds. No data, no checkpoint, no
process group: it runs on a login node (launch/submit.sh calls it before sbatch).

    python -m cplm_dist.train.preflight --world 16 --config configs/runs/cplm-7b.yaml parallel.pp=2

Prints the layout the job will train with on stderr; exit 2 with one line when it cannot run.
"""

from __future__ import annotations

import sys

from cplm_dist.config import BatchLayout
from cplm_dist.config.cli import exit_on_usage_error, load_from_args
from cplm_dist.config.sparse import check_expert_world, expert_tp
from cplm_dist.errors import UsageError


@exit_on_usage_error
def main(argv=None) -> int:
    from cplm_dist.train.driver import train_parser  # the job's own arguments, whatever flags training gains

    parser = train_parser()
    parser.add_argument("--world", type=int, required=True, help="processes the job starts (nodes x tasks per node)")
    args = parser.parse_intermixed_args(argv)
    if args.world < 1:
        raise UsageError(f"--world {args.world} must be a positive number of processes")
    cfg = load_from_args(args)
    p = cfg.parallel
    batch = BatchLayout.of(cfg, args.world)
    dp, accumulation = batch.dp, batch.accumulation
    check_expert_world(cfg, args.world)
    cp = f" x cp {p.cp}" if p.cp > 1 else ""
    experts = (f" (experts: ep {p.ep} x expert_tp {expert_tp(cfg)} of {cfg.model.moe.num_experts})"
               if cfg.model.moe.num_experts else "")
    print(f"layout: {args.world} processes = tp {p.tp}{cp} x pp {p.pp} x dp {dp}{experts}, ZeRO-{cfg.train.zero_stage}, "
          f"global batch {cfg.train.global_batch_size} = micro {cfg.train.micro_batch_size} x accumulation "
          f"{accumulation} x dp {dp}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
