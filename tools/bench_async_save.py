"""How long a checkpoint save blocks the step loop, synchronous vs `train.async_save`: the real
trainer (one process per run, `--nproc` ranks under torchrun) saving every few steps, the blocked time
and the background write time read from its log lines. A benchmark: figures go to the console
(and --json), never into a test.

    python tools/bench_async_save.py                                   # cplm-135m, 1 CPU process, bf16, ZeRO-1
    python tools/bench_async_save.py --config configs/runs/cplm-1.7b.yaml --save-interval 4   # on a GPU

Blocked: the wall time of Checkpointer.save in the step loop (synchronous: everything; asynchronous:
DeepSpeed's state_dict calls, the copy to host memory, and waiting for the previous save when it is
still being written). Written: the background thread's time to write, hash and complete the save.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from cplm_dist.config.cli import exit_on_usage_error
from cplm_dist.errors import UsageError

REPO = Path(__file__).resolve().parent.parent
BLOCKED = re.compile(r"^step +(\d+): (saved|saving) .*the step loop blocked ([\d.]+)s\)")
WRITTEN = re.compile(r"complete \(written in the background in ([\d.]+)s\)")
STEP = re.compile(r"^step +\d+/\d+ \| loss")


def run(config: str, async_save: bool, saves: int, interval: int, nproc: int, out: Path, extra: list[str]) -> dict:
    """One training run saving every `interval` steps; the median blocked and written seconds of
    its saves (the first aside: it also copies the tokenizer and warms the allocator)."""
    overrides = [f"train.train_steps={saves * interval}", f"train.save_interval={interval}", "train.keep_last=1", "train.log_interval=1",
                 "train.eval_interval=100000", "optim.warmup_steps=0", f"train.async_save={str(async_save).lower()}",
                 f"train.out_dir={out}", "train.tensorboard=false", *extra]
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
                if nproc > 1 else [sys.executable])
    cmd = [*launcher, "-m", "cplm_dist.train", "--config", config, *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"error: the run failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    lines = proc.stdout.splitlines()
    blocked = [float(m.group(3)) for m in map(BLOCKED.match, lines) if m][1:]
    written = [float(m.group(1)) for line in lines if (m := WRITTEN.search(line))][1:]
    size = sum(p.stat().st_size for p in (out / "checkpoints").rglob("*") if p.is_file()) / max(1, len(
        list((out / "checkpoints").glob("step-*"))))
    return {"async_save": async_save, "saves": len(blocked), "blocked_s": statistics.median(blocked) if blocked else None,
            "written_s": statistics.median(written) if written else None, "checkpoint_gb": size / 1e9}


def quickstart_data() -> list[str]:
    """Overrides pointing a run config at the quickstart data (tools/build_quickstart_data.py)."""
    data = REPO / "data" / "quickstart"
    if not (data / "tokenizer.model").is_file():
        raise UsageError(f"{data} is missing: build it with python tools/build_quickstart_data.py --out data/quickstart")
    return [f"data.tokenizer={data / 'tokenizer.model'}", "data.num_workers=0",
            f"data.blend=[{{path: {data / 'stdlib'}, weight: 0.5}}, {{path: {data / 'synthetic-copy'}, weight: 0.5}}]"]


@exit_on_usage_error
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs/runs/cplm-135m.yaml"))
    p.add_argument("--saves", type=int, default=3, help="saves in a run (the first is not counted)")
    p.add_argument("--save-interval", type=int, default=8,
                   help="steps between saves: long enough for a background write to end before the next save")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--json", help="write the figures here too")
    p.add_argument("overrides", nargs="*", help="more config overrides (key=value)")
    args = p.parse_args(argv)
    if args.saves < 2 or args.save_interval < 1 or args.nproc < 1:
        raise UsageError("--saves must be >= 2 (the first is not counted), --save-interval and --nproc >= 1")
    extra = [f"data.seq_length={args.seq_length}", "train.micro_batch_size=1", f"train.global_batch_size={args.nproc}",
             "train.compile=false", *quickstart_data(), *args.overrides]
    rows = []
    for async_save in (False, True):
        out = Path(tempfile.mkdtemp(prefix="bench-async-save-"))
        try:
            rows.append(run(args.config, async_save, args.saves, args.save_interval, args.nproc, out / "run", extra))
        finally:
            shutil.rmtree(out, ignore_errors=True)
    print(f"{'save':<14}{'checkpoint GB':>14}{'blocked s':>11}{'written s':>11}")
    for r in rows:
        written = f"{r['written_s']:.2f}" if r["written_s"] is not None else "-"
        print(f"{'async' if r['async_save'] else 'sync':<14}{r['checkpoint_gb']:>14.2f}{r['blocked_s']:>11.2f}{written:>11}")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": args.config, "nproc": args.nproc, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
