"""Joining the job across hosts: the rendezvous store, bounded by `train.join_timeout_minutes`,
and what the hosts must agree on before the first collective.

    store, joined = join(env, backend, join_timeout_minutes=5, shared_dir=out_dir)   # then init_process_group(store=store)
    joined.ranks_at(error_text), joined.on_host(rank)   # names for messages (ParallelDims.hosts keeps it)

Every rank connects to the store rank 0 hosts (or, under torchrun, its agent's), publishes where
it runs (its host and machine, the address its collectives will advertise, a listening port on
that address) and waits for all the others, at most the join timeout; a rank that never arrives
is named, with the hosts of those that did. Then, when the job spans machines (two "nodes"
started on one machine are one host):

- an advertised address on loopback (a host whose hosts file maps its own name to 127.0.1.1, the
  line Debian's installer writes) is refused: the other hosts would connect to themselves;
- every rank connects to one rank of each other host, at the address that host advertises, within
  a few seconds: an address the others cannot reach (a multi-homed host named on the wrong network)
  is refused, naming both hosts and the address;
- `shared_dir` (the run's out_dir) must be one directory on every host: each host's local rank 0
  writes a probe file there and rank 0 must see them all (a node-local path is refused).

Each rank then publishes its verdict and waits for everybody's, so that every rank ends with the
same one line (exit 2, a LaunchError) within seconds, instead of a collective hanging until the
collective timeout or gloo's retries give up minutes later.

The address a backend advertises: gloo the first address of the hostname that can be bound (what
torch's ProcessGroupGloo resolves), or GLOO_SOCKET_IFNAME's interface; nccl NCCL_SOCKET_IFNAME's
interface, else the first up interface that is not loopback or docker (NCCL's default order).
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import re
import socket
import struct
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from cplm_dist.distributed.launch_env import LaunchEnv
from cplm_dist.errors import LaunchError

PREFIX = "cplm/hosts/"
PROBE_SECONDS = 3.0  # a TCP connect to a reachable peer takes milliseconds; an unreachable one never answers
FIX = ("map each host's name in /etc/hosts (or DNS) to the address of the network the hosts share, or pick "
       "that network's interface with {var}=<interface>")


@dataclass(frozen=True)
class JoinedHosts:
    """Where each rank of the job joined from, as the join saw it ({host, machine, address, port,
    probe, made} a rank; none in a one-process job): the names messages give ranks."""

    peers: tuple[dict, ...] = field(default_factory=tuple)

    def host_of(self, rank: int) -> str | None:
        """The host rank `rank` joined from (None in a one-process job)."""
        return self.peers[rank]["host"] if 0 <= rank < len(self.peers) else None

    def on_host(self, rank: int) -> str:
        """' on HOST' naming rank `rank`'s host in a job that spans hosts, else '' (one host: the
        name tells nothing)."""
        if not spans_machines(self.peers):
            return ""
        return f" on {self.host_of(rank)}" if self.host_of(rank) else ""

    def ranks_at(self, text: str) -> str:
        """'rank 1 on node2' for the joined ranks whose advertised address appears in `text` (a
        collective's error names the peer it lost by address), '' when none does or the job runs on
        one host (where every rank has the same address)."""
        if not spans_machines(self.peers):
            return ""
        found: dict[str, list[int]] = {}
        for rank, p in enumerate(self.peers):
            if re.search(rf"(?<![\d.]){re.escape(p['address'])}(?![\d])", text):
                found.setdefault(p["host"], []).append(rank)
        return "; ".join(f"rank {_ranges(r)} on {h}" if len(r) == 1 else f"ranks {_ranges(r)} on {h}" for h, r in found.items())


def join(env: LaunchEnv, backend: str, *, join_timeout_minutes: float,
         shared_dir: Path | None = None) -> tuple[dist.Store, JoinedHosts]:
    """The job's store, after every rank arrived and the hosts checked out (module docstring), and
    where each rank joined from."""
    timeout = timedelta(minutes=join_timeout_minutes)
    store = dist.PrefixStore(f"{PREFIX}{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/",
                             connect_store(env, timeout, join_timeout_minutes))
    host = socket.gethostname()
    address = advertised_address(backend)
    listener = _listen(address)
    token = _token(store, env.rank, join_timeout_minutes, host)
    made = _missing_dirs(Path(shared_dir)) if shared_dir is not None else []
    probe = _write_probe(shared_dir, host, token) if shared_dir is not None and env.local_rank == 0 else None
    try:
        store.set(f"rank/{env.rank}", json.dumps(
            {"host": host, "machine": machine_id(), "address": address, "port": listener.getsockname()[1],
             "probe": probe, "made": [str(d) for d in made]}))
        peers = _gather(store, "rank", env.world_size, join_timeout_minutes, host)
        verdict = check_peers(env.rank, peers, backend)
        if not verdict and env.rank == 0 and shared_dir is not None:
            verdict = check_probes(shared_dir, peers)
        store.set(f"verdict/{env.rank}", verdict)
        verdicts = _gather(store, "verdict", env.world_size, join_timeout_minutes, host, raw=True)
    finally:
        listener.close()
        if probe is not None:
            _remove(Path(shared_dir) / probe)
    failed = [(r, v) for r, v in enumerate(verdicts) if v]
    if failed:
        _leave(store, env, host)
        # a refused launch leaves no empty out_dir (or parents) behind: what any rank found missing
        # (rank 0 after every rank removed its probe; each rank its own, for a node-local path)
        mine = {d for p in peers for d in p.get("made", [])} if env.rank == 0 else {str(d) for d in made}
        for d in sorted(mine, key=lambda d: -len(Path(d).parts)):
            _remove_empty(Path(d))
        rank, message = failed[0]
        more = f" (and {len(failed) - 1} more rank(s) refused)" if len(failed) > 1 else ""
        raise LaunchError(message + more if rank == env.rank else f"rank {rank} refused the launch: {message}{more}")
    # the process group's keys under this attempt's prefix too (as torch's env:// does): torchrun's
    # agent store outlives an elastic restart, and the gloo addresses the previous attempt left in it
    # sent the restarted ranks to dead processes (connectFullMesh: Connection refused)
    return (dist.PrefixStore(f"cplm/pg/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store.underlying_store),
            JoinedHosts(tuple(peers)))


def spans_machines(peers: list[dict]) -> bool:
    """The ranks run on more than one machine (hostname and boot id: two "nodes" started on one
    machine are one host, cloned machines that share a hostname are not)."""
    return len({(p["host"], p.get("machine")) for p in peers}) > 1


def connect_store(env: LaunchEnv, timeout: timedelta, minutes: float) -> dist.Store:
    """The TCPStore at MASTER_ADDR:MASTER_PORT: hosted by rank 0, or by torchrun's agent
    (TORCHELASTIC_USE_AGENT_STORE), as torch's own env:// and tcp:// rendezvous do."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    try:
        return dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=env.rank == 0 and not agent,
                             timeout=timeout, wait_for_workers=False, multi_tenant=True)
    except (RuntimeError, dist.DistError) as e:
        first = str(e).strip().splitlines()[0][:160]
        if env.rank == 0 and not agent:
            raise LaunchError(f"rank 0 on {socket.gethostname()} cannot host the rendezvous store at "
                              f"{env.master_addr}:{env.master_port} ({first}): MASTER_ADDR must be an address of "
                              "this host and MASTER_PORT a free port") from None
        raise LaunchError(f"rank {env.rank} on {socket.gethostname()} could not reach the rendezvous store at "
                          f"{env.master_addr}:{env.master_port} within train.join_timeout_minutes={minutes} ({first}): "
                          "rank 0's host never started it, or MASTER_ADDR names another host here") from None


def advertised_address(backend: str) -> str:
    """The address this process's collectives will tell the other ranks to connect to."""
    var = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    if os.environ.get(var):
        names = [n for n in os.environ[var].split(",") if n]
        for name in names:
            found = interface_address(name.lstrip("=^")) if not name.startswith("^") else None
            if found:
                return found
        raise LaunchError(f"{var}={os.environ[var]} names no interface with an IPv4 address on "
                          f"{socket.gethostname()} (interfaces: {', '.join(n for _, n in socket.if_nameindex())})")
    if backend == "nccl":
        for _, name in socket.if_nameindex():
            if name != "lo" and not name.startswith("docker"):
                found = interface_address(name)
                if found:
                    return found
        return "127.0.0.1"
    return hostname_address(socket.gethostname())


def machine_id() -> str:
    """This machine's identity for the current boot (Linux boot_id), else its hostname."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def hostname_address(hostname: str) -> str:
    """The first address `hostname` resolves to that a socket can bind (gloo's choice), else loopback."""
    try:
        infos = socket.getaddrinfo(hostname, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return "127.0.0.1"
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind((sockaddr[0], 0))
            return sockaddr[0]
        except OSError:
            continue
    return "127.0.0.1"


def interface_address(name: str) -> str | None:
    """The IPv4 address of network interface `name` (SIOCGIFADDR), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def check_peers(rank: int, peers: list[dict], backend: str) -> str:
    """This rank's verdict on the job's hosts ("" when fine): its own address, then one connect to
    one rank of each other machine (`spans_machines`); "" at once on one machine."""
    me = peers[rank]
    if not spans_machines(peers):
        return ""
    var = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    if is_loopback(me["address"]):
        if os.environ.get(var):
            how = f"{var}={os.environ[var]} gives {me['address']}"
        elif backend == "nccl":
            how = f"its only interface with an address is loopback ({me['address']})"
        else:
            how = f"its name {me['host']!r} resolves to {me['address']}"
        return (f"host {me['host']} (rank {rank}): {how}, a loopback address, which {backend} would give the "
                f"other hosts to connect to: {FIX.format(var=var)}")
    targets = {}
    for r, p in enumerate(peers):
        # a peer on loopback refuses itself (above): connecting to it would only reach ourselves
        key = (p["host"], p.get("machine"))
        if key != (me["host"], me.get("machine")) and key not in targets and not is_loopback(p["address"]):
            targets[key] = (r, p)
    with ThreadPoolExecutor(max_workers=min(32, max(1, len(targets)))) as pool:
        results = list(pool.map(lambda t: (t, _connect(t[1]["address"], t[1]["port"])), targets.values()))
    for (r, p), error in results:
        if error:
            return (f"rank {rank} on {me['host']} cannot reach host {p['host']} (rank {r}) at {p['address']}, the "
                    f"address {p['host']} advertises ({error} within {PROBE_SECONDS:.0f} s): {FIX.format(var=var)}")
    return ""


def check_probes(shared_dir: Path, peers: list[dict]) -> str:
    """Rank 0's verdict on `shared_dir`: the probe of every host's local rank 0 must be visible here."""
    missing = sorted({p["host"] for p in peers if p["probe"] and not (Path(shared_dir) / p["probe"]).exists()})
    if not missing:
        return ""
    return (f"train.out_dir={shared_dir} is not one directory on every host: rank 0 on {peers[0]['host']} does not "
            f"see what {', '.join(missing)} wrote there (a node-local path): put train.out_dir on the filesystem "
            "the hosts share")


def _connect(address: str, port: int) -> str:
    try:
        with socket.create_connection((address, port), timeout=PROBE_SECONDS):
            return ""
    except socket.timeout:
        return "connect timed out"
    except OSError as e:
        return e.strerror or type(e).__name__


def _listen(address: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.bind((address, 0))
    except OSError as e:
        s.close()
        raise LaunchError(f"{socket.gethostname()}: cannot listen on {address}, the address its collectives would "
                          f"advertise ({e.strerror}): set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME") from None
    s.listen(64)
    return s


def _token(store: dist.Store, rank: int, minutes: float, host: str) -> str:
    """One random word per job, from rank 0, naming this launch's probe files."""
    if rank == 0:
        store.set("token", uuid.uuid4().hex[:12])
    try:
        return store.get("token").decode()
    except (RuntimeError, dist.DistError) as e:  # rank 0 never arrived (torchrun's agent hosts the store)
        first = str(e).strip().splitlines()[0][:120]
        raise LaunchError(f"rank 0 did not join within train.join_timeout_minutes={minutes} (seen from {host}: "
                          f"{first}): its launcher did not start it, or it failed first; its log says why") from None


def _write_probe(shared_dir: Path, host: str, token: str) -> str:
    name = f".cplm-host-probe-{token}-{host}"
    Path(shared_dir).mkdir(parents=True, exist_ok=True)
    (Path(shared_dir) / name).write_text(host + "\n")
    return name


def _missing_dirs(path: Path) -> list[Path]:
    """`path` and its parents that do not exist yet, deepest first."""
    path = path.absolute()
    return [d for d in (path, *path.parents) if not d.exists()]


def _remove_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _leave(store: dist.Store, env: LaunchEnv, host: str) -> None:
    """Before a refused launch ends: every rank says it read the verdicts, and rank 0, whose
    process hosts the store, waits (a few seconds) until they all have."""
    try:
        store.set(f"left/{env.rank}", "")
        if env.rank == 0:
            _gather(store, "left", env.world_size, 0.5, host, raw=True)
    except LaunchError:
        pass


def _gather(store: dist.Store, kind: str, world: int, minutes: float, host: str, raw: bool = False) -> list:
    """Every rank's `kind` entry, waiting at most the join timeout; ranks that never wrote theirs
    are named."""
    try:
        return _wait_for(store, kind, world, minutes, host, raw)
    except (RuntimeError, dist.DistError) as e:  # the store's host (rank 0) ended
        first = str(e).strip().splitlines()[0][:120]
        raise LaunchError(f"{host}: lost the rendezvous store while joining ({first}): rank 0 ended or its host went "
                          "away; its log says why") from None


def _wait_for(store: dist.Store, kind: str, world: int, minutes: float, host: str, raw: bool) -> list:
    keys = [f"{kind}/{r}" for r in range(world)]
    deadline = time.monotonic() + minutes * 60
    while not store.check(keys):  # one round trip a poll, whatever the world size
        if time.monotonic() >= deadline:
            present = [store.check([k]) for k in keys]
            missing = [r for r, ok in enumerate(present) if not ok]
            arrived = _arrived_hosts(store, keys, present) if kind == "rank" else ""
            raise LaunchError(
                f"rank(s) {_ranges(missing)} of {world} did not {'join' if kind == 'rank' else 'finish the host checks'} "
                f"within train.join_timeout_minutes={minutes}{arrived} (seen from {host}): their launcher did not "
                "start them, or their host cannot reach the rendezvous store at MASTER_ADDR:MASTER_PORT")
        time.sleep(0.05)
    values = store.multi_get(keys)
    return [v.decode() for v in values] if raw else [json.loads(v) for v in values]


def _arrived_hosts(store, keys: list[str], present: list[bool]) -> str:
    hosts = sorted({json.loads(store.get(k))["host"] for k, ok in zip(keys, present) if ok})
    return f" (arrived from: {', '.join(hosts)})" if hosts else ""


def _ranges(ranks: list[int]) -> str:
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)
