"""Faults survived without a person: torchrun's elastic restarts (launch/torchrun.sh --max-restarts)
and the chaos tool's relaunch after a clean stop (tools/chaos.py), a Slurm job requeued by its
script after a rank was killed, each run finishing on its own with the straight run's final
weights bit for bit (fp32, the same two ranks). One straight run serves the module."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cplm_dist.checkpoint import final_checkpoint, same_weights
from tests.slurm_cluster import LocalSlurm, ensure_slurm
from tests.test_launchers import launch_env
from tests.test_train import argv, train

REPO = Path(__file__).resolve().parent.parent
STEPS = 16
RESUME_LINE = r"resuming at step (\d+): the previous run had reached step (\d+), (\d+) steps are recomputed"


def run_args(small_data, out):
    return argv(small_data, out, f"train.train_steps={STEPS}", "train.save_interval=4", "train.global_batch_size=4",
                "train.micro_batch_size=2", "train.collective_timeout_minutes=0.2")


@pytest.fixture(scope="module")
def straight(small_data, tmp_path_factory):
    """The uninterrupted run, 2 ranks: its final checkpoint's directory."""
    out = tmp_path_factory.mktemp("chaos") / "straight"
    assert train(2, run_args(small_data, out)) == [0, 0]
    return final_checkpoint(out, STEPS)


def resume_records(out: Path) -> list[dict]:
    lines = (out / "logs" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == "resume"]


def test_a_chaos_run_survives_a_kill_in_a_save_and_a_sigterm(small_data, tmp_path, straight):
    """A rank SIGKILLed while a checkpoint is written (torchrun restarts both ranks, which resume
    from the previous checkpoint) and a rank SIGTERMed (both save and exit 0 before the last step;
    the chaos loop relaunches): the run finishes with the straight run's weights."""
    out, report = tmp_path / "run", tmp_path / "report.json"
    cmd = [sys.executable, str(REPO / "tools/chaos.py"), "--faults", "2", "--kinds", "save-kill,term", "--seed", "3",
           "--reference", str(straight.parent.parent), "--report", str(report), "--timeout", "300", "--",
           *run_args(small_data, out)]
    proc = subprocess.run(cmd, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=400)
    print(proc.stdout, proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    r = json.loads(report.read_text())
    assert r["ok"] and r["weights_equal"] and r["tensors_compared"] > 10
    assert sorted(f["kind"] for f in r["faults"]) == ["save-kill", "term"] and r["faults_survived"] == 2
    assert r["restarts"] == 2 and r["relaunches"] == 1
    records = resume_records(out)
    assert len(records) == 2 and r["steps_lost"] == sum(x["recomputed"] for x in records)
    assert all(x["recomputed"] == x["reached"] - x["step"] >= 0 for x in records)
    saved_kill = next(f for f in r["faults"] if f["kind"] == "save-kill")
    assert any(x["step"] < saved_kill["step"] for x in records), "a kill in a save resumes from the checkpoint before"
    logs = "".join(p.read_text() for p in sorted((out / "chaos").glob("launch-*.log")))
    lines = re.findall(RESUME_LINE, logs)
    assert [(int(a), int(b), int(c)) for a, b, c in lines] == [(x["step"], x["reached"], x["recomputed"]) for x in records]
    assert "faults      2 of 2 injected, 2 survived" in proc.stdout and "weights     equal" in proc.stdout


def test_restart_options_refuse_bad_values_with_one_line():
    env = launch_env()
    for cmd, message in [
        (["launch/torchrun.sh", "--max-restarts", "-1", "--", "--config", "x"], "error: --max-restarts '-1' is not a whole number"),
        (["launch/torchrun.sh", "--max-restarts", "1.5", "--", "--config", "x"], "error: --max-restarts '1.5' is not"),
        (["launch/submit.sh", "--nodes", "1", "--gpus-per-node", "0", "--time", "00:10:00", "--max-requeues", "-2",
          "--", "--config", "x"], "error: --max-requeues '-2' is not a whole number"),
        ([sys.executable, "tools/chaos.py", "--faults", "-1", "--", "--config", "x"], "error: --faults and --max-restarts"),
        ([sys.executable, "tools/chaos.py", "--kinds", "kill,boom", "--", "--config", "x"], "error: --kinds 'kill,boom'"),
        ([sys.executable, "tools/chaos.py", "--", "--config", "configs/quickstart.yaml", "--resume", "auto"],
         "error: give the training arguments after --"),
        ([sys.executable, "tools/chaos.py", "--bogus"], "error: unrecognized arguments: --bogus"),
        ([sys.executable, "tools/chaos.py", "--", "--config", "configs/quickstart.yaml"],
         "error: hang faults wait train.collective_timeout_minutes=10.0 each"),
    ]:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        lines = [line for line in proc.stderr.splitlines() if "[WARNING]" not in line]
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(message), (cmd, proc.stderr)


def test_a_kill_during_the_first_save_restarts_afresh_but_never_over_a_completed_one(tmp_path, caplog):
    """--resume auto over step-* directories of which none is complete: a fresh start when no
    save ever completed (no `latest`: the first one was killed), else the one-line refusal."""
    from cplm_dist.checkpoint.manifest import find_resume
    from cplm_dist.config import load_config
    from cplm_dist.errors import CheckpointError

    cfg = load_config("tiny", [f"train.out_dir={tmp_path}"])
    half = tmp_path / "checkpoints" / "step-00000004"
    half.mkdir(parents=True)
    (half / "mp_rank_00_model_states.pt").write_bytes(b"half written")
    assert find_resume(cfg, "auto", 1, 1) is None and "no save there ever completed" in caplog.text
    (tmp_path / "checkpoints" / "latest").write_text("step-00000002\n")  # one completed once (since damaged)
    with pytest.raises(CheckpointError, match="no complete checkpoint in"):
        find_resume(cfg, "auto", 1, 1)


def test_a_resume_record_counts_the_steps_of_the_run_before_it_only(tmp_path):
    from cplm_dist.training.run_log import lost_steps, previous_reach

    metrics = tmp_path / "metrics.jsonl"

    def reach(*records):
        metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
        return previous_reach(metrics)

    train = [{"event": "train", "step": s} for s in range(1, 8)]
    resume = {"event": "resume", "step": 4, "reached": 7, "recomputed": 3}
    assert reach() == 0 and reach(*train) == 7 and reach(*train, resume) == 4 and lost_steps(metrics) == 3
    assert reach(*train, resume, *train[4:6]) == 6  # the run after the resume got to step 6
    assert reach(*train, *train[:3]) == 3  # a start from scratch (no checkpoint yet) begins a new run
    assert reach(*train, {"event": "valid", "step": 7}) == 7


def training_ranks(out: Path) -> dict[int, int]:
    """{rank: pid} of the cplm_dist.train processes writing `out` (not srun's or torchrun's own)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            env = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "cplm_dist.train" in args[1:4] and f"train.out_dir={out}" in args:  # python [-u] -m cplm_dist.train
            found.update({int(e[5:]): int(pid) for e in env if e.startswith("RANK=")})
    return found


@pytest.fixture
def slurm(tmp_path_factory):
    """slurmctld and one slurmd on localhost (tests/slurm_cluster.py)."""
    reason = ensure_slurm()
    if reason:
        pytest.skip(reason)
    s = LocalSlurm(tmp_path_factory.mktemp("slurm1")).start()
    yield s
    s.stop()


def test_slurm_requeues_a_job_whose_rank_was_killed_and_it_finishes_exactly(slurm, small_data, tmp_path, straight):
    """launch/submit.sh --torchrun on one node, two ranks: rank 1 SIGKILLed mid-run, torchrun
    (no restarts of its own here) ends with exit 1, the batch script requeues the job
    (--max-requeues 2 -> CPLM_MAX_REQUEUES) and the requeued job resumes and finishes."""
    out, logs = tmp_path / "run", tmp_path / "logs"
    cmd = ["launch/submit.sh", "--torchrun", "--nodes", "1", "--gpus-per-node", "0", "--time", "00:10:00", "--log-dir",
           str(logs), "--job-name", "cplm-chaos", "--max-requeues", "2", "--", *run_args(small_data, out)]
    env = {**launch_env(), **slurm.env, "CPLM_PROCS_PER_NODE": "2"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.split()[-1]
    metrics, deadline = out / "logs" / "metrics.jsonl", time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().count('"event": "train"') >= 6):
        assert time.monotonic() < deadline, "no step 6"
        time.sleep(0.02)
    os.kill(training_ranks(out)[1], signal.SIGKILL)
    state, requeued, nudged = {}, None, False
    while time.monotonic() < deadline and state.get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED"):
        time.sleep(0.5)
        state = slurm.job(job)
        if state.get("JobState") == "PENDING" and state.get("Restarts") == "1":
            requeued = requeued or time.monotonic()
            # requeued by the script: once its old credential expired (cred_expire=5 s in
            # tests/slurm_cluster.py; sooner, slurmctld kills it as "credential revoked") start it
            # now, not at the next backfill pass (every 30 s)
            if not nudged and time.monotonic() - requeued > 6:
                nudged = slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now", check=False) is not None
    log = "".join(p.read_text() for p in logs.glob("*.out"))
    assert state.get("JobState") == "COMPLETED" and state.get("Restarts") == "1", (state, log[-3000:])
    assert "[slurm] training ended with exit 1 (a failed step, a lost rank or host): requeueing job" in log
    assert "(restart 1 of at most 2)" in log  # --max-requeues reached the job as CPLM_MAX_REQUEUES
    (record,) = resume_records(out)
    assert record["reached"] >= 6 and record["step"] % 4 == 0 and f"resuming at step {record['step']}:" in log
    equal, tensors = same_weights(final_checkpoint(out, STEPS), straight)
    assert equal and tensors > 10
