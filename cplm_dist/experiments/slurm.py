"""Ladder points as Slurm jobs: each submitted through launch/submit.sh (the copy this installation
ships: runs.launch_script) with --resume auto, then polled with squeue until its last checkpoint is
written; a job that leaves the queue before that is an error.

submit.sh runs in the driver's own directory, so the job (which starts in the submitter's
directory) and the driver read the same relative paths, and with the driver's interpreter
(PYTHON, unless set): an installed cplm_dist has no .venv beside its launch scripts.
With --dry-run among the submit options nothing is queued: each point's sbatch command is printed.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from cplm_dist.errors import UsageError
from cplm_dist.experiments.runs import finished, launch_script, script_env


def submit(point: dict, options: list[str], log_dir: Path, log: Path) -> str:
    """Submit one point; sbatch's last word (the job id, or under --dry-run the command)."""
    cmd = [str(launch_script("submit.sh")), *options, "--job-name", f"scaling-{point['point']}",
           "--log-dir", str(log_dir), "--", *point["train_args"], "--resume", "auto"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=script_env())
    with log.open("a") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise UsageError(f"submitting {point['point']} failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    return proc.stdout.strip() if "--dry-run" in options else proc.stdout.split()[-1]


def submit_and_wait(todo: list[dict], options: list[str], out: Path, log: Path, poll_s: float = 2.0) -> bool:
    """One job a point, then wait until every one has written its last checkpoint. False under
    --dry-run (each point's sbatch command printed, nothing queued or waited for)."""
    jobs, log_dir = {}, Path(out) / "slurm"
    for p in todo:
        job = submit(p, options, log_dir, log)
        if "--dry-run" in options:
            print(f"dry run: {p['point']} would be submitted as: {job}", flush=True)
            continue
        jobs[job] = p
        print(f"submitted {p['point']} as job {job}", flush=True)
    if "--dry-run" in options:
        return False
    while jobs:
        time.sleep(poll_s)
        queued = set(subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split())
        for job, p in list(jobs.items()):
            if finished(Path(p["run_dir"]), p["steps"]):
                del jobs[job]
            elif job not in queued:
                raise UsageError(f"Slurm job {job} ({p['point']}) ended before its last checkpoint: see {log_dir}")
    return True
