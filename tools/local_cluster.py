"""N hosts on one machine, from Linux network namespaces: a cluster to launch multi-host jobs on
without a second machine (tests use it; so can a user who wants to try a launcher across hosts).

    sudo python tools/local_cluster.py up --hosts 2          # prints the hosts and their addresses
    sudo python tools/local_cluster.py exec node2 -- hostname
    sudo python tools/local_cluster.py down                  # removes everything `up` made

    with LocalCluster(hosts=2) as cluster:                   # from Python (tests/test_multihost.py)
        proc = cluster.popen("node1", ["launch/torchrun.sh", ...])

Each host is a network namespace with its own network stack (loopback up, one link `eth0`), its
own hostname and its own hosts file; the links meet on a bridge in one more namespace (the
switch). Nothing is added outside them: every address lives on a link created inside a namespace
this tool made, nothing routes out, no /etc/netns entry is written. The disk is shared, as a
cluster's shared filesystem is.

A process enters a host by its network namespace only (`nsenter --net`) under
`unshare --mount --uts`, with the host's hosts file bind-mounted over /etc/hosts and its hostname
set: `ip netns exec` would also mount a fresh /sys, hiding the cgroup hierarchy slurmd needs.

Faults to try a launcher against: `LocalCluster(name_to_loopback={"node2"})` writes Debian's
installer line (`127.0.1.1 node2`) into node2's own hosts file; `name_unreachable={"node2"}` maps
node2's name, in its own hosts file, to an address on a second link of node2 that no other host
can reach (a multi-homed host named on the wrong network); `cluster.partition("node2")` takes its
link down and `cluster.kill_host("node2")` SIGKILLs every process in it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STATE = Path(tempfile.gettempdir()) / "cplm-local-cluster.json"  # what `up` made, for `down` and `exec`
NETNS_DIR = Path("/run/netns")


def unavailable() -> str | None:
    """Why network-namespace hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network-namespace hosts need root (ip netns add)"
    if sys.platform != "linux":
        return "network-namespace hosts need Linux"
    missing = [b for b in ("ip", "nsenter", "unshare", "mount") if not shutil.which(b)]
    if missing == ["ip"] and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "iproute2"],
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, capture_output=True, timeout=600)
        missing = [b for b in ("ip",) if not shutil.which(b)]
    if missing:
        return f"network-namespace hosts need {', '.join(missing)} (apt-get install iproute2 util-linux)"
    probe = f"cplm-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"network namespaces cannot be made here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


class LocalCluster:
    """`hosts` hosts named node1..nodeN at 10.231.0.1..N/24 (the subnet exists only inside the
    namespaces). `root` holds the hosts files (default: a fresh temporary directory)."""

    SUBNET, STRAY = "10.231.0", "10.232.0"  # the hosts' link; the second link of a name_unreachable host

    def __init__(self, hosts: int = 2, *, name_to_loopback=(), name_unreachable=(), root: Path | None = None,
                 tag: str | None = None):
        if not 1 <= hosts <= 200:
            raise ValueError(f"hosts={hosts}: 1 to 200")
        self.names = [f"node{i}" for i in range(1, hosts + 1)]
        self.addresses = {n: f"{self.SUBNET}.{i}" for i, n in enumerate(self.names, 1)}
        self.loopback, self.unreachable = set(name_to_loopback), set(name_unreachable)
        self.tag = tag or f"cplm{os.getpid()}"
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))
        self.switch = f"{self.tag}-switch"
        self.procs: list[subprocess.Popen] = []
        self.made: list[str] = []  # namespaces, in creation order

    def netns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    # --- up / down -----------------------------------------------------------------------------

    def up(self) -> "LocalCluster":
        try:
            self._add_netns(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, host in enumerate(self.names, 1):
                ns = self.netns(host)
                self._add_netns(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"port{i}", "netns", self.switch)
                _ip("-n", ns, "addr", "add", f"{self.addresses[host]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", self.switch, "link", "set", f"port{i}", "master", "br0")
                _ip("-n", self.switch, "link", "set", f"port{i}", "up")
                # a second network only this host is on (a management network, say)
                _ip("-n", ns, "link", "add", "mgmt0", "type", "veth", "peer", "name", "mgmt1")
                _ip("-n", ns, "addr", "add", f"{self.STRAY}.{i}/24", "dev", "mgmt0")
                _ip("-n", ns, "link", "set", "mgmt1", "up")
                _ip("-n", ns, "link", "set", "mgmt0", "up")
                self.name_on(host, "loopback" if host in self.loopback else
                             "unreachable" if host in self.unreachable else "shared")
        except BaseException:
            self.down()
            raise
        return self

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self.made.append(name)

    def name_on(self, host: str, where: str) -> None:
        """What `host`'s own hosts file maps its name to, for processes started from now on:
        "shared" (its address on the hosts' network), "loopback" (127.0.1.1, the line Debian's
        installer writes) or "unreachable" (its address on mgmt0, a network no other host is on)."""
        index = self.names.index(host) + 1
        first = {"shared": [], "loopback": [f"127.0.1.1\t{host}"],
                 "unreachable": [f"{self.STRAY}.{index}\t{host}"]}[where]
        lines = ["127.0.0.1\tlocalhost", *first, *(f"{addr}\t{name}" for name, addr in self.addresses.items())]
        self.hosts_file(host).write_text("\n".join(lines) + "\n")

    def hosts_file(self, host: str) -> Path:
        return self.root / f"hosts.{host}"

    def down(self) -> None:
        """Kill every process in our namespaces, delete them (and with them their links), remove
        the hosts files. Safe to call twice, and after a failed `up`."""
        for ns in reversed(self.made):
            kill_netns_processes(ns)
        for proc in self.procs:
            try:
                proc.kill()
                proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.made.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # --- running on a host ---------------------------------------------------------------------

    def command(self, host: str, argv: list[str], node_local=()) -> list[str]:
        """argv run on `host`: its network namespace, its hostname and hosts file. `node_local`:
        directories that this process sees as an empty tmpfs of its own, as a path on a host's
        local disk (created on the shared disk first if missing)."""
        mounts = "".join(f'mkdir -p "{d}" && mount -t tmpfs tmpfs "{d}" && ' for d in map(str, node_local))
        enter = f'mount --bind "$1" /etc/hosts && hostname "$2" && {mounts}shift 2 && exec "$@"'
        return ["nsenter", f"--net={NETNS_DIR / self.netns(host)}", "--", "unshare", "--mount", "--uts",
                "--propagation", "private", "--", "sh", "-c", enter, "sh", str(self.hosts_file(host)), host, *argv]

    def agent(self) -> Path:
        """A remote-start command for launchers that ssh to hosts (Open MPI's PRRTE
        plm_ssh_agent, pdsh-style): `agent HOST COMMAND...` runs COMMAND through `sh -c` on HOST,
        as ssh would, with no sshd."""
        script = self.root / "enter-host"
        cases = "".join(f"  {h}) exec {' '.join(_quote(a) for a in self.command(h, ['sh', '-c', '$*']))} ;;\n"
                        for h in self.names)
        script.write_text("#!/bin/sh\n# ssh-like: [ssh options] HOST COMMAND...\n"
                          'while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done\n'
                          'host=$1; shift\ncase "$host" in\n' + cases +
                          '  *) echo "enter-host: no host $host" >&2; exit 255 ;;\nesac\n')
        script.chmod(0o755)
        return script

    def popen(self, host: str, argv: list[str], node_local=(), **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(self.command(host, argv, node_local), **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, host: str, argv: list[str], node_local=(), **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("timeout", 600)
        return subprocess.run(self.command(host, argv, node_local), **kwargs)

    # --- faults --------------------------------------------------------------------------------

    def partition(self, host: str) -> None:
        """Cut `host` off: its link goes down (its processes live on, unreachable)."""
        _ip("-n", self.netns(host), "link", "set", "eth0", "down")

    def heal(self, host: str) -> None:
        _ip("-n", self.netns(host), "link", "set", "eth0", "up")

    def kill_host(self, host: str) -> list[int]:
        """SIGKILL every process on `host` (a host lost); the pids killed."""
        return kill_netns_processes(self.netns(host))

    # --- state for the command line ------------------------------------------------------------

    def to_json(self) -> dict:
        return {"tag": self.tag, "names": self.names, "addresses": self.addresses, "root": str(self.root),
                "made": self.made, "loopback": sorted(self.loopback), "unreachable": sorted(self.unreachable)}

    @classmethod
    def from_json(cls, state: dict) -> "LocalCluster":
        cluster = cls(len(state["names"]), name_to_loopback=state["loopback"], name_unreachable=state["unreachable"],
                      root=Path(state["root"]), tag=state["tag"])
        cluster.made = list(state["made"])
        return cluster


def _quote(arg: str) -> str:
    if arg == "$*":
        return '"$*"'
    return "'" + arg.replace("'", "'\\''") + "'"


def kill_netns_processes(ns: str) -> list[int]:
    proc = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
    pids = [int(p) for p in proc.stdout.split() if p.isdigit() and int(p) != os.getpid()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_running(p) for p in pids):
        time.sleep(0.05)
    return pids


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed child its parent has not reaped yet is gone for us)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def leftovers(prefix: str = "cplm", orphans_only: bool = False) -> list[str]:
    """Network namespaces named like ours (`<prefix><pid>-...`) that exist now; `orphans_only`:
    those whose maker (that pid) is gone, i.e. a killed run's, not a running one's."""
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    names = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    ours = [n for n in names if n.startswith(prefix) and "-" in n and n.split("-", 1)[0][len(prefix):].isdigit()]
    if orphans_only:
        ours = [n for n in ours if not Path(f"/proc/{int(n.split('-', 1)[0][len(prefix):])}").exists()]
    return ours


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="hosts from network namespaces on this machine")
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="make the hosts (node1..nodeN) and print them")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--name-to-loopback", nargs="*", default=[], metavar="HOST", help="its own name on 127.0.1.1")
    up.add_argument("--name-unreachable", nargs="*", default=[], metavar="HOST",
                    help="its own name on an address no other host can reach")
    ex = sub.add_parser("exec", help="run a command on a host")
    ex.add_argument("host")
    ex.add_argument("argv", nargs=argparse.REMAINDER)
    sub.add_parser("down", help="remove what `up` made (and the namespaces of a killed run, whose maker is gone)")
    args = parser.parse_args(argv)
    if args.cmd == "up":
        if STATE.exists():
            print(f"error: a local cluster is up ({STATE}): run `python tools/local_cluster.py down` first", file=sys.stderr)
            return 2
        reason = unavailable()
        if reason:
            print(f"error: {reason}", file=sys.stderr)
            return 2
        cluster = LocalCluster(args.hosts, name_to_loopback=args.name_to_loopback,
                               name_unreachable=args.name_unreachable, tag="cplm0").up()
        STATE.write_text(json.dumps(cluster.to_json()))
        for name, addr in cluster.addresses.items():
            print(f"{name}\t{addr}\tpython tools/local_cluster.py exec {name} -- <command>")
        return 0
    if args.cmd == "down":
        if STATE.exists():
            LocalCluster.from_json(json.loads(STATE.read_text())).down()
            STATE.unlink()
        for ns in leftovers(orphans_only=True):
            kill_netns_processes(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        return 0
    if not STATE.exists():
        print("error: no local cluster is up: run `python tools/local_cluster.py up` first", file=sys.stderr)
        return 2
    cluster = LocalCluster.from_json(json.loads(STATE.read_text()))
    argv_ = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if args.host not in cluster.names or not argv_:
        print(f"error: usage: exec HOST -- COMMAND, HOST one of {', '.join(cluster.names)}", file=sys.stderr)
        return 2
    return cluster.run(args.host, argv_, timeout=None).returncode


if __name__ == "__main__":
    sys.exit(main())
