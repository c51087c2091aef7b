"""Launching across hosts, on two hosts made from network namespaces (tools/local_cluster.py):
every launcher's two-host run equals the one-host run, and the host faults a cluster has (a name
on loopback or on an address the others cannot reach, a node-local out_dir, a rank that never
arrives, a host lost or cut off mid-step) each end in bounded time with one line of ours.

One cluster serves the module; each test starts its processes inside it and the cluster is torn
down at the end, also after a failure (the last test checks that nothing is left behind)."""

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cplm_dist.distributed import free_port
from cplm_dist_tools.local_cluster import LocalCluster, leftovers, unavailable
from tests.slurm_cluster import LocalSlurm, ensure_slurm
from tests.test_launchers import STEPS, assert_same_losses, launch_env, reference, train_args, wait_for_steps  # noqa: F401
from tests.test_train import argv, losses

REPO = Path(__file__).resolve().parent.parent
NODE1 = "10.231.0.1"  # node1's address on the hosts' network (tools/local_cluster.py)
UNAVAILABLE = unavailable()  # why hosts cannot be made here (not root, no namespaces), or None
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no local cluster: {UNAVAILABLE}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(2, root=tmp_path_factory.mktemp("cluster"))
    c.up()
    try:
        yield c
    finally:
        c.down()
        assert c.tag not in " ".join(leftovers()), leftovers()


@pytest.fixture
def names(cluster):
    """Each host's own name on the shared network again after a test that moved it."""
    yield cluster
    for host in cluster.names:
        cluster.name_on(host, "shared")


def torchrun(cluster, host, rank, out, master, *extra, nproc=1, small_data=None, env=None, node_local=()):
    cmd = [str(REPO / "launch/torchrun.sh"), "--nnodes", "2", "--nproc-per-node", str(nproc), "--node-rank", str(rank),
           "--master", master, "--", *train_args(small_data, out, *extra)]
    return cluster.popen(host, cmd, node_local=node_local, cwd=REPO, env={**launch_env(), **(env or {})},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(procs, timeout):
    """Each process's (return code, output), killing what outlives `timeout`."""
    deadline, out = time.monotonic() + timeout, []
    for p in procs:
        try:
            log, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            log, _ = p.communicate()
            log += "\n<killed: outlived the test's bound>"
        out.append((p.returncode, log))
    return out


def direct(cluster, host, rank, out, small_data, *extra, world=2, port=None):
    """One rank started by hand (the env:// variables a launcher sets), no launcher in between."""
    env = {**launch_env(), "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "node1", "MASTER_PORT": str(port)}
    cmd = [sys.executable, "-m", "cplm_dist.train", *train_args(small_data, out, *extra)]
    return cluster.popen(host, cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# --- every launcher across the two hosts -------------------------------------------------------


def test_torchrun_two_hosts_by_two_processes_equals_one_host(cluster, small_data, tmp_path, reference):
    """2 hosts x 2 processes, tp = 2 inside a host (torchrun numbers a node's ranks
    consecutively), dp = 2 across; --master by node1's address, not its name: node rank 0 hosts
    the store all the same. The same global batch as the one-host dp = 2 run."""
    out, master = tmp_path / "run", f"{NODE1}:{free_port()}"
    procs = [torchrun(cluster, h, r, out, master, "parallel.tp=2", nproc=2, small_data=small_data)
             for r, h in enumerate(cluster.names)]
    results = finish(procs, 400)
    for rc, log in results:
        assert rc == 0, log[-3000:]
    assert "tp=2 dp=2" in results[0][1] + results[1][1]
    assert_same_losses(losses(out), reference, 1e-4)


def documented_torchrun_line() -> list[str]:
    """docs/training.md's multi-node torchrun line, its options up to `-m` (what a user types on each node)."""
    text = (REPO / "docs/training.md").read_text()
    line = next(l for l in text.splitlines() if l.startswith("torchrun --nnodes 2 "))
    words = shlex.split(line.split("\\")[0])
    return words[1:words.index("-m")] if "-m" in words else words[1:]


def test_the_documented_torchrun_line_gives_each_host_its_own_ranks(cluster):
    """The c10d line of docs/training.md, as printed but for its placeholders (the first node's
    name, one process a node), on both hosts with no node rank: each host's process reports a rank
    of its own (`python -m cplm_dist.distributed.launch_env where`). The static rendezvous
    torchrun falls back to without --rdzv-backend would make both node rank 0."""
    options = documented_torchrun_line()
    assert options[options.index("--rdzv-backend") + 1] == "c10d" and "--rdzv-id" in options, options
    port = free_port()
    fill = {"$HEAD:29500": f"node1:{port}", "$JOB": f"doc-{port}", "8": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", *[fill.get(w, w) for w in options],
           "-m", "cplm_dist.distributed.launch_env", "where"]
    procs = [cluster.popen(h, cmd, cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for h in cluster.names]
    results = finish(procs, 120)
    seen = {}
    for (rc, log), host in zip(results, cluster.names):
        assert rc == 0, log[-3000:]
        found = re.findall(r"^rank (\d+) of (\d+) \(local rank 0\) on (\S+), launcher torchrun", log, re.M)
        assert len(found) == 1 and found[0][1:] == ("2", host), log[-3000:]
        seen[host] = found[0][0]
    assert sorted(seen.values()) == ["0", "1"], seen


def remote_start_env(cluster):
    """Open MPI 5's remote start (PRRTE's plm_ssh_agent) through the cluster's host-entering
    command instead of ssh: no sshd anywhere. The hosts also have a second network (mgmt0) that
    only each host itself is on, so Open MPI's own traffic is kept to eth0, as on any multi-homed
    cluster (docs/cluster.md)."""
    return {**launch_env(), "PRTE_MCA_plm_ssh_agent": str(cluster.agent()), "OMPI_MCA_btl_tcp_if_include": "eth0",
            "PRTE_MCA_oob_tcp_if_include": "eth0"}


def hostfile(cluster, tmp_path) -> Path:
    path = tmp_path / "hostfile"
    path.write_text("".join(f"{h} slots=1\n" for h in cluster.names))
    return path


def test_a_node_local_index_cache_is_built_once_and_copied_to_the_other_host(cluster, small_data, tmp_path, reference):
    """data.cache_dir on each host's own disk (node2 sees its own empty directory there): rank 0
    builds megatron's index cache, node2's first rank writes a copy on node2, both train alike."""
    out, cache, master = tmp_path / "run", tmp_path / "cache", f"node1:{free_port()}"
    procs = [torchrun(cluster, h, r, out, master, f"data.cache_dir={cache}", small_data=small_data,
                      node_local=[cache] if h == "node2" else ()) for r, h in enumerate(cluster.names)]
    for rc, log in finish(procs, 300):
        assert rc == 0, log[-3000:]
    assert list(cache.rglob("*.npy")), "rank 0 built the cache on the shared disk (node1's view)"
    assert_same_losses(losses(out), reference, 1e-4)


def test_mpirun_across_two_hosts_equals_one_host(cluster, small_data, tmp_path, reference):
    out = tmp_path / "run"
    cmd = [str(REPO / "launch/mpirun.sh"), "-np", "2", "--hostfile", str(hostfile(cluster, tmp_path)), "--npernode", "1",
           "--", *train_args(small_data, out)]
    proc = cluster.run("node1", cmd, cwd=REPO, env=remote_start_env(cluster), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tp=1 dp=2" in proc.stdout
    assert_same_losses(losses(out), reference, 1e-4)


def test_deepspeed_launcher_across_two_hosts_equals_one_host(cluster, small_data, tmp_path, reference):
    """DeepSpeed's runner with its openmpi backend over a two-host hostfile, node1 named as the
    master address (else the runner asks the first host for `hostname -I` over ssh)."""
    out = tmp_path / "run"
    cmd = [str(REPO / "launch/deepspeed.sh"), "--hostfile", str(hostfile(cluster, tmp_path)), "--launcher", "openmpi",
           "--master-addr", "node1", "--no-ssh-check", "--", *train_args(small_data, out)]
    env = remote_start_env(cluster)
    proc = cluster.run("node1", cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_same_losses(losses(out), reference, 1e-4)
    refused = subprocess.run([*cmd[:7], "--num-gpus", "1", "--", "--config", "x"], capture_output=True, text=True, env=env)
    assert refused.returncode == 2 and refused.stderr.startswith("error: --launcher openmpi starts every slot"), refused.stderr


@pytest.fixture(scope="module")
def slurm(cluster, tmp_path_factory):
    """slurmctld + slurmd on node1, slurmd on node2 (tests/slurm_cluster.py)."""
    reason = ensure_slurm()
    if reason:
        pytest.skip(reason)
    s = LocalSlurm(tmp_path_factory.mktemp("slurm2"), cluster, slurmd_timeout=10).start()
    yield s
    s.stop()


def submit(slurm, small_data, out, logs, *options, extra=()):
    cmd = [str(REPO / "launch/submit.sh"), "--nodes", "2", "--gpus-per-node", "0", "--time", "00:10:00",
           "--log-dir", str(logs), "--job-name", "cplm-2h", *options, "--", *train_args(small_data, out, *extra)]
    proc = subprocess.run(slurm.command("node1", cmd), cwd=REPO, env={**launch_env(), **slurm.env}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()[-1]


def wait_for_job(slurm, job, timeout=240) -> dict:
    deadline, state = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        state = slurm.job(job)
        if state.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        time.sleep(0.5)
    return state


def test_slurm_across_two_hosts_preempted_requeued_and_resumed(slurm, small_data, tmp_path, reference):
    """launch/submit.sh --nodes 2 (slurm.sbatch, srun starting one rank per host): SIGUSR1 to the
    batch script, every rank saves, the job requeues and resumes exactly on both hosts."""
    out, logs = tmp_path / "run", tmp_path / "logs"
    job = submit(slurm, small_data, out, logs, "--tasks-per-node", "1")
    wait_for_steps(out, 3)
    slurm.run("scancel", "--signal=USR1", "--batch", job)
    state = wait_for_job(slurm, job)
    log = "".join(p.read_text() for p in logs.glob("*.out"))
    print(state, log, sep="\n")
    assert state.get("JobState") == "COMPLETED" and state.get("Restarts") == "1", state
    assert "on node[1-2]" in log and "[slurm] SIGUSR1 received" in log and "resuming step-" in log
    assert_same_losses(losses(out), reference, 1e-4)


def test_slurm_job_requeues_after_a_lost_host_and_resumes_exactly(slurm, small_data, tmp_path, reference):
    """node2 lost mid-run (every process on it killed, slurmd too): rank 0 ends in seconds naming
    the lost rank and its host (exit 4); the node is marked down (what Slurm does itself after
    SlurmdTimeout, or a site's health check at once) and Slurm requeues the job (--requeue); node2
    comes back and the requeued job resumes from the newest checkpoint with the straight run's
    losses."""
    out, logs = tmp_path / "run", tmp_path / "logs"
    job = submit(slurm, small_data, out, logs, "--tasks-per-node", "1", extra=("train.save_interval=2",))
    wait_for_steps(out, 5)
    slurm.cluster.kill_host("node2")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "lost contact" not in "".join(p.read_text() for p in logs.glob("*.out")):
        time.sleep(0.2)
    slurm.run("scontrol", "update", "nodename=node2", "state=down", "reason=host lost")
    slurm.start_node("node2")  # back: it returns to service as it registers (ReturnToService=2)
    state = wait_for_job(slurm, job)
    log = "".join(p.read_text() for p in logs.glob("*.out"))
    print(state, log, sep="\n")
    assert state.get("JobState") == "COMPLETED" and state.get("Restarts") == "1", state
    line = _one_line(log, "error: rank 0 lost contact with another rank while training")
    assert "that is rank 1 on node2" in line, line
    assert "resuming step-" in log
    assert_same_losses(losses(out), reference, 1e-4)


def test_slurm_torchrun_across_two_hosts(slurm, small_data, tmp_path, reference):
    """launch/submit.sh --torchrun --nodes 2: one torchrun per host (slurm-torchrun.sbatch)."""
    out, logs = tmp_path / "run", tmp_path / "logs"
    job = submit(slurm, small_data, out, logs, "--torchrun")
    state = wait_for_job(slurm, job)
    log = "".join(p.read_text() for p in logs.glob("*.out"))
    assert state.get("JobState") == "COMPLETED", (state, log[-3000:])
    assert "torchrun on 2 nodes x 1" in log
    assert state.get("CPUs/Task") == "2", state  # submit.sh's default: a node's 2 CPUs (sinfo) for its one torchrun
    assert_same_losses(losses(out), reference, 1e-4)


def test_scaling_ladder_points_go_through_slurm(slurm, small_data, tmp_path):
    """tools/scaling.py --slurm: each unfinished point a job through launch/submit.sh, waited
    for until its last checkpoint exists; a second call finds it finished and submits nothing
    (one-node jobs, on whichever host Slurm picks)."""
    out = tmp_path / "ladder"
    cmd = [sys.executable, str(REPO / "tools/scaling.py"), "--sizes", "2e5", "--head-dim", "32", "--variants", "gate",
           "--tokens-per-parameter", "0.01", "--suite", "none", "--out", str(out),
           "--slurm", "--nodes 1 --tasks-per-node 1 --gpus-per-node 0 --time 00:10:00",
           *argv(small_data, tmp_path / "unused")[2:], "train.global_batch_size=4", "train.micro_batch_size=4"]
    env = {**launch_env(), **slurm.env}
    first = subprocess.run(slurm.command("node1", cmd), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert "submitted gate-" in first.stdout and list((out / "slurm").glob("scaling-gate-*.out"))
    rows = (out / "points.csv").read_text().strip().splitlines()
    assert len(rows) == 2 and rows[1].split(",")[0] and "gate" in rows[1]
    again = subprocess.run(slurm.command("node1", cmd), cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "1 points; 1 already finished" in again.stdout and "submitted" not in again.stdout


# --- host faults -------------------------------------------------------------------------------


def _one_line(log: str, fragment: str) -> str:
    lines = [line for line in log.splitlines() if fragment in line]
    assert lines, log[-3000:]
    return lines[0]


def launch_with_node2_named_on(names, where, small_data, tmp_path):
    """torchrun on both hosts, node2's own name mapped `where` (LocalCluster.name_on): each
    host's (return code, output), the seconds it took, the out_dir."""
    names.name_on("node2", where)
    out, master, start = tmp_path / "run", f"node1:{free_port()}", time.monotonic()
    results = finish([torchrun(names, h, r, out, master, small_data=small_data) for r, h in enumerate(names.names)], 120)
    return results, time.monotonic() - start, out


def test_a_name_on_loopback_is_refused_before_the_first_collective(names, small_data, tmp_path):
    results, elapsed, out = launch_with_node2_named_on(names, "loopback", small_data, tmp_path)
    line = _one_line(results[1][1], "error: host node2 (rank 1)")
    assert "its name 'node2' resolves to 127.0.1.1, a loopback address" in line and "GLOO_SOCKET_IFNAME" in line, line
    assert "error: rank 1 refused the launch: host node2" in results[0][1], results[0][1][-2000:]
    assert all(rc != 0 for rc, _ in results) and elapsed < 60, (elapsed, [rc for rc, _ in results])
    assert "exitcode  : 2" in results[1][1]  # our process exited 2; torchrun reports its own failure
    assert not out.exists()  # nothing written: not even the empty out_dir


def test_a_name_the_other_host_cannot_reach_is_refused(names, small_data, tmp_path):
    # node2's own name -> its mgmt0 address, a network node1 is not on
    results, elapsed, _ = launch_with_node2_named_on(names, "unreachable", small_data, tmp_path)
    line = _one_line(results[0][1], "error: rank 0 on node1 cannot reach host node2 (rank 1) at 10.232.0.2")
    assert "the address node2 advertises" in line and "/etc/hosts" in line, line
    assert "refused the launch: rank 0 on node1 cannot reach host node2" in results[1][1], results[1][1][-2000:]
    assert all(rc != 0 for rc, _ in results) and elapsed < 60, elapsed


def test_a_node_local_out_dir_is_refused_and_nothing_is_left_in_it(cluster, small_data, tmp_path):
    out, port = tmp_path / "run", free_port()
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    env = {**launch_env(), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "node1", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2"}
    cmd = [sys.executable, "-m", "cplm_dist.train", *train_args(small_data, out)]
    procs = [cluster.popen(h, cmd, node_local=[out] if h == "node2" else (), cwd=REPO, env={**env, "RANK": str(r)},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r, h in enumerate(cluster.names)]
    results = finish(procs, 120)
    line = _one_line(results[0][1], "error: train.out_dir=")
    assert "is not one directory on every host: rank 0 on node1 does not see what node2 wrote there" in line, line
    assert [rc for rc, _ in results] == [2, 2], results[1][1][-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_a_rank_that_never_arrives_is_named_within_the_join_timeout(cluster, small_data, tmp_path):
    """Rank 0 alone (its peer never started), and at the same time in another job a rank 1 alone
    (its rank 0, the store's host, never started): both end after the join timeout, one line each."""
    out, start = tmp_path / "run", time.monotonic()
    results = finish([direct(cluster, "node1", 0, out, small_data, "train.join_timeout_minutes=0.15", port=free_port()),
                      direct(cluster, "node2", 1, out, small_data, "train.join_timeout_minutes=0.1", port=free_port())], 120)
    assert time.monotonic() - start < 60 and [rc for rc, _ in results] == [2, 2], results[0][1][-2000:] + results[1][1][-2000:]
    line = _one_line(results[0][1], "error: rank(s) 1 of 2 did not join")
    assert "within train.join_timeout_minutes=0.15 (arrived from: node1)" in line, line
    assert "could not reach the rendezvous store at node1:" in _one_line(results[1][1], "error: rank 1 on node2")


@pytest.mark.parametrize("fault", ["host lost", "partition"])
def test_a_host_lost_or_cut_off_mid_step_ends_the_other_in_bounded_time(fault, cluster, small_data, tmp_path):
    out, master = tmp_path / "run", f"node1:{free_port()}"
    extra = ("train.collective_timeout_minutes=0.25", "train.save_interval=2", "train.train_steps=400")
    procs = [torchrun(cluster, h, r, out, master, *extra, small_data=small_data) for r, h in enumerate(cluster.names)]
    try:
        wait_for_steps(out, 4, procs[0], timeout=240)
        checkpoint = (out / "checkpoints" / "latest").read_text().strip()
        start = time.monotonic()
        if fault == "host lost":
            cluster.kill_host("node2")
        else:
            cluster.partition("node2")
        (rc, log), = finish(procs[:1], 90)
        elapsed = time.monotonic() - start
    finally:
        cluster.heal("node2")
        cluster.kill_host("node2")
        finish(procs, 30)
    line = _one_line(log, "error: rank 0 lost contact with another rank while training")
    assert "rank 1 on node2" in line, line
    assert rc != 0 and elapsed < 60, elapsed  # the collective timeout is 15 s
    assert (out / "checkpoints" / checkpoint / "complete.json").exists()
