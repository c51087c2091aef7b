"""One trainer at a time on a run directory: a lock on `<train.out_dir>/run.lock`.

    lock = RunLock.acquire_for_run(cfg, dims)   # after init_distributed: the lock on rank 0, None elsewhere
    ...
    lock.release()                              # at exit, in the trainer's `finally:`

The protocol:

- The trainer's global rank 0 holds `fcntl.flock(LOCK_EX | LOCK_NB)` on `run.lock` for the whole
  run. The file records the holder as JSON: host, pid, job id (SLURM_JOB_ID, else
  TORCHELASTIC_RUN_ID, else null), restart counts (SLURM_RESTART_COUNT, TORCHELASTIC_RESTART_COUNT),
  start time and a heartbeat time that a daemon thread rewrites in place every few seconds (write
  at offset 0, truncate, fsync); a reader that finds it half-written retries for a second.
- The lock is live, and a second trainer refuses (one line naming the holder and the fix), when
  the flock is held by another process, or when the flock is free but the record names another
  host whose heartbeat is younger than `train.lock_stale_minutes` (a shared filesystem whose locks
  do not reach this host). On this host a free flock means the kernel released it: the holder
  died, and the lock is taken over with a warning; so is another host's stale heartbeat.
- The same job restarted (the holder's job id is this process's and its restart count lower: a
  Slurm requeue, a torchrun elastic restart) waits for its predecessor, polling, at most
  `train.lock_stale_minutes`, then takes the lock over with a warning.
- Rank 0 decides; every rank learns the verdict through one broadcast per try, so all ranks of a
  refused trainer raise the same line (exit 2) within seconds and none hangs in a collective.
- `release` removes the file while still holding the flock, then unlocks: a finished run leaves
  nothing behind, and a left-over file always means a holder that did not release (killed,
  crashed). A trainer that locks a file checks that it is still the one at the path (same inode)
  and starts over if not, so the removal cannot let two trainers lock two files. The directories
  the lock created are removed again when nothing else was written into them.

On a filesystem without flock (Lustre mounted without `flock`) the lock rests on the record alone:
a holder on this host is live while its pid is.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from cplm_dist.errors import UsageError

log = logging.getLogger(__name__)

LOCK_NAME = "run.lock"
HEARTBEAT_S = 5.0  # at most; a stale bound under 15 s beats faster (a third of it)
SETTLE_S = 1.0  # how long a reader retries a half-written record
NO_FLOCK = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)


@dataclass
class LockHolder:
    """The trainer a lock file names."""

    host: str
    pid: int
    job: str | None
    restart: list[int]  # [SLURM_RESTART_COUNT, TORCHELASTIC_RESTART_COUNT]: a later run of the job is greater
    started: float
    heartbeat: float

    @classmethod
    def me(cls) -> LockHolder:
        job = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
        restart = [int(os.environ.get(v) or 0) for v in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")]
        now = time.time()
        return cls(socket.gethostname(), os.getpid(), job if job != "none" else None, restart, now, now)

    def age(self) -> float:
        """Seconds since the last heartbeat (wall clocks: hosts are assumed to agree within seconds)."""
        return max(0.0, time.time() - self.heartbeat)

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return (f"host {self.host}, pid {self.pid}, job {self.job or 'none'}, started {started}, "
                f"heartbeat {self.age():.0f}s ago")

    def precedes(self, other: LockHolder) -> bool:
        """`self` is an earlier run of `other`'s job: the same job id, a lower restart count."""
        return self.job is not None and self.job == other.job and list(self.restart) < list(other.restart)


def read_holder(path: Path, wait_if_empty: bool = False) -> LockHolder | None:
    """The holder `path` records; None for no file, an empty one, or a record still unreadable
    after SETTLE_S (a record is rewritten in place: a reader may catch it half-written)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        if text.strip():
            try:
                record = json.loads(text)
                return LockHolder(**{f.name: record[f.name] for f in dataclasses.fields(LockHolder)})
            except (ValueError, KeyError, TypeError):
                pass
        elif not wait_if_empty:
            return None
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


class RunLock:
    """A claim on `<out_dir>/run.lock`: `attempt` until held (or `acquire`), then `release`."""

    def __init__(self, out_dir: str | os.PathLike, stale_minutes: float):
        self.path = Path(out_dir).absolute() / LOCK_NAME
        self.stale_minutes, self.stale_s = stale_minutes, stale_minutes * 60
        self.poll = min(1.0, max(0.05, self.stale_s / 20))
        self.me, self.fd, self.kernel_lock, self.made = LockHolder.me(), None, True, []
        self.waiting_since: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def acquire(cls, out_dir: str | os.PathLike, stale_minutes: float) -> RunLock:
        """The lock, once held (a restarted job waits for its predecessor); UsageError: refused."""
        lock = cls(out_dir, stale_minutes)
        while not lock.attempt():
            time.sleep(lock.poll)
        return lock

    @classmethod
    def acquire_for_run(cls, cfg, dims) -> RunLock | None:
        """Rank 0 tries, every rank learns the verdict (one broadcast a try): the lock on rank 0,
        None on the others; a refusal raises the same UsageError on every rank."""
        lock = cls(cfg.train.out_dir, cfg.train.lock_stale_minutes) if dims.rank == 0 else None
        while True:
            verdict = ["wait"]
            if lock is not None:
                try:
                    verdict[0] = "held" if lock.attempt() else "wait"
                except UsageError as e:
                    verdict[0] = str(e)
            if dims.world_size > 1:
                dist.broadcast_object_list(verdict, src=0)
            if verdict[0] == "held":
                return lock
            if verdict[0] != "wait":
                raise UsageError(verdict[0])
            if lock is not None:
                time.sleep(lock.poll)

    def attempt(self) -> bool:
        """One try: True once held, False to try again after `poll` s (waiting for this job's
        predecessor); raises UsageError when another trainer holds the lock."""
        try:
            flocked = self._flock()
        except OSError as e:
            raise UsageError(f"train.out_dir={self.path.parent}: cannot take the run lock {self.path} "
                             f"({e.strerror}): choose another train.out_dir") from e
        holder = read_holder(self.path, wait_if_empty=not flocked)
        if self._live(holder, flocked):
            if holder is None or not holder.precedes(self.me):
                self._close()
                raise UsageError(self._refusal(holder))
            if self.waiting_since is None:
                self.waiting_since = time.monotonic()
                log.warning(f"waiting up to train.lock_stale_minutes={self.stale_minutes} for an earlier run of job "
                            f"{holder.job} to release {self.path} ({holder.describe()})")
            if time.monotonic() - self.waiting_since < self.stale_s:
                return False
        self._take(holder, flocked)
        return True

    def _flock(self) -> bool:
        """Open the file (creating out_dir) and try the flock: True when held (or the filesystem
        has no flock), False when another process holds it."""
        while True:
            if self.fd is None:
                if not self.path.parent.exists():
                    self.made = [d for d in (self.path.parent, *self.path.parent.parents) if not d.exists()]
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except BlockingIOError:
                locked = False
            except OSError as e:
                if e.errno not in NO_FLOCK:
                    raise
                self.kernel_lock, locked = False, True
            if _same_file(self.fd, self.path):
                return locked
            self._close()  # the holder removed it as we opened it: try the file at the path now

    def _live(self, holder: LockHolder | None, flocked: bool) -> bool:
        if not flocked:
            return True
        if holder is None or (holder.host, holder.pid) == (self.me.host, self.me.pid):
            return False
        if holder.host == self.me.host:  # the kernel's lock is the truth here: a free one means its holder died
            return not self.kernel_lock and pid_alive(holder.pid)
        return holder.age() < self.stale_s  # another host: its flock may not reach this one

    def _refusal(self, holder: LockHolder | None) -> str:
        who = holder.describe() if holder is not None else "a holder whose record is unreadable"
        return (f"train.out_dir={self.path.parent} is in use by another trainer ({who}; {self.path}): wait for it "
                "to end or stop it, or choose another train.out_dir (a holder that is gone is taken over: at once "
                f"on its host, after train.lock_stale_minutes={self.stale_minutes} from another host)")

    def _take(self, holder: LockHolder | None, flocked: bool) -> None:
        if holder is not None and (holder.host, holder.pid) != (self.me.host, self.me.pid):
            if self.waiting_since is not None and holder.precedes(self.me):
                why = (f"an earlier run of job {holder.job}, waited for {time.monotonic() - self.waiting_since:.0f}s"
                       + ("" if flocked else ": its flock is still held, going on without it"))
            elif holder.host == self.me.host:
                why = f"pid {holder.pid} is gone" if not pid_alive(holder.pid) else "its flock was free: it died"
            else:
                why = f"its heartbeat is older than train.lock_stale_minutes={self.stale_minutes}"
            log.warning(f"taking over the run lock {self.path} from {holder.describe()}: {why}")
        self.me.started = time.time()
        self._write()
        self._thread = threading.Thread(target=self._beat, name="cplm-run-lock", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        self.me.heartbeat = time.time()
        data = json.dumps(dataclasses.asdict(self.me)).encode()
        os.pwrite(self.fd, data, 0)
        os.ftruncate(self.fd, len(data))
        os.fsync(self.fd)  # for readers on other hosts of a shared filesystem

    def _beat(self) -> None:
        interval = max(0.1, min(HEARTBEAT_S, self.stale_s / 3))
        while not self._stop.wait(interval):
            try:
                self._write()
            except OSError:  # a full disk, a lost mount: the next beat tries again
                pass

    def _close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = None

    def release(self) -> None:
        """Stop the heartbeat, remove the file (the flock still held), unlock and close; then the
        directories the lock created, where nothing else was written."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            if self._thread.is_alive():  # a write hangs (a lost mount): leave the descriptor to the exit
                return
        if self.fd is not None and _same_file(self.fd, self.path):
            self.path.unlink(missing_ok=True)
        self._close()
        for d in self.made:
            try:
                d.rmdir()
            except OSError:  # not empty: the run wrote there
                break
