"""Files rank 0 writes that every rank reads, on a path that may be node-local (a node's own disk,
e.g. `data.cache_dir=/local/scratch/cache`): each other host gets a copy, written once, by its
first rank that does not see rank 0's files.

    writers = copy_plan(path)                  # every rank, together; {} when the path is shared
    ... rank 0 writes the files under path ...
    copy_from_rank0(path, writers)             # every rank, together

On the shared filesystem (the usual case, and the default index cache beside the data) nothing is
copied: the probe says every rank already sees rank 0's directory.
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import torch.distributed as dist

CHUNK = 64 * 1024 * 1024  # bytes a broadcast carries


def copy_plan(path: Path) -> dict[str, int]:
    """{host: the rank that writes that host's copy} for the hosts that do not see `path` as
    rank 0 does (empty when every rank sees it: a shared directory). Collective."""
    path = Path(path)
    token = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    probe = path / f".cplm-shared-probe-{token[0]}"
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_text("rank 0\n")
    dist.barrier()
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (socket.gethostname(), probe.exists()))
    dist.barrier()
    if dist.get_rank() == 0:
        probe.unlink(missing_ok=True)
    writers: dict[str, int] = {}
    for rank, (host, sees) in enumerate(seen):
        if not sees:
            writers.setdefault(host, rank)
    return writers


def copy_from_rank0(path: Path, writers: dict[str, int]) -> None:
    """Every file under rank 0's `path` written to the same place by each writer rank (files the
    writer already holds with the same size are skipped). Collective; a no-op without writers."""
    if not writers:
        return
    path, rank = Path(path), dist.get_rank()
    listing = [sorted((str(p.relative_to(path)), p.stat().st_size) for p in path.rglob("*") if p.is_file())
               if rank == 0 else None]
    dist.broadcast_object_list(listing, src=0)
    writing = rank in writers.values()
    for name, size in listing[0]:
        target = path / name
        mine = writing and not (target.is_file() and target.stat().st_size == size)
        needed = [None] * dist.get_world_size()
        dist.all_gather_object(needed, mine)
        if not any(needed):
            continue
        tmp = target.with_name(f".{target.name}.{os.getpid()}.part") if mine else None
        if tmp is not None:
            tmp.parent.mkdir(parents=True, exist_ok=True)
        with (open(path / name, "rb") if rank == 0 else _null()) as src, (open(tmp, "wb") if tmp else _null()) as dst:
            for _ in range(0, max(size, 1), CHUNK):
                chunk = [src.read(CHUNK) if rank == 0 else None]
                dist.broadcast_object_list(chunk, src=0)
                if tmp is not None:
                    dst.write(chunk[0])
        if tmp is not None:
            os.replace(tmp, target)
    dist.barrier()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
