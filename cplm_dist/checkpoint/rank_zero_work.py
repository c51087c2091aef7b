"""Work one rank does for all (a reshape's conversion), waited for outside the collectives.

A rank waiting in a collective is bounded by `train.collective_timeout_minutes` (10 by default),
which is right for a hung peer and wrong for a long piece of work: converting a 7B checkpoint
with its optimizer states (~100 GB) can take longer. So the others do not wait in a collective:

    rank 0                                        every other rank
    broadcast a fresh nonce (a quick collective)  receive it
    run the work                                  poll <marker> every `poll_s`
    write <marker> {"nonce", "error"} atomically  ... until it holds this nonce
    -> everyone has rank 0's verdict (None: it worked)

bounded by the work's own timeout (`train.reshape_timeout_minutes`). A waiting rank that reaches
it stops with one line; rank 0, finishing after it, stops with the same line (the others have
gone). The nonce keeps a marker left by an earlier attempt from passing for this one. The marker
lies in train.out_dir, which every rank reads anyway (the converted checkpoint is there too).
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from cplm_dist.errors import CheckpointError
from cplm_dist.files import write_text_atomic


def rank_zero_does(work: Callable[[], str | None], marker: Path, rank: int, world: int, timeout_minutes: float,
                   what: str, poll_s: float = 0.5) -> str | None:
    """Rank 0 runs `work` (it returns an error line, or None); every rank returns that verdict."""
    if world == 1:
        return work()
    nonce = [secrets.token_hex(8) if rank == 0 else None]
    dist.broadcast_object_list(nonce, src=0)
    start = time.monotonic()
    too_long = CheckpointError(f"{what} took longer than train.reshape_timeout_minutes={timeout_minutes:g} on rank 0: "
                               "raise train.reshape_timeout_minutes (the conversion reads and writes the whole "
                               "checkpoint with its optimizer states) and resume again")
    if rank == 0:
        marker.unlink(missing_ok=True)
        try:
            error = work()
        except BaseException as e:  # the others learn at once, not at their timeout
            _write(marker, nonce[0], f"{type(e).__name__} on rank 0: {str(e)[:200]}")
            raise
        _write(marker, nonce[0], error)
        if time.monotonic() - start > timeout_minutes * 60:
            raise too_long
        return error
    grace = min(10.0, 0.1 * timeout_minutes * 60)  # a marker written just in time, seen a little later on a shared filesystem
    while True:
        seen = _read(marker)
        if seen is not None and seen.get("nonce") == nonce[0]:
            return seen.get("error")
        if time.monotonic() - start > timeout_minutes * 60 + grace:
            raise too_long
        time.sleep(poll_s)


def _write(marker: Path, nonce: str, error: str | None) -> None:
    write_text_atomic(marker, json.dumps({"nonce": nonce, "error": error}) + "\n")


def _read(marker: Path) -> dict | None:
    try:
        seen = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return seen if isinstance(seen, dict) else None
