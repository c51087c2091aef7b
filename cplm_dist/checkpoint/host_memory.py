"""The memory this process may still take: what the asynchronous save's host copy is checked
against (cplm_dist.checkpoint.saver.check_async_save).

A Slurm job (and a container) is held to its cgroup's limit, not to the node's free memory: a node
with 1.5 TB free whose job got `--mem=200G` is killed by the OOM killer at 200 GB. So the answer is
the least of /proc/meminfo's MemAvailable and, for the process's cgroup and each cgroup above it
that sets a limit, the room under that limit:

    cgroup v2  memory.max - memory.current + inactive_file (memory.stat)       "max": no limit
    cgroup v1  memory.limit_in_bytes - memory.usage_in_bytes + total_inactive_file
               (a limit near 2**63: no limit)

The page cache's inactive part is counted as room (the kernel reclaims it before it kills), as
MemAvailable counts it. The process's cgroup comes from /proc/self/cgroup; where that path is not
under the mounted hierarchy (a container that sees its own cgroup as the root), the root is read.
"""

from __future__ import annotations

from pathlib import Path

NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as the largest page-aligned int64


def available_memory(meminfo: Path = Path("/proc/meminfo"), cgroup_root: Path = Path("/sys/fs/cgroup"),
                     self_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """Bytes this process may still allocate (None: nothing says)."""
    figures = [x for x in (mem_available(meminfo), cgroup_room(cgroup_root, self_cgroup)) if x is not None]
    return min(figures) if figures else None


def mem_available(meminfo: Path) -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cgroup_room(root: Path, self_cgroup: Path) -> int | None:
    """The least room under any memory limit of this process's cgroup and its ancestors (None: no limit set)."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        hierarchy, _, controllers_path = line.partition(":")
        controllers, _, path = controllers_path.partition(":")
        if not hierarchy or not path:
            continue
        if controllers == "":
            if (root / "cgroup.controllers").is_file():  # v2 mounted here (on a hybrid host, v1's line decides)
                rooms += _rooms(root, path, "memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            rooms += _rooms(root / "memory", path, "memory.limit_in_bytes", "memory.usage_in_bytes",
                            "total_inactive_file")  # v1
    return min(rooms) if rooms else None


def _rooms(mount: Path, path: str, limit_file: str, usage_file: str, inactive_key: str) -> list[int]:
    """Room under the limit of each cgroup from `path` up to the mount's root (where one is set)."""
    here = mount / path.strip("/")
    if not here.is_dir():
        here = mount  # a namespaced view: this process's cgroup is the root we see
    out = []
    while True:
        limit = _read_int(here / limit_file)
        if limit is not None and limit < NO_LIMIT:
            usage = _read_int(here / usage_file) or 0
            out.append(max(0, limit - usage + _stat(here / "memory.stat", inactive_key)))
        if here == mount or mount not in here.parents:
            return out
        here = here.parent


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        return 0
    return 0
