"""Launchers on one host: torchrun (2 processes, with a SIGTERM preemption and an exact resume),
the launch scripts' usage errors and the Slurm submit helper's dry run. mpirun, DeepSpeed's
launcher, Slurm (preempted with SIGUSR1, requeued and resumed) and the scaling driver's Slurm jobs
run across two hosts in tests/test_multihost.py, which shares this module's `reference` run.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cplm_dist.training.run_log import read_metrics
from tests.spawn import run_ranks
from tests.test_train import argv, losses

REPO = Path(__file__).resolve().parent.parent
STEPS = 12


def launch_env():
    return {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


def train_args(small_data, out, *extra):
    # argv() starts with --config; drop the leading script-only options
    return argv(small_data, out, f"train.train_steps={STEPS}", "train.save_interval=1000", *extra)


def _train(args):
    from cplm_dist.train.driver import main

    return main(args)


@pytest.fixture(scope="session")
def reference(small_data, tmp_path_factory):
    """The uninterrupted run: 2 ranks, dp = 2 (one run for this module and tests/test_multihost.py)."""
    out = tmp_path_factory.mktemp("launchers") / "reference"
    assert run_ranks(_train, 2, args=(train_args(small_data, out),)) == [0, 0]
    return losses(out)


def wait_for_steps(out: Path, n: int, proc=None, timeout=180) -> None:
    deadline = time.monotonic() + timeout
    metrics = out / "logs" / "metrics.jsonl"
    while time.monotonic() < deadline:
        if metrics.exists() and len(read_metrics(metrics)) >= n:
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the launch ended (rc {proc.returncode}) before step {n}")
        time.sleep(0.1)
    raise AssertionError(f"no step {n} within {timeout}s")


def assert_same_losses(got: dict, want: dict, tol: float):
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        assert abs(got[step] - want[step]) <= tol, (step, got[step], want[step])


def test_torchrun_two_processes_sigterm_then_exact_resume(small_data, tmp_path, reference):
    out = tmp_path / "torchrun"
    cmd = [str(REPO / "launch/torchrun.sh"), "--nproc-per-node", "2", "--", *train_args(small_data, out)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_steps(out, 3, proc)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, workers
    for pid in workers:  # what a scheduler does at preemption: SIGTERM to every rank
        os.kill(int(pid), signal.SIGTERM)
    log, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, log[-3000:]
    assert "on request; continue with --resume auto" in log
    latest = (out / "checkpoints" / "latest").read_text().strip()
    stopped_at = int(latest.split("-")[1])
    assert 3 <= stopped_at < STEPS and (out / "checkpoints" / latest / "complete.json").exists()
    resumed = subprocess.run(cmd + ["--resume", "auto"], cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resuming {latest}" in resumed.stdout + resumed.stderr
    assert_same_losses(losses(out), reference, 1e-6)


def test_submit_helper_dry_run_and_usage_errors():
    base = [str(REPO / "launch/submit.sh"), "--nodes", "2", "--gpus-per-node", "8", "--time", "24:00:00",
            "--partition", "gpu", "--dry-run"]
    line = subprocess.run(base + ["--", "--config", "configs/runs/cplm-1.7b.yaml"], capture_output=True, text=True).stdout
    assert line.split()[:9] == ["sbatch", "--job-name", "cplm", "--nodes", "2", "--ntasks-per-node", "8", "--time", "24:00:00"]
    assert "--gpus-per-node 8" in line and "--partition gpu" in line and line.rstrip().endswith("--config configs/runs/cplm-1.7b.yaml")
    torch_line = subprocess.run(base + ["--torchrun", "--", "--config", "configs/runs/cplm-1.7b.yaml", "parallel.tp=2",
                                        "parallel.pp=2", "train.zero_stage=1", "--resume", "auto"], capture_output=True, text=True)
    assert "--ntasks-per-node 1" in torch_line.stdout and "slurm-torchrun.sbatch" in torch_line.stdout
    assert "layout: 16 processes = tp 2 x pp 2 x dp 4" in torch_line.stderr
    # the job's size is checked before it queues: tp x pp must divide nodes x tasks
    refused = subprocess.run(base + ["--", "--config", "configs/runs/cplm-1.7b.yaml", "parallel.tp=2", "parallel.pp=3"],
                             capture_output=True, text=True)
    assert refused.returncode == 2 and not refused.stdout
    assert refused.stderr.strip() == ("error: parallel.tp=2 x parallel.pp=3 = 6 does not divide WORLD_SIZE=16 (dp = world / "
                                      "(tp x pp) must be whole; tp x pp must be one of [1, 2, 4, 8, 16])")
    bad = subprocess.run([str(REPO / "launch/submit.sh"), "--nodes", "1", "--gpus-per-node", "8", "--", "--config", "x"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --time HH:MM:SS is required")


def test_launch_scripts_refuse_bad_usage():
    for script, args, message in [
        ("mpirun.sh", ["--", "--config", "x"], "error: -np N is required"),
        ("torchrun.sh", ["--nnodes", "2", "--", "--config", "x"], "error: --nnodes 2 needs --master HOST:PORT"),
        ("deepspeed.sh", ["--bogus", "1"], "error: unknown option --bogus"),
    ]:
        proc = subprocess.run([str(REPO / "launch" / script), *args], capture_output=True, text=True, env=launch_env())
        assert proc.returncode == 2 and proc.stderr.startswith(message), (script, proc.stderr)


def submit_dry_run(*options, path=None):
    """launch/submit.sh ... --dry-run -- --config ...; PYTHON=true skips the layout check before
    sbatch (its own test is above): what these tests read is the sbatch line."""
    env = {**os.environ, "PYTHON": "true", "PATH": path or os.environ["PATH"]}
    return subprocess.run([str(REPO / "launch/submit.sh"), "--nodes", "2", "--gpus-per-node", "8", "--time", "24:00:00",
                           *options, "--dry-run", "--", "--config", "configs/runs/cplm-1.7b.yaml"],
                          capture_output=True, text=True, env=env, timeout=60)


def test_submit_passes_other_sbatch_options_through_and_sizes_cpus_per_task(tmp_path):
    """Options submit.sh does not take itself reach sbatch as given (`--opt=v`, `--opt v`, a bare
    flag), after its own and before the script; --cpus-per-task is a node's CPUs (sinfo: the
    partition's smallest node) / tasks per node. The sinfo here is a stand-in for a cluster's,
    answering `sinfo -h -o '%P %c' -p gpu` as one with 96- and 128-CPU nodes would."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sinfo").write_text('#!/bin/sh\n[ "$*" = "-h -o %P %c -p gpu" ] || exit 1\nprintf "gpu 128+\\ngpu 96\\n"\n')
    (bin_dir / "sinfo").chmod(0o755)
    proc = submit_dry_run("--partition", "gpu", "--qos", "high", "--exclusive", "--mem=0", "--constraint", "h100",
                          "--foo=bar", "--requeue", path=f"{bin_dir}:{os.environ['PATH']}")
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.split()
    assert words[words.index("--cpus-per-task") + 1] == "12"  # 96 CPUs / 8 tasks
    script = next(i for i, w in enumerate(words) if w.endswith("slurm.sbatch"))
    assert words[script - 8:script] == ["--qos", "high", "--exclusive", "--mem=0", "--constraint", "h100", "--foo=bar",
                                        "--requeue"], proc.stdout
    # --torchrun: one task a node, so it gets the node's CPUs; an explicit --cpus-per-task wins
    torchrun = submit_dry_run("--torchrun", "--partition=gpu", path=f"{bin_dir}:{os.environ['PATH']}").stdout.split()
    assert torchrun[torchrun.index("--cpus-per-task") + 1] == "96" and "--partition" in torchrun
    given = submit_dry_run("--partition", "gpu", "--cpus-per-task=4", path=f"{bin_dir}:{os.environ['PATH']}").stdout.split()
    assert given[given.index("--cpus-per-task") + 1] == "4"
    per_gpu = submit_dry_run("--partition", "gpu", "--cpus-per-gpu", "12", path=f"{bin_dir}:{os.environ['PATH']}").stdout
    assert "--cpus-per-gpu 12" in per_gpu and "--cpus-per-task" not in per_gpu  # sbatch takes one of the two
    # where no sinfo answers, none is set and one line says so
    (tmp_path / "down").mkdir()
    (tmp_path / "down" / "sinfo").write_text("#!/bin/sh\necho 'sinfo: error: Unable to contact slurm controller' >&2\nexit 1\n")
    (tmp_path / "down" / "sinfo").chmod(0o755)
    unknown = submit_dry_run("--partition", "gpu", path=f"{tmp_path / 'down'}:{os.environ['PATH']}")
    assert unknown.returncode == 0 and "--cpus-per-task" not in unknown.stdout, unknown.stdout
    assert unknown.stderr.startswith("note: --cpus-per-task not set: sinfo could not tell the CPUs of a node of partition gpu")


@pytest.mark.parametrize("options, message", [
    (["-q", "high"], "error: short option -q: give sbatch options in their long form (e.g. --qos=high for -q high)"),
    (["--ntasks-per-node", "4"], "error: --ntasks-per-node is set by launch/submit.sh: use --tasks-per-node"),
    (["--output=x.log"], "error: --output is set by launch/submit.sh: the log is <--log-dir>/<name>-<jobid>.out"),
    (["--wrap", "hostname"], "error: --wrap does not fit launch/submit.sh: it submits launch/slurm.sbatch"),
    (["stray"], "error: unexpected argument 'stray' before -- (training arguments go after --"),
], ids=["short-option", "ntasks-per-node", "output", "wrap", "stray-word"])
def test_submit_refuses_sbatch_options_that_do_not_fit_this_job(options, message):
    proc = submit_dry_run(*options)
    assert proc.returncode == 2 and not proc.stdout and proc.stderr.startswith(message), proc.stderr
