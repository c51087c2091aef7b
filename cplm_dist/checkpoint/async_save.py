"""Asynchronous checkpoints (`train.async_save: true`): the step loop blocks only while each
rank's states are copied to host memory; a background thread writes them, hashes them and, on
rank 0 once every rank has reported, writes the manifest and moves `latest`.

    save = start_save(ckpt, engine, tag, state, step, consumed)   # blocks for the host copy only
    ...                                                           # training goes on
    error = save.wait()                                           # the next save, or the end of the run

The files are DeepSpeed's own (the same names, contents and loading as a synchronous save) and,
for a sparse model at ep > 1, each ep rank's expert file (its host copy taken beside them): while
`engine.save_checkpoint` runs, `SnapshotEngine` stands in for DeepSpeed's checkpoint engine, and
its `save(state, path)` copies the state (every tensor cloned to CPU) instead of writing it. That
keeps resume, `--reshape`, zero_to_fp32 and evaluation unchanged. Not chosen:

- DeepSpeed's DecoupledCheckpointEngine: it wraps the aio-based FastCheckpointEngine (a CUDA/aio
  op) and sets the multiprocessing start method to spawn for the whole process.
- torch.distributed.checkpoint's async_save: another on-disk format (a DCP directory), which the
  universal-checkpoint reshape, zero_to_fp32 and our manifest do not read.

The ranks agree through the job's rendezvous store on a connection of their own (as
cplm_dist/distributed/heartbeat.py), never through a collective from the thread, which could interleave with
the step loop's: rank r posts `cplm/save/<run>/<tag>/<r>` = {error, files: {name: bytes, sha256}},
rank 0 waits for all, writes complete.json and `latest` (or removes the directory when any rank
failed) and posts the verdict every rank waits for. A process killed during the write leaves no
complete.json: `latest` still names the previous checkpoint, and the partial directory is pruned.
"""

from __future__ import annotations

import copy
import json
import shutil
import threading
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from cplm_dist.checkpoint.expert_files import expert_state
from cplm_dist.checkpoint.manifest import COMPLETE, carry_tokenizer
from cplm_dist.checkpoint.safe_io import os_error
from cplm_dist.distributed.heartbeat import store_connection
from cplm_dist.files import sha256_file
from cplm_dist.training.expert_groups import saved_as_dense

KEY = "cplm/save/{run}/{tag}/{who}"
POLL_S = 0.2


def to_host(obj):
    """A copy of a state that later steps cannot change: tensors cloned to CPU (compact: a view
    no longer drags its whole storage along), containers rebuilt, anything else deep-copied."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps OrderedDict / defaultdict
        out.clear()
        out.update((k, to_host(v)) for k, v in obj.items())
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(to_host(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(v) for v in obj)
    return copy.deepcopy(obj)


class SnapshotEngine:
    """DeepSpeed's checkpoint engine while an asynchronous save is taken: `save` keeps a host copy
    of each state and its path (`taken`); loading, directories and everything else go to the engine
    it replaces (DeepSpeed's CheckpointEngine interface, by delegation: importing deepspeed here,
    before cplm_dist.megatron_compat names its accelerator, would print a warning into tools' output)."""

    def __init__(self, inner):
        self.name, self.inner, self.taken = "cplm-snapshot", inner, []

    def __getattr__(self, name):  # is_data_parallel_writer, is_decoupled, cleanup, ...: the replaced engine's
        return getattr(self.__dict__["inner"], name)

    def create(self, info) -> None:
        self.taken = []

    def save(self, state_dict, path: str) -> None:
        self.taken.append((Path(path), to_host(state_dict)))

    def load(self, path: str, map_location=None):
        return self.inner.load(path, map_location=map_location)

    def makedirs(self, path, exist_ok=False) -> None:
        self.inner.makedirs(path, exist_ok=exist_ok)

    def commit(self, info) -> bool:
        return True

    def preserves_storage_sharing(self) -> bool:
        return False  # to_host already copies each tensor compactly: no second clone


def snapshot_engine(engine) -> SnapshotEngine:
    if not isinstance(engine.checkpoint_engine, SnapshotEngine):
        engine.checkpoint_engine = SnapshotEngine(engine.checkpoint_engine)
    return engine.checkpoint_engine


def run_id(dims) -> str:
    """One id a run's ranks share (rank 0's, broadcast): store keys of an earlier attempt under
    the same torchrun agent store can never answer for this one."""
    box = [uuid.uuid4().hex[:12] if dims.rank == 0 else None]
    if dims.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def store_client(world_size: int):
    """A connection of this thread's own to the job's rendezvous store (None: one process)."""
    return None if world_size == 1 else store_connection(timeout_s=60)


class BackgroundSave:
    """One asynchronous save of `tag`: the files `taken` by SnapshotEngine, written by a thread."""

    def __init__(self, ckpt, tag: str, step: int, consumed_samples: int, taken: list, run: str):
        self.ckpt, self.tag, self.step, self.consumed, self.taken, self.run = ckpt, tag, step, consumed_samples, taken, run
        self.rank, self.world = ckpt.dims.rank, ckpt.dims.world_size
        self.timeout_s = ckpt.cfg.train.collective_timeout_minutes * 60
        self.write_s, self.error = None, None
        self.started = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name=f"cplm-save-{tag}", daemon=True)
        self._thread.start()

    @property
    def step_dir(self) -> Path:
        return self.ckpt.root / self.tag

    def wait(self) -> str | None:
        """Block until the save is complete everywhere (or failed): None, or "rank R: what went wrong"."""
        self._thread.join()
        return self.error

    def done(self) -> bool:
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            self.error = self._save()
        except Exception as e:  # noqa: BLE001 - a lost store (rank 0 died), anything: the save did not complete
            self.error = f"rank {self.rank}: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        self.write_s = time.perf_counter() - self.started

    def _save(self) -> str | None:
        error = self._write()
        files = {} if error else {p.name: describe(p) for p, _ in self.taken}
        self.taken = []  # the host copies can go
        store = store_client(self.world)
        if store is None:
            return self._complete([{"error": error, "files": files}])
        self._post(store, self.rank, {"error": error, "files": files})
        if self.rank == 0:
            verdict = self._complete(self._gather(store))
            self._post(store, "verdict", {"error": verdict})
            return verdict
        return self._wait_for(store, ["verdict"])[0]["error"]

    def _write(self) -> str | None:
        for path, state in self.taken:
            error = os_error(lambda: torch.save(state, path), self.ckpt.root)
            if error:
                return error
        if self.rank == 0:
            return os_error(lambda: carry_tokenizer(self.ckpt.cfg, self.step_dir))
        return None

    def _complete(self, reports: list[dict]) -> str | None:
        """Rank 0 with every rank's report: the manifest and `latest`, or the directory removed."""
        failed = [(r, rep["error"]) for r, rep in enumerate(reports) if rep["error"]]
        if failed:
            shutil.rmtree(self.step_dir, ignore_errors=True)
            return f"rank {failed[0][0]}: {failed[0][1]}"
        files = {name: entry for rep in reports for name, entry in rep["files"].items()}
        for p in checkpoint_files(self.step_dir):  # what no rank reported: the tokenizer, DeepSpeed's script
            files.setdefault(p.name, describe(p))
        error = self.ckpt.complete(self.tag, self.step, self.consumed, dict(sorted(files.items())))
        if error:
            shutil.rmtree(self.step_dir, ignore_errors=True)
        return f"rank 0: {error}" if error else None

    def _post(self, store, who, value: dict) -> None:
        store.set(KEY.format(run=self.run, tag=self.tag, who=who), json.dumps(value))

    def _gather(self, store) -> list[dict]:
        return self._wait_for(store, list(range(self.world)))

    def _wait_for(self, store, whos: list) -> list[dict]:
        """The reports `whos` posted, waiting while any rank still reports within the collective
        timeout of the last one that did (a rank that died mid-write never will)."""
        keys = [KEY.format(run=self.run, tag=self.tag, who=w) for w in whos]
        seen, last = set(), time.monotonic()
        while len(seen) < len(keys):
            now_seen = {k for k in keys if k in seen or store.check([k])}
            if now_seen != seen:
                seen, last = now_seen, time.monotonic()
            elif time.monotonic() - last > self.timeout_s:
                missing = [w for w, k in zip(whos, keys) if k not in seen]
                raise TimeoutError(f"{missing} did not report within train.collective_timeout_minutes")
            else:
                time.sleep(POLL_S)
        return [json.loads(store.get(k)) for k in keys]


def checkpoint_files(step_dir: Path) -> list[Path]:
    """The files a save wrote into `step_dir` (not the manifest itself), sorted."""
    return sorted(p for p in step_dir.iterdir() if p.is_file() and p.name != COMPLETE)


def describe(path: Path) -> dict:
    """A checkpoint file's manifest entry."""
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def start_save(ckpt, engine, tag: str, state: dict, step: int, consumed_samples: int, run: str) -> BackgroundSave:
    """DeepSpeed's save with the host copy in place of the writes (every rank, together), then the
    writing handed to a thread. Returns at once after the copy."""
    snap = snapshot_engine(engine)
    with saved_as_dense(engine):
        error = os_error(lambda: engine.save_checkpoint(str(ckpt.root), tag=tag, client_state=state, save_latest=False),
                         ckpt.root)
    ckpt._agree(error, tag)  # a failure to take the copy (or to make the directory) is one line at once, as sync
    taken, snap.taken = snap.taken, []
    experts = expert_state(engine.module, ckpt.dims)  # a sparse model's at ep > 1 (cplm_dist.checkpoint.expert_files)
    if experts is not None:
        taken.append((ckpt.root / tag / experts[0], to_host(experts[1])))
    return BackgroundSave(ckpt, tag, step, consumed_samples, taken, run)
