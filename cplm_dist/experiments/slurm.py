"""Ladder points as Slurm jobs: each submitted through launch/submit.sh (the copy this installation
ships: runs.launch_script) with --resume auto and the job size of its recipe (ladder_recipe.py),
then polled with squeue until its last checkpoint is written; a job that leaves the queue before
that is an error. Each trained point is then evaluated in a job of its own (`evaluate_in_jobs`:
sbatch --wrap, one node, a GPU where the ladder's jobs have them, tp ranks under torchrun for a
tp > 1 checkpoint), never on the host that runs the driver (a login node).

submit.sh runs in the driver's own directory, so the job (which starts in the submitter's
directory) and the driver read the same relative paths, and with the driver's interpreter
(PYTHON, unless set): an installed cplm_dist has no .venv beside its launch scripts.
With --dry-run among the submit options nothing is queued: each point's sbatch command is printed.
"""

from __future__ import annotations

import shlex
import subprocess
import time
from pathlib import Path

from cplm_dist.errors import UsageError
from cplm_dist.experiments.runs import finished, launch_script, script_env


def submit_command(point: dict, options: list[str], log_dir: Path) -> list[str]:
    """launch/submit.sh with the ladder's options, then the point's job size (the last wins)."""
    return [str(launch_script("submit.sh")), *options, *point.get("submit_options", []),
            "--job-name", f"scaling-{point['point']}", "--log-dir", str(log_dir), "--", *point["train_args"], "--resume", "auto"]


def submit(point: dict, options: list[str], log_dir: Path, log: Path) -> str:
    """Submit one point; sbatch's last word (the job id, or under --dry-run the command)."""
    cmd = submit_command(point, options, log_dir)
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


# submit.sh options that size or name a training job: an evaluation job sets its own
SUBMIT_ONLY = {"--nodes": 1, "--gpus-per-node": 1, "--tasks-per-node": 1, "--cpus-per-task": 1, "--job-name": 1,
               "--log-dir": 1, "--max-requeues": 1, "--torchrun": 0, "--wait": 0, "--dry-run": 0}


def sbatch_options(options: list[str]) -> list[str]:
    """The ladder's submit.sh options an evaluation job keeps: --time, --partition, --account and
    any other sbatch option (--qos, --constraint, ...); the job's size and name are its own."""
    out, i = [], 0
    while i < len(options):
        word = options[i]
        name = word.split("=", 1)[0]
        if name in SUBMIT_ONLY:
            i += 1 + (SUBMIT_ONLY[name] if "=" not in word else 0)
            continue
        out.append(word)
        i += 1
    return out


def evaluation_job(point: dict, evaluate: list[str], tasks: list[str], samples: int, options: list[str], out: Path) -> list[str]:
    """The sbatch command that evaluates one trained point (its eval.json in <point>/eval)."""
    gpus = max((int(v) for k, v in zip(options, options[1:]) if k == "--gpus-per-node"), default=0)
    tp = point.get("tp", 1)
    run_eval = evaluate if tp == 1 else [evaluate[0], "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                          str(tp), *evaluate[1:]]
    command = [*run_eval, "--checkpoint", point["run_dir"], "--tasks", *tasks, "--samples", str(samples),
               "--valid-batches", "0", "--out", str(Path(point["run_dir"]) / "eval")]
    size = ["--nodes", "1", "--ntasks", "1", *(["--gpus-per-node", str(min(gpus, tp))] if gpus else [])]
    return ["sbatch", "--parsable", *sbatch_options(options), *size, "--job-name", f"scaling-eval-{point['point']}",
            "--output", str(Path(out) / "slurm" / "%x-%j.out"), "--chdir", str(Path.cwd()),
            "--wrap", f"OMP_NUM_THREADS=${{SLURM_CPUS_PER_TASK:-1}} {shlex.join(command)}"]


def evaluate_in_jobs(points: list[dict], evaluate: list[str], tasks: list[str], samples: int, options: list[str],
                     out: Path, log: Path, poll_s: float = 2.0) -> bool:
    """Each finished point without an eval.json evaluated in a Slurm job of its own, waited for.
    False under --dry-run (each job's sbatch command printed, nothing queued)."""
    if not tasks or tasks == ["none"]:
        return True
    dry = "--dry-run" in options
    jobs = {}
    for p in points:
        if (Path(p["run_dir"]) / "eval" / "eval.json").exists() or not (dry or finished(Path(p["run_dir"]), p["steps"])):
            continue
        cmd = evaluation_job(p, evaluate, tasks, samples, options, out)
        if dry:
            print(f"dry run: the evaluation of {p['point']} would be submitted as: {shlex.join(cmd)}", flush=True)
            continue
        (Path(out) / "slurm").mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        with log.open("a") as f:
            f.write(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            last = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
            raise UsageError(f"submitting the evaluation of {p['point']} failed: {last}")
        job = proc.stdout.strip().split(";")[0]
        jobs[job] = p
        print(f"submitted the evaluation of {p['point']} as job {job}", flush=True)
    if dry:
        return False
    while jobs:
        time.sleep(poll_s)
        queued = set(subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split())
        for job, p in list(jobs.items()):
            if job not in queued:
                del jobs[job]
                if not (Path(p["run_dir"]) / "eval" / "eval.json").exists():
                    raise UsageError(f"Slurm job {job} (evaluating {p['point']}) ended without its eval.json: see {out}/slurm")
    return True
