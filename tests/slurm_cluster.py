"""A real Slurm for the launcher tests: Debian's slurmctld and slurmd, configured in a temporary
directory (no systemd, no cgroups, no munge), started in the background and stopped by PID.
On localhost (one node), or on a tools/local_cluster.py cluster (`LocalSlurm(root, cluster)`):
slurmctld and the first slurmd on node1, one slurmd on every other host, each with its own
NodeName, spool, pid and log files (`%n`); Slurm's commands then run on node1.

`ensure_slurm()` installs the packages with apt when they are missing and we are root; it
returns the reason Slurm cannot be had otherwise, for the test to skip with (never a silent pass).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from cplm_dist.distributed import free_port

PACKAGES = ["slurmctld", "slurmd", "slurm-client"]


def ensure_slurm() -> str | None:
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "scontrol")):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "Slurm is not installed and cannot be (needs root and apt-get): apt-get install " + " ".join(PACKAGES)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    for attempt in (install, ["apt-get", "update", "-q"], install):
        proc = subprocess.run(attempt, env=env, capture_output=True, text=True, timeout=600)
        if attempt is install and proc.returncode == 0:
            break
    if not all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "scontrol")):
        return f"apt-get could not install {' '.join(PACKAGES)}: {proc.stderr.strip().splitlines()[-1:]}"
    return None


CONF = """\
ClusterName=cplmtest
SlurmctldHost={ctld_host}
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/none
CredType=cred/none
# how long a requeued job waits before it may start again (default 120 s); shorter for tests
AuthInfo=cred_expire=5
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
# a node whose slurmd stops answering is DOWN (and its jobs requeued) after this long
SlurmdTimeout={slurmd_timeout}
MpiDefault=none
MailProg=/bin/true
SlurmUser=root
SlurmdUser=root
ReturnToService=2
JobRequeue=1
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
{nodes}
PartitionName=debug Nodes={node_names} Default=YES MaxTime=INFINITE State=UP
"""


class LocalSlurm:
    def __init__(self, root: Path, cluster=None, slurmd_timeout: int = 300):
        self.root, self.cluster = Path(root), cluster
        hosts = cluster.addresses if cluster is not None else {"localhost": "127.0.0.1"}
        self.nodes = list(hosts)
        for d in ("state", *(f"spool-{n}" for n in self.nodes)):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        cpus = 2 if cluster is not None else 4
        self.conf = self.root / "slurm.conf"
        self.conf.write_text(CONF.format(
            root=self.root, ctld_port=free_port(), d_port=free_port(), slurmd_timeout=slurmd_timeout,
            ctld_host=f"{self.nodes[0]}({hosts[self.nodes[0]]})", node_names=",".join(self.nodes),
            nodes="\n".join(f"NodeName={n} NodeAddr={a} CPUs={cpus} State=UNKNOWN" for n, a in hosts.items())))
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def command(self, host: str, cmd: list[str]) -> list[str]:
        """cmd as run on `host` (on localhost: as it is)."""
        return list(cmd) if self.cluster is None else self.cluster.command(host, list(cmd))

    def run(self, *cmd, check=True, env=None) -> str:
        return subprocess.run(self.command(self.nodes[0], cmd), env={**self.env, **(env or {})}, capture_output=True,
                              text=True, check=check, timeout=60).stdout

    def start(self) -> "LocalSlurm":
        subprocess.run(self.command(self.nodes[0], ["slurmctld", "-i", "-f", str(self.conf)]), env=self.env, check=True,
                       timeout=30)
        for node in self.nodes:
            self.start_node(node)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.run("sinfo", "-h", "-o", "%T", check=False).split() == ["idle"]:
                return self
            time.sleep(0.3)
        raise RuntimeError(f"the local Slurm nodes never became idle; see {self.root}/slurmctld.log")

    def start_node(self, node: str) -> None:
        """(Re)start `node`'s slurmd (a host back after a failure)."""
        subprocess.run(self.command(node, ["slurmd", "-N", node, "-f", str(self.conf)]), env=self.env, check=True,
                       timeout=30)

    def job(self, job_id: str) -> dict:
        """scontrol's fields of a job: JobState, Restarts, ..."""
        text = self.run("scontrol", "show", "job", job_id)
        return dict(item.split("=", 1) for item in text.split() if "=" in item)

    def stop(self) -> None:
        try:  # best effort: slurmctld may still be waiting on a host a test cut off; the daemons are killed next
            subprocess.run(["scancel", "--full", "--user", "root"], env=self.env, capture_output=True, timeout=15)
        except subprocess.TimeoutExpired:
            pass
        pids = []
        for name in (*(f"slurmd-{n}.pid" for n in self.nodes), "slurmctld.pid"):
            try:
                pids.append(int((self.root / name).read_text().strip()))
            except (OSError, ValueError):
                pass
        # on a local cluster the hosts go next (every process in them killed): no graceful stop
        for sig in (signal.SIGTERM, signal.SIGKILL) if self.cluster is None else (signal.SIGKILL,):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and any(_alive(p) for p in pids):
                time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
