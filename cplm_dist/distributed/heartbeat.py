"""Each rank's last sign of life, kept in the job's rendezvous store, so that when a collective
fails (a rank died, or hangs past `train.collective_timeout_minutes`) the survivors can say which
rank went quiet, when, and what it was doing.

    beat = Heartbeat.start()          # after init_distributed; a thread writes every `interval` s
    beat.update(phase="training", step=12)   # and at once on every change (each beat names its host)
    beat.quiet_ranks()                # [(rank, seconds since its last beat, its phase, its step)]

The thread uses its own connection to the store rank 0 hosts (MASTER_ADDR:MASTER_PORT), so it
never shares a socket with the collectives. A stopped (SIGSTOP) or dead rank stops beating; a
rank busy in a long computation keeps beating, which tells a hang from slowness.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from datetime import timedelta

import torch.distributed as dist

KEY = "cplm/heartbeat/{}"


def store_connection(timeout_s: float) -> dist.TCPStore:
    """A connection of the caller's own to the store rank 0 hosts (MASTER_ADDR:MASTER_PORT), for a
    thread that must never share a socket with the collectives (this heartbeat, the background
    checkpoint writer of cplm_dist.checkpoint.async_save)."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


class Heartbeat:
    def __init__(self, store, rank: int, world: int, interval: float, phase: str):
        self.store, self.rank, self.world, self.interval = store, rank, world, interval
        self.phase, self.step, self.host = phase, 0, socket.gethostname()
        self._stop, self._changed = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="cplm-heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, phase: str = "starting", interval: float = 2.0) -> "Heartbeat | None":
        """A heartbeat for this rank, or None for a one-process job (nobody to tell)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        return cls(store_connection(timeout_s=30), dist.get_rank(), dist.get_world_size(), interval, phase)

    def update(self, phase: str | None = None, step: int | None = None) -> None:
        self.phase = phase if phase is not None else self.phase
        self.step = step if step is not None else self.step
        self._changed.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.store.set(KEY.format(self.rank), json.dumps({"time": time.time(), "phase": self.phase, "step": self.step,
                                                                  "host": self.host}))
            except Exception:  # noqa: BLE001 - rank 0 (the store) is gone: nothing left to tell
                return
            self._changed.wait(self.interval)
            self._changed.clear()

    def quiet_ranks(self) -> list[tuple[int, float, str, int]]:
        """Ranks whose last beat is older than three intervals (or that never beat), oldest first."""
        now, out = time.time(), []
        for rank in range(self.world):
            try:
                if not self.store.check([KEY.format(rank)]):
                    out.append((rank, float("inf"), "starting", 0))
                    continue
                beat = json.loads(self.store.get(KEY.format(rank)))
            except Exception:  # noqa: BLE001 - the store itself is gone (rank 0 died)
                return []
            if now - beat["time"] > 3 * self.interval:
                out.append((rank, now - beat["time"], beat["phase"], beat["step"]))
        return sorted(out, key=lambda r: -r[1])

    def close(self) -> None:
        self._stop.set()
        self._changed.set()
        self._thread.join(timeout=1)
