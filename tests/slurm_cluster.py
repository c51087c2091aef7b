"""A real single-node Slurm on localhost for the launcher tests: Debian's slurmctld and slurmd,
configured in a temporary directory (no systemd, no cgroups, no munge), started in the
background and stopped by PID.

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

from cplm_dist.parallel import free_port

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
SlurmctldHost=localhost(127.0.0.1)
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
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
MpiDefault=none
MailProg=/bin/true
SlurmUser=root
SlurmdUser=root
ReturnToService=2
JobRequeue=1
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
NodeName=localhost NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


class LocalSlurm:
    def __init__(self, root: Path):
        self.root = Path(root)
        for d in ("state", "spool"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        self.conf = self.root / "slurm.conf"
        self.conf.write_text(CONF.format(root=self.root, ctld_port=free_port(), d_port=free_port()))
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *cmd, check=True) -> str:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, check=check, timeout=60).stdout

    def start(self) -> "LocalSlurm":
        subprocess.run(["slurmctld", "-i", "-f", str(self.conf)], env=self.env, check=True, timeout=30)
        subprocess.run(["slurmd", "-N", "localhost", "-f", str(self.conf)], env=self.env, check=True, timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.run("sinfo", "-h", "-o", "%T", check=False).strip() == "idle":
                return self
            time.sleep(0.3)
        raise RuntimeError(f"the local Slurm node never became idle; see {self.root}/slurmctld.log")

    def job(self, job_id: str) -> dict:
        """scontrol's fields of a job: JobState, Restarts, ..."""
        text = self.run("scontrol", "show", "job", job_id)
        return dict(item.split("=", 1) for item in text.split() if "=" in item)

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "--user", "root"], env=self.env, capture_output=True, timeout=30)
        pids = []
        for name in ("slurmd.pid", "slurmctld.pid"):
            try:
                pids.append(int((self.root / name).read_text().strip()))
            except (OSError, ValueError):
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
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
