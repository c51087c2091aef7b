"""What train.diagnostics_interval costs: training steps and live diagnostics (the copy head's
gradient path and the bottleneck, cplm_dist.train.diagnostics) timed alternately in one process,
on the quickstart config's model and data.

    python tools/bench_diagnostics.py --config configs/quickstart.yaml --rounds 20 --interval 50

Prints the median step, the median diagnostics call, and the share of the step time that one
call every `interval` steps adds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv=None) -> int:
    from cplm_dist.config import load_config
    from cplm_dist.data.gpt_data import check_data
    from cplm_dist.data.staged_loader import build_train_data
    from cplm_dist.distributed import default_device, destroy_distributed, init_distributed
    from cplm_dist.train.diagnostics import diagnose
    from cplm_dist.training.step import build_train_step

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--interval", type=int, default=50)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    cfg.train.train_steps = max(cfg.train.train_steps, 2 * args.rounds + 10)
    dims = init_distributed(1)
    device = default_device()
    step = build_train_step(cfg, dims, device)
    _, loader = build_train_data(cfg, dims, check_data(cfg), 0)
    steps, calls = [], []
    for i in range(args.rounds + 2):
        start = time.perf_counter()
        step(loader)
        steps.append(time.perf_counter() - start)
        start = time.perf_counter()
        diagnose(step.engine, step.last_batch, device)
        calls.append(time.perf_counter() - start)
    steps, calls = steps[2:], calls[2:]  # the first rounds warm up
    s, d = statistics.median(steps), statistics.median(calls)
    print(f"step {s * 1e3:.1f} ms, diagnostics {d * 1e3:.1f} ms (median of {args.rounds} alternating rounds); "
          f"one call every {args.interval} steps adds {d / (args.interval * s):.2%} to the step time")
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
