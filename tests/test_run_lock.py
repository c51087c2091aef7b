"""The run lock on train.out_dir (cplm_dist/checkpoint/run_lock.py): a second trainer on a run
directory refuses in one line naming the first, exit 2, writing nothing, and the first goes on; a
lock whose holder is gone (a dead pid here, a stale heartbeat from another host) is taken over with
a warning; a restarted job waits for its predecessor. Real processes hold the locks."""

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cplm_dist.checkpoint import LOCK_NAME, RESUMABLE_CHANGES, RunLock, read_holder
from cplm_dist.config import load_config
from cplm_dist.errors import ConfigError, UsageError
from tests.test_train import argv

REPO = Path(__file__).resolve().parent.parent
HOST = socket.gethostname()
JOB_VARS = ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")

# another process holding the flock, with the record a trainer writes (plain Python: starts at once)
HOLD = """
import fcntl, json, os, socket, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
now = time.time()
os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "job": sys.argv[2] or None,
                         "restart": [0, 0], "started": now, "heartbeat": now}).encode())
print("locked", flush=True)
time.sleep(float(sys.argv[3]))
"""


@pytest.fixture(autouse=True)
def no_job(monkeypatch):
    for var in JOB_VARS:
        monkeypatch.delenv(var, raising=False)


def hold(path: Path, seconds: float, job: str = "") -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path), job, str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    proc.stdout.close()
    return proc


def write_record(path: Path, *, host=HOST, pid=1, job=None, restart=(0, 0), age=0.0) -> bytes:
    now = time.time()
    data = json.dumps({"host": host, "pid": pid, "job": job, "restart": list(restart), "started": now - age - 60,
                       "heartbeat": now - age}).encode()
    path.write_bytes(data)
    return data


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def takeovers(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("taking over the run lock")]


def refusal(out: Path, host: str, pid: int, job: str = "none") -> str:
    return f"train.out_dir={out} is in use by another trainer (host {host}, pid {pid}, job {job}, started "


# --- end to end: two trainers, one out_dir --------------------------------------------------------


def test_a_second_trainer_on_the_same_out_dir_refuses_in_one_line_and_the_first_goes_on(small_data, tmp_path):
    """The second is two ranks: rank 0 decides, both end with its line, neither hangs."""
    from cplm_dist.distributed import free_port

    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARS} | {"OMP_NUM_THREADS": "1"}
    # as a requeue script launches it (a fresh command line on a run that logged is refused anyway: "already holds a run")
    args = argv(small_data, out, "train.train_steps=400", "train.tensorboard=false") + ["--resume", "auto"]
    logs = {name: open(tmp_path / name, "w") for name in ("first.out", "first.err", "0.out", "0.err", "1.out", "1.err")}
    first = subprocess.Popen([sys.executable, "-m", "cplm_dist.train", *args], stdout=logs["first.out"],
                             stderr=logs["first.err"], text=True, cwd=REPO, env=env)
    # the second's ranks import everything meanwhile and start on "go": what is timed is their start-up alone
    port, second = free_port(), []
    for rank in (0, 1):
        ranks = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        second.append(subprocess.Popen(
            [sys.executable, "-c", "import sys; from cplm_dist.train.driver import main; sys.stdin.readline(); sys.exit(main(sys.argv[1:]))",
             *args], stdin=subprocess.PIPE, stdout=logs[f"{rank}.out"], stderr=logs[f"{rank}.err"], text=True, cwd=REPO,
            env=env | ranks))
    try:
        deadline = time.monotonic() + 120
        while not any(line.startswith("step ") for line in (tmp_path / "first.out").read_text().splitlines()):
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.err").read_text()[-3000:]
            time.sleep(0.2)
        before = sorted(p.relative_to(out) for p in out.rglob("*"))
        start = time.monotonic()
        for rank in second:
            rank.stdin.write("go\n")
            rank.stdin.close()
        results = [(proc.wait(timeout=60), (tmp_path / f"{rank}.out").read_text(), (tmp_path / f"{rank}.err").read_text())
                   for rank, proc in enumerate(second)]
        took = time.monotonic() - start
        assert [rc for rc, _, _ in results] == [2, 2], results[0][2][-3000:] + results[1][2][-3000:]
        last = results[0][2].strip().splitlines()[-1]
        assert last.startswith("error: " + refusal(out, HOST, first.pid)), last
        assert last.endswith(f"; {out / LOCK_NAME}): wait for it to end or stop it, or choose another train.out_dir (a "
                             "holder that is gone is taken over: at once on its host, after train.lock_stale_minutes=10.0 "
                             "from another host)"), last
        for _, stdout, stderr in results:  # every rank: the same one line, before the model
            assert [line for line in stderr.splitlines() if line.startswith(("error", "Traceback"))] == [last]
            assert "building the model" not in stdout
        assert took < 60, took  # bounded: seconds, not a collective timeout
        assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # nothing new: no second log, no checkpoint
        assert read_holder(out / LOCK_NAME).pid == first.pid  # its record untouched
        assert first.poll() is None, "the first trainer goes on"
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=60) == 0, (tmp_path / "first.err").read_text()[-3000:]
    finally:
        for proc in (first, *second):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for f in logs.values():
            f.close()
    assert "continue with --resume auto" in (tmp_path / "first.out").read_text()
    assert (out / "checkpoints" / "latest").exists()
    assert not (out / LOCK_NAME).exists(), "released: a clean exit leaves no lock file"


# --- the protocol, without training ---------------------------------------------------------------


def test_a_lock_left_by_a_dead_process_on_this_host_is_taken_over_with_a_warning(tmp_path, caplog):
    pid = dead_pid()
    write_record(tmp_path / LOCK_NAME, pid=pid, job="77", age=3600)
    with caplog.at_level(logging.WARNING):
        lock = RunLock.acquire(tmp_path, 10)
    assert len(takeovers(caplog)) == 1 and f"pid {pid} is gone" in takeovers(caplog)[0], caplog.text
    mine = read_holder(tmp_path / LOCK_NAME)
    assert (mine.host, mine.pid, mine.job) == (HOST, os.getpid(), None) and mine.age() < 5
    with pytest.raises(UsageError, match=re.escape(refusal(tmp_path, HOST, os.getpid()))):
        RunLock.acquire(tmp_path, 10)  # another claim, even from this process, is refused while held
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()
    # a new out_dir is made for the lock, and removed with it when the run wrote nothing else
    fresh = tmp_path / "a" / "b"
    RunLock.acquire(fresh, 10).release()
    assert not (tmp_path / "a").exists()


def test_another_hosts_lock_is_refused_while_it_beats_and_taken_over_once_stale(tmp_path, caplog):
    path = tmp_path / LOCK_NAME
    fresh = write_record(path, host="node-elsewhere", pid=4321, age=30)
    with pytest.raises(UsageError) as refused:
        RunLock.acquire(tmp_path, 10)  # the flock is free here: a shared filesystem whose locks do not reach us
    assert str(refused.value).startswith(refusal(tmp_path, "node-elsewhere", 4321))
    assert re.search(r", heartbeat 3\ds ago; ", str(refused.value)), refused.value
    assert path.read_bytes() == fresh
    write_record(path, host="node-elsewhere", pid=4321, age=11 * 60)
    with caplog.at_level(logging.WARNING):
        lock = RunLock.acquire(tmp_path, 10)
    assert takeovers(caplog) and "host node-elsewhere, pid 4321" in takeovers(caplog)[0]
    assert "heartbeat is older than train.lock_stale_minutes=10" in takeovers(caplog)[0]
    # the heartbeat thread keeps the record fresh (every stale/3 s at a tiny bound)
    lock.release()
    beating = RunLock.acquire(tmp_path, 0.02)
    first = read_holder(path).heartbeat
    time.sleep(0.9)
    assert read_holder(path).heartbeat > first
    beating.release()


def test_a_flock_held_by_another_live_process_is_refused_at_once(tmp_path):
    holder = hold(tmp_path / LOCK_NAME, 30)
    try:
        start = time.monotonic()
        with pytest.raises(UsageError) as refused:
            RunLock.acquire(tmp_path, 10)
        assert time.monotonic() - start < 3
        assert str(refused.value).startswith(refusal(tmp_path, HOST, holder.pid))
        assert read_holder(tmp_path / LOCK_NAME).pid == holder.pid
    finally:
        holder.kill()
        holder.wait()


def test_a_restarted_job_waits_for_its_predecessor_then_takes_over(tmp_path, caplog, monkeypatch):
    path = tmp_path / LOCK_NAME
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    # a double launch inside one allocation (same job, same restart count) is refused at once
    predecessor = hold(path, 2, job="4242")
    with pytest.raises(UsageError, match=r"pid \d+, job 4242, started"):
        RunLock.acquire(tmp_path, 0.5)
    # the requeued job (restart count 1) waits for the predecessor's flock, which it drops on exit
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    start = time.monotonic()
    with caplog.at_level(logging.WARNING):
        lock = RunLock.acquire(tmp_path, 0.5)
    waited = time.monotonic() - start
    predecessor.wait()
    assert 0.3 < waited < 10, waited
    assert "waiting up to train.lock_stale_minutes=0.5 for an earlier run of job 4242" in caplog.text
    assert f"pid {predecessor.pid}" in takeovers(caplog)[0] and "an earlier run of job 4242, waited for" in takeovers(caplog)[0]
    lock.release()
    # a predecessor on another host that still beats: waited for up to the bound (1.2 s), then taken over
    write_record(path, host="node-elsewhere", pid=99, job="4242")
    start = time.monotonic()
    RunLock.acquire(tmp_path, 0.02).release()
    assert 1.0 < time.monotonic() - start < 5


def test_the_stale_bound_is_checked_and_a_resume_may_change_it():
    assert load_config("tiny", ["train.lock_stale_minutes=0.5"]).train.lock_stale_minutes == 0.5
    for bad in ("0", "-1"):
        with pytest.raises(ConfigError, match=r"^train\.lock_stale_minutes=-?[01]\.0 must be > 0 \(e\.g\. 10\)$"):
            load_config("tiny", [f"train.lock_stale_minutes={bad}"])
    assert "train.lock_stale_minutes" in RESUMABLE_CHANGES
