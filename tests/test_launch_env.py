"""Scheduler discovery: each launcher's variables, their precedence, and one clear line when the
world cannot be determined (instead of a hang)."""

import pytest

from cplm_dist.distributed.launch_env import LaunchEnv, first_host, slurm_port
from cplm_dist.errors import ConfigError


def env_of(**kw):
    return LaunchEnv.from_environ({k: str(v) for k, v in kw.items()}, mpi_rendezvous=False)


def test_nothing_set_is_one_process():
    assert env_of() == LaunchEnv(0, 1, 0, None, None, "single")


def test_torchrun_and_deepspeed_launcher():
    e = env_of(RANK=3, WORLD_SIZE=8, LOCAL_RANK=1, MASTER_ADDR="n1", MASTER_PORT=29500)
    assert e == LaunchEnv(3, 8, 1, "n1", 29500, "torchrun")
    with pytest.raises(ConfigError, match=r"^RANK/WORLD_SIZE are set but MASTER_ADDR or MASTER_PORT is not"):
        env_of(RANK=0, WORLD_SIZE=2)
    with pytest.raises(ConfigError, match=r"torchrun launch: WORLD_SIZE is not set"):
        env_of(RANK=0)
    with pytest.raises(ConfigError, match=r"rank 4 is outside world size 4"):
        env_of(RANK=4, WORLD_SIZE=4, MASTER_ADDR="a", MASTER_PORT=1)
    with pytest.raises(ConfigError, match=r"RANK='zero' is not an integer"):
        env_of(RANK="zero", WORLD_SIZE=2)


def test_openmpi_and_mpich():
    e = env_of(OMPI_COMM_WORLD_RANK=5, OMPI_COMM_WORLD_SIZE=16, OMPI_COMM_WORLD_LOCAL_RANK=5,
               MASTER_ADDR="head", MASTER_PORT=29400)
    assert e == LaunchEnv(5, 16, 5, "head", 29400, "openmpi")
    e = env_of(PMI_RANK=2, PMI_SIZE=4, MPI_LOCALRANKID=0, MASTER_ADDR="h", MASTER_PORT=1)
    assert e == LaunchEnv(2, 4, 0, "h", 1, "mpich")
    assert env_of(PMI_RANK=1, PMI_SIZE=2, PMI_LOCAL_RANK=1, MASTER_ADDR="h", MASTER_PORT=1).local_rank == 1
    with pytest.raises(ConfigError, match=r"openmpi launch: OMPI_COMM_WORLD_SIZE is not set"):
        env_of(OMPI_COMM_WORLD_RANK=0)
    # without MASTER_*, the rendezvous comes from MPI (mpi_rendezvous=True); here it is off
    assert env_of(OMPI_COMM_WORLD_RANK=0, OMPI_COMM_WORLD_SIZE=2, OMPI_COMM_WORLD_LOCAL_RANK=0).master_addr is None


def test_slurm_srun_step():
    e = env_of(SLURM_PROCID=9, SLURM_STEP_NUM_TASKS=16, SLURM_NTASKS=16, SLURM_LOCALID=1,
               SLURM_STEP_NODELIST="gpu[017-018]", SLURM_JOB_ID=123456)
    assert e == LaunchEnv(9, 16, 1, "gpu017", 20000 + 123456 * 8 % 20000, "slurm")
    restarted = env_of(SLURM_PROCID=9, SLURM_STEP_NUM_TASKS=16, SLURM_LOCALID=1, SLURM_STEP_NODELIST="gpu[017-018]",
                       SLURM_JOB_ID=123456, SLURM_RESTART_COUNT=1)
    assert restarted.master_port == e.master_port + 1, "a requeued job needs a fresh port"
    exported = env_of(SLURM_PROCID=0, SLURM_STEP_NUM_TASKS=2, SLURM_LOCALID=0, MASTER_ADDR="x", MASTER_PORT=7)
    assert (exported.master_addr, exported.master_port) == ("x", 7)
    with pytest.raises(ConfigError, match=r"slurm launch: SLURM_LOCALID is not set"):
        env_of(SLURM_PROCID=0, SLURM_STEP_NUM_TASKS=2)


def test_slurm_batch_script_outside_srun_is_one_process():
    # the batch shell has SLURM_PROCID=0 and SLURM_NTASKS=N but is not a rank of an N-rank step
    assert env_of(SLURM_PROCID=0, SLURM_NTASKS=8, SLURM_LOCALID=0, SLURM_JOB_ID=5).world_size == 1


def test_torchrun_inside_slurm_is_torchrun():
    e = env_of(RANK=1, WORLD_SIZE=16, LOCAL_RANK=1, MASTER_ADDR="n0", MASTER_PORT=5,
               SLURM_PROCID=0, SLURM_STEP_NUM_TASKS=2, SLURM_LOCALID=0)
    assert (e.launcher, e.rank, e.world_size) == ("torchrun", 1, 16)


@pytest.mark.parametrize("nodelist,host", [("node001", "node001"), ("gpu[003-005,9]", "gpu003"),
                                           ("a[1,3],b[2-4]", "a1"), ("x-y[10-12]", "x-y10"), ("h1,h2", "h1")])
def test_first_host_of_a_nodelist(nodelist, host):
    assert first_host(nodelist) == host


def test_the_sbatch_scripts_take_the_port_from_the_library():
    """One rendezvous-port formula: the batch shell asks cplm_dist.distributed.launch_env for the port the
    ranks would compute themselves."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    for script in ("slurm.sbatch", "slurm-torchrun.sbatch"):
        text = (repo / "launch" / script).read_text()
        assert "-m cplm_dist.distributed.launch_env slurm-port" in text and "20000" not in text, script
    env = {"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "3", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "cplm_dist.distributed.launch_env", "slurm-port"], env=env, cwd=repo,
                         capture_output=True, text=True, check=True).stdout
    assert int(out) == slurm_port(env) == 20000 + (4242 * 8 + 3) % 20000


def test_one_evaluation_tp_policy():
    """Every evaluation launch (evaluate, generate, bottleneck, lm-eval) takes its tp the same way:
    the asked tp, else the saved one where it divides the launch (dp replicas over the rest), else
    the whole launch; a tp that does not divide is one line naming the valid ones."""
    from cplm_dist.distributed import evaluation_tp

    assert evaluation_tp(2, world=4) == 2 and evaluation_tp(1, world=2) == 1 and evaluation_tp(4, world=8) == 4
    assert evaluation_tp(3, world=4) == 4 and evaluation_tp(None, world=2) == 2  # nothing saved divides: one replica
    assert evaluation_tp(2, asked=1, world=4) == 1
    with pytest.raises(ConfigError, match=r"^tp=3 does not divide the launch's 4 ranks: choose tp from \[1, 2, 4\]$"):
        evaluation_tp(1, asked=3, world=4)


# --- joining across hosts (cplm_dist.distributed.hosts; the two-host cases run in tests/test_multihost.py) ----


def test_the_address_a_backend_advertises_and_loopback(monkeypatch):
    import cplm_dist.distributed.hosts as hosts
    from cplm_dist.errors import LaunchError

    assert hosts.is_loopback("127.0.1.1") and hosts.is_loopback("::1") and not hosts.is_loopback("10.0.0.1")
    assert not hosts.is_loopback("node1")  # a name is not an address
    assert hosts.hostname_address("localhost") in ("127.0.0.1", "::1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert hosts.advertised_address("gloo") == "127.0.0.1"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")
    with pytest.raises(LaunchError, match=r"^GLOO_SOCKET_IFNAME=nosuch0 names no interface with an IPv4 address on "):
        hosts.advertised_address("gloo")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "=lo")
    assert hosts.advertised_address("nccl") == "127.0.0.1"


def test_host_checks_judge_machines_not_launchers():
    """Two "nodes" on one machine may use loopback; two machines may not, even under one name
    (cloned machines); a peer on loopback refuses itself and is not connected to."""
    import cplm_dist.distributed.hosts as hosts

    one = [{"host": "a", "machine": "m1", "address": "127.0.1.1", "port": 1} for _ in range(2)]
    assert hosts.check_peers(0, one, "gloo") == ""
    clones = [{"host": "a", "machine": m, "address": "127.0.1.1", "port": 1} for m in ("m1", "m2")]
    line = hosts.check_peers(1, clones, "gloo")
    assert line.startswith("host a (rank 1): its name 'a' resolves to 127.0.1.1, a loopback address, which gloo")
    assert "GLOO_SOCKET_IFNAME=<interface>" in line and "\n" not in line
    assert hosts.check_peers(1, clones, "nccl").count("NCCL_SOCKET_IFNAME") == 1
    joined = hosts.JoinedHosts(({"host": "node1", "address": "10.0.0.1"}, {"host": "node2", "address": "10.0.0.2"},
                                {"host": "node2", "address": "10.0.0.2"}))
    assert joined.ranks_at("Connection closed by peer [10.0.0.2]:4242") == "ranks 1-2 on node2"
    assert joined.ranks_at("peer 10.0.0.12 gone") == "" and joined.host_of(0) == "node1"
    assert joined.on_host(2) == " on node2"
    one_host = hosts.JoinedHosts(({"host": "h", "address": "127.0.0.1"},) * 2)  # one host: names tell nothing
    assert one_host.ranks_at("Connection closed by peer [127.0.0.1]:4242") == "" and one_host.on_host(1) == ""
    assert hosts.JoinedHosts().on_host(0) == "" and hosts.JoinedHosts().host_of(0) is None  # a one-process job
    assert hosts._ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"


def test_where_names_the_rank_its_launch_gave():
    from cplm_dist.distributed.launch_env import where

    line = where({"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "MASTER_ADDR": "node001", "MASTER_PORT": "29500"})
    assert line.startswith("rank 5 of 16 (local rank 1) on ") and line.endswith(", launcher torchrun, rendezvous node001:29500")
    with pytest.raises(ConfigError, match="MASTER_ADDR or MASTER_PORT is not"):
        where({"RANK": "0", "WORLD_SIZE": "2"})
