"""Where this process sits in the job, from whatever launched it: the one reader of launcher
variables (cplm_dist.distributed builds the process groups from the answer).

| launcher | rank / world / local rank | rendezvous (MASTER_ADDR, MASTER_PORT) |
|---|---|---|
| torchrun, DeepSpeed's launcher, env:// | RANK, WORLD_SIZE, LOCAL_RANK | MASTER_ADDR, MASTER_PORT |
| Open MPI (mpirun) | OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK | MASTER_ADDR/PORT if exported, else rank 0's host and a free port, broadcast with mpi4py |
| MPICH / Intel MPI (hydra) | PMI_RANK, PMI_SIZE, MPI_LOCALRANKID | as Open MPI |
| Slurm (srun) | SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID | MASTER_ADDR/PORT if exported, else the first host of SLURM_STEP_NODELIST and `slurm_port` |
| nothing | one process | a free local port |

The first launcher whose variables are present wins, in that order (so torchrun started by srun
is torchrun). A Slurm batch script outside `srun` is one process: only srun steps carry
SLURM_STEP_NUM_TASKS. Incomplete or contradictory variables give one line naming them and the
fix, before any connection is attempted: the job fails at once instead of hanging.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Mapping

from cplm_dist.errors import ConfigError


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None
    launcher: str

    @staticmethod
    def from_environ(env: Mapping[str, str] | None = None, *, mpi_rendezvous: bool = True) -> "LaunchEnv":
        env = os.environ if env is None else env
        if "RANK" in env or "WORLD_SIZE" in env:
            launcher, keys = "torchrun", ("RANK", "WORLD_SIZE", "LOCAL_RANK")
        elif "OMPI_COMM_WORLD_RANK" in env:
            launcher, keys = "openmpi", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")
        elif "PMI_RANK" in env:
            launcher, keys = "mpich", ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID")
        elif "SLURM_STEP_NUM_TASKS" in env:
            launcher, keys = "slurm", ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID")
        else:
            return LaunchEnv(0, 1, 0, None, None, "single")
        rank, world, local = (_int(env, k, launcher, required=(k != keys[2] or launcher == "slurm")) for k in keys)
        if local is None:
            local = rank if launcher == "torchrun" else _local_rank_fallback(env)
        if not 0 <= rank < world:
            raise ConfigError(f"{launcher}: rank {rank} is outside world size {world} ({keys[0]}, {keys[1]}): fix the launcher's environment")
        addr, port = env.get("MASTER_ADDR"), _int(env, "MASTER_PORT", launcher, required=False)
        if world > 1 and (addr is None or port is None):
            if launcher == "torchrun":
                raise ConfigError("RANK/WORLD_SIZE are set but MASTER_ADDR or MASTER_PORT is not: set both "
                                  "(torchrun and DeepSpeed's launcher do), or unset RANK and WORLD_SIZE")
            if launcher == "slurm":
                addr = addr or first_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", ""))
                port = port or slurm_port(env)
            elif mpi_rendezvous:
                addr, port = _mpi_rendezvous(launcher, addr, port)
        return LaunchEnv(rank, world, local, addr, port, launcher)


def slurm_port(env: Mapping[str, str]) -> int:
    """The rendezvous port of a Slurm job: 20000 + (job id x 8 + restart count) % 20000, a fresh
    port per (job, restart), so that a requeued run never waits on its predecessor's socket. The
    sbatch scripts take theirs from here too (`python -m cplm_dist.distributed.launch_env slurm-port`)."""
    return 20000 + (int(env.get("SLURM_JOB_ID", "0")) * 8 + int(env.get("SLURM_RESTART_COUNT", "0"))) % 20000


def _int(env: Mapping[str, str], key: str, launcher: str, required: bool = True) -> int | None:
    if key not in env:
        if required:
            raise ConfigError(f"{launcher} launch: {key} is not set: the launcher's environment is incomplete "
                              "(launch through launch/*.sh, or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
        return None
    try:
        return int(env[key])
    except ValueError:
        raise ConfigError(f"{launcher} launch: {key}={env[key]!r} is not an integer") from None


def _local_rank_fallback(env: Mapping[str, str]) -> int:
    for key in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK"):
        if key in env and env[key].isdigit():
            return int(env[key])
    return 0


def first_host(nodelist: str) -> str:
    """First hostname of a Slurm nodelist: 'gpu[003-005,9],cpu1' -> 'gpu003' (as `scontrol show hostnames`)."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ConfigError(f"slurm launch: cannot read a host from SLURM_JOB_NODELIST={nodelist!r}: export MASTER_ADDR")
    prefix, ranges = match.groups()
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _mpi_rendezvous(launcher: str, addr: str | None, port: int | None) -> tuple[str, int]:
    """Rank 0's host and a free port of it, broadcast over MPI (mpi4py)."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise ConfigError(f"{launcher} launch without MASTER_ADDR/MASTER_PORT needs mpi4py to agree on them: "
                          "pip install mpi4py, or pass them (mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=29500)") from None
    comm = MPI.COMM_WORLD
    mine = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            mine = (addr or socket.gethostname(), port or s.getsockname()[1])
    return comm.bcast(mine, root=0)


def where(env: Mapping[str, str] | None = None) -> str:
    """One line: this process's rank, world, local rank, host and rendezvous as the launch gave them
    (`python -m cplm_dist.distributed.launch_env where` under a launcher, to check a multi-node launch
    gives every node its own ranks before a long job: docs/cluster.md)."""
    e = LaunchEnv.from_environ(env, mpi_rendezvous=False)
    return (f"rank {e.rank} of {e.world_size} (local rank {e.local_rank}) on {socket.gethostname()}, "
            f"launcher {e.launcher}, rendezvous {e.master_addr}:{e.master_port}")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["slurm-port"]:
        print(slurm_port(os.environ))
    elif sys.argv[1:] == ["where"]:
        try:
            print(where(), flush=True)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
    else:
        print("usage: python -m cplm_dist.distributed.launch_env slurm-port|where", file=sys.stderr)
        sys.exit(2)
