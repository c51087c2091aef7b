"""Profiler sweeps (tools/cplm_profile.py --sweep): a grid of settings, every point's config
validated before anything launches, then each point profiled in a fresh launch of its own (a new
process group and allocator per point), its JSON collected into one CSV and a plot per variable.

    grid = parse_sweep(["zero=0,1,2", "micro=1,2,4"])
    points, skipped = sweep_points("tiny", overrides, grid)     # skipped: (point, the config's one-line reason)
    results = run_sweep(points, grid, out_dir, point_command)   # point_command: one point's single-process command
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from cplm_dist.config import Config, load_config
from cplm_dist.errors import UsageError
from cplm_dist.profiling.records import append_csv

SWEEPABLE = {  # --sweep name -> config override (a value list follows the '=')
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "cp": "parallel.cp",
    "zero": "train.zero_stage",
    "micro": "train.micro_batch_size",
    "ckpt": "train.activation_checkpointing",
    "copy": "copy.enabled",
    "copy_impl": "copy.impl",
    "chunk": "copy.chunk_size",
    "seq": "data.seq_length",
    "precision": "train.precision",
}


def parse_sweep(items: list[str]) -> dict[str, list[str]]:
    grid = {}
    for item in items:
        name, _, values = item.partition("=")
        if name not in SWEEPABLE or not values:
            raise UsageError(f"--sweep {item!r}: use NAME=V1,V2 with NAME one of {sorted(SWEEPABLE)}")
        grid[name] = values.split(",")
    return grid


def sweep_points(config: str, overrides: list[str], grid: dict[str, list[str]]
                 ) -> tuple[list[tuple[dict, list[str], Config]], list[tuple[dict, str]]]:
    """The grid's points whose config is valid, as (point, overrides, config), and the others as
    (point, the config's one-line reason): a grid may cross settings that exclude each other
    (pp=2 with zero=2), and those points are skipped, not the sweep. All invalid: a UsageError."""
    valid, skipped = [], []
    for values in itertools.product(*grid.values()):
        point = dict(zip(grid, values))
        point_overrides = [f"{SWEEPABLE[k]}={v}" for k, v in point.items()]
        if "seq" in point and point["seq"].isdigit():
            point_overrides.append(f"model.max_seq_len={max(int(point['seq']), 1)}")
        try:
            valid.append((point, point_overrides, load_config(config, overrides + point_overrides)))
        except UsageError as e:
            skipped.append((point, str(e)))
    if not valid:
        point, reason = skipped[0]
        raise UsageError(f"no valid sweep point: {point}: {reason}")
    return valid, skipped


def launch_point(command: list[str], nproc: int, point: dict) -> None:
    """Run one point's single-process `command` (its argv, the interpreter first), under torchrun
    for nproc > 1; a failure is one line with the command's last line of output."""
    if nproc > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *command[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1" if nproc > 1 else str(os.cpu_count()))}
    print(f"sweep point {point}: {nproc} process(es)", flush=True)
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise UsageError(f"sweep point {point} failed (exit {proc.returncode}): {tail[0]}")


def run_sweep(points: list[tuple[dict, list[str], Config]], grid: dict, out: Path,
              point_command: Callable[[dict, list[str], Path], list[str]], nproc: int | None = None) -> list[dict]:
    """Each point launched on its own (`nproc` processes, default the point's tp x cp x pp):
    point_command(point, its overrides, the JSON file it must write) is its command. The results
    (sweep_<name> fields first) go to out/sweep.csv as they come, then the plots."""
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for point, overrides, cfg in points:
        with tempfile.TemporaryDirectory() as tmp:
            result_file = Path(tmp) / "point.json"
            launch_point(point_command(point, overrides, result_file), nproc or cfg.parallel.tp * cfg.parallel.cp * cfg.parallel.pp, point)
            result = {**{f"sweep_{k}": v for k, v in point.items()}, **json.loads(result_file.read_text())}
        results.append(result)
        append_csv(out / "sweep.csv", result)
    plots = plot_sweep(results, grid, out)
    print(f"sweep: {len(results)} points -> {out / 'sweep.csv'}" + "".join(f"\n  {p}" for p in plots))
    return results


def plot_sweep(results: list[dict], grid: dict, out: Path) -> list[Path]:
    """One PNG per swept variable: tokens/s and step memory against it, a line per other setting."""
    from cplm_dist.plotting import figure, lines

    paths = []
    for var in grid:
        others = [k for k in grid if k != var]
        key = lambda r: ", ".join(f"{k}={r[f'sweep_{k}']}" for k in others) or "all"  # noqa: E731
        speed, memory = {}, {}
        for r in results:
            speed.setdefault(key(r), []).append((r[f"sweep_{var}"], r["tokens_per_s"]))
            memory.setdefault(key(r), []).append((r[f"sweep_{var}"], r["step_memory_gb"]))
        path = out / f"sweep_{var}.png"
        with figure(path, ncols=2, size=(10, 4)) as (ax_t, ax_m):
            lines(ax_t, speed, xlabel=var, ylabel="tokens/s (global)", title=f"throughput vs {var}")
            lines(ax_m, memory, xlabel=var, ylabel="GB above baseline (peak)", title=f"memory vs {var}")
        paths.append(path)
    return paths
