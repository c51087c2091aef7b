"""Saving and resuming a training run (`Checkpointer`), and what a run checks about its out_dir
before it starts.

A save is: every rank writes its DeepSpeed files (cplm_dist.checkpoint.safe_io names them) with
our client state, and a sparse model at ep > 1 its experts by global id (one file per ep x
expert-tp rank and stage: cplm_dist.checkpoint.expert_files); rank 0 copies the tokenizer in; a barrier; rank 0 writes the manifest
`complete.json` into the tag (cplm_dist.checkpoint.manifest), then replaces `latest` (written to a
temporary file, fsynced, renamed); then older tags are deleted (cplm_dist.checkpoint.pruning:
`train.keep_last`, `train.keep_every`, the last one before a WSD decay). A process
killed anywhere in between leaves `latest` on the previous complete checkpoint. Every rank learns
whether any failed to write; on a failure the partial directory is removed on all.

The client state inside DeepSpeed's files holds what only a resume needs: the loader position,
skipped-step counters, RNG states (tensors and plain values, so that a weights-only load reads
them) and the parameter layout a reshape reads (cplm_dist.checkpoint.parameter_record).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from cplm_dist.checkpoint.async_save import BackgroundSave, checkpoint_files, describe, run_id, start_save
from cplm_dist.checkpoint.expert_files import load_own_experts, write_experts
from cplm_dist.checkpoint.host_memory import available_memory
from cplm_dist.checkpoint.manifest import (COMPLETE, LATEST, Layout, Manifest, carry_tokenizer, check_layout, complete_tags,
                                           damaged_files, latest_tag, read_manifest, tag_for, tokenizer_files, versions,
                                           write_manifest)
from cplm_dist.checkpoint.parameter_record import ParameterRecord
from cplm_dist.checkpoint.pruning import decay_start, tags_to_delete
from cplm_dist.checkpoint.reshape import load_reshaped
from cplm_dist.checkpoint.reshape_experts import partition_record
from cplm_dist.checkpoint.safe_io import os_error, use_safe_loading
from cplm_dist.config import Config, to_dict
from cplm_dist.distributed import ParallelDims
from cplm_dist.errors import CheckpointError, UsageError
from cplm_dist.files import write_text_atomic
from cplm_dist.model.counting import parameter_count
from cplm_dist.training.expert_groups import saved_as_dense

log = logging.getLogger(__name__)


# --- what a run checks before it starts -----------------------------------------------------------


def checkpoint_bytes(cfg: Config) -> int:
    """About what one checkpoint takes on disk: the weights and AdamW's states (fp32 master copy
    under bf16, first and second moments) of every parameter."""
    per_parameter = 4 + 8 if cfg.train.precision == "fp32" else 2 + 12
    return parameter_count(cfg, padded=True)["total"] * per_parameter


def check_out_dir(cfg: Config) -> None:
    """train.out_dir must be writable and have room for a checkpoint: found before training
    starts, not at the first save `train.save_interval` steps later. Writes nothing."""
    out = Path(cfg.train.out_dir).absolute()
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise UsageError(f"train.out_dir={cfg.train.out_dir}: {existing} is not a directory: choose another train.out_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"train.out_dir={cfg.train.out_dir}: {existing} is not writable (read-only or another "
                         "owner's): choose another train.out_dir")
    need, free = checkpoint_bytes(cfg), shutil.disk_usage(existing).free
    if free < need:
        raise UsageError(f"train.out_dir={cfg.train.out_dir}: {free / 1e9:.2f} GB free on its filesystem but a "
                         f"checkpoint needs about {need / 1e9:.2f} GB: free space or choose another train.out_dir")
    if free < need * (cfg.train.keep_last + 1):
        log.warning(f"train.out_dir={cfg.train.out_dir}: {free / 1e9:.2f} GB free holds fewer than train.keep_last+1="
                    f"{cfg.train.keep_last + 1} checkpoints of about {need / 1e9:.2f} GB")


def check_async_save(cfg: Config, world: int) -> None:
    """train.async_save keeps a host copy of each rank's part of a checkpoint until the background
    thread has written it: refused at start-up when the memory this job may still take on this node
    (the least of the node's MemAvailable and the room under its cgroup's limit:
    cplm_dist.checkpoint.host_memory) cannot hold its ranks' copies (the local ranks from the
    launcher's environment; 1 when it gives none). Writes nothing."""
    if not cfg.train.async_save:
        return
    local = next((int(v) for k in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
                  if (v := os.environ.get(k, "")).isdigit()), 1)
    need, free = checkpoint_bytes(cfg) / world * min(local, world), available_memory()
    if free is not None and need > free:
        raise UsageError(f"train.async_save=true: the host copy of a checkpoint takes about {need / 1e9:.1f} GB on this "
                         f"node ({min(local, world)} of {world} ranks) but {free / 1e9:.1f} GB of memory is available to "
                         "this job (its cgroup limit, e.g. Slurm's --mem, or the node's free memory): "
                         "set train.async_save=false, or spread the job over more nodes")


# --- RNG --------------------------------------------------------------------------------------------


def rng_state() -> dict:
    """The generators' states as tensors and plain values only, so that a checkpoint loads with
    torch.load(weights_only=True): nothing in it needs unpickling code."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, torch.tensor(internal, dtype=torch.int64), gauss],
             "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal.tolist()), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# --- saving and resuming ---------------------------------------------------------------------------------


class Checkpointer:
    """Saves and resumes a run in `root`. It remembers the step whose state is on disk there, so
    that a stop request right after a save (or a resume) does not write that step again in place,
    which a kill during the rewrite would leave half-written under `latest`."""

    def __init__(self, root: str | Path, cfg: Config, dims: ParallelDims):
        self.root, self.cfg, self.dims = Path(root), cfg, dims
        self.layout = Layout.of(cfg, dims.tp_size, dims.dp_size)
        self.on_disk: tuple[int, Path] | None = None
        from cplm_dist.checkpoint.manifest import data_fingerprints

        # the blend's content fingerprints, once a run (rank 0 writes the manifest): each save records them
        self.data_fingerprints = data_fingerprints(cfg) if dims.rank == 0 else None
        self.background: BackgroundSave | None = None  # the asynchronous save in flight (train.async_save)
        self.run = run_id(dims) if cfg.train.async_save else None
        self.record: ParameterRecord | None = None  # cplm_dist.checkpoint.parameter_record, at the first save

    def latest_tag(self) -> str | None:
        return latest_tag(self.root)

    def save(self, engine, step: int, consumed_samples: int, client_state: dict) -> tuple[Path, bool]:
        """(the step's directory, whether it was written now: False when it already held this step)."""
        if self.on_disk is not None and self.on_disk[0] == step:
            return self.on_disk[1], False
        self.finish()  # the next save waits for the previous one
        tag = tag_for(step)
        state = {**client_state, "step": step, "rng": rng_state()}
        if self.record is None:  # what a reshape reads (gathered over the stages at pp > 1: once a run)
            self.record = ParameterRecord.of(engine.module, self.cfg, self.dims.tp_rank, self.dims.pp_size,
                                             partition_record(engine, self.cfg, self.dims))
        state.update(self.record.state())
        if self.cfg.train.async_save:  # cplm_dist.checkpoint.async_save: the host copy now, the writing behind
            self.background = start_save(self, engine, tag, state, step, consumed_samples, self.run)
            self.on_disk = (step, self.root / tag)
            return self.root / tag, True
        with saved_as_dense(engine):
            error = os_error(lambda: engine.save_checkpoint(str(self.root), tag=tag, client_state=state, save_latest=False),
                             self.root)
        if error is None:  # a sparse model's experts at ep > 1, by global id (cplm_dist.checkpoint.expert_files)
            error = os_error(lambda: write_experts(engine.module, self.dims, self.root / tag), self.root)
        if error is None and self.dims.rank == 0:
            error = os_error(lambda: carry_tokenizer(self.cfg, self.root / tag))
        self._agree(error, tag)  # every rank's files are on disk, or the save is undone everywhere
        files = self._describe_files(self.root / tag)
        error = self.complete(tag, step, consumed_samples, files) if self.dims.rank == 0 else None
        self._agree(error, tag)
        dist.barrier()
        self.on_disk = (step, self.root / tag)
        return self.root / tag, True

    def complete(self, tag: str, step: int, consumed_samples: int, files: dict) -> str | None:
        """Rank 0, once every rank's files of `tag` are on disk and hashed: the manifest, then
        `latest`, then keep-last-N pruning. A failure to write as one line (None: it worked)."""
        manifest = Manifest(step_dir=self.root / tag, step=step, time=time.time(), layout=self.layout, cwd=os.getcwd(),
                            consumed_samples=consumed_samples, consumed_tokens=consumed_samples * self.cfg.data.seq_length,
                            config=to_dict(self.cfg), versions=versions(), files=files,
                            tokenizer_files=tuple(tokenizer_files(self.cfg)), data_fingerprints=self.data_fingerprints)
        error = os_error(lambda: write_manifest(manifest))
        error = error or os_error(lambda: write_text_atomic(self.root / LATEST, tag + "\n"))
        if error is None:
            self._prune(keep=self.cfg.train.keep_last, newest=tag)
        return error

    def finish(self, last: bool = False) -> BackgroundSave | None:
        """Wait until the asynchronous save in flight (if any) is complete on every rank and
        return it; one that failed is a CheckpointError, as a synchronous save's failure is.
        `last` (every rank together, before the run ends): also a barrier, so that rank 0, which
        hosts the store the verdict is read from, outlives every rank's reading of it."""
        save, self.background = self.background, None
        if save is not None and save.wait() is None and last:
            dist.barrier()
        if save is None or save.error is None:
            return save
        self.on_disk = None
        previous = latest_tag(self.root)
        raise CheckpointError(f"saving {save.step_dir} in the background failed on {save.error}; removed it, "
                              f"{'the latest checkpoint stays ' + previous if previous else 'no checkpoint was kept'}: "
                              "free space or fix train.out_dir, then continue with --resume auto")

    def _agree(self, error: str | None, tag: str) -> None:
        """All ranks learn whether any failed to write; on a failure rank 0 removes the partial
        directory (its manifest too), so `latest` keeps naming the previous complete checkpoint."""
        gathered = [None] * self.dims.world_size
        dist.all_gather_object(gathered, error)
        failed = [(r, e) for r, e in enumerate(gathered) if e]
        if not failed:
            return
        if self.dims.rank == 0:
            shutil.rmtree(self.root / tag, ignore_errors=True)
        dist.barrier()
        rank, why = failed[0]
        previous = latest_tag(self.root)
        raise CheckpointError(f"saving {self.root / tag} failed on rank {rank}: {why}; removed it, "
                              f"{'the latest checkpoint stays ' + previous if previous else 'no checkpoint was kept'}: "
                              "free space or fix train.out_dir, then continue with --resume auto")

    def _describe_files(self, step_dir: Path) -> dict:
        """{name: {bytes, sha256}} of the step's files, each rank hashing every world-th one."""
        paths = checkpoint_files(step_dir)
        rank, world = self.dims.rank, self.dims.world_size
        mine = {p.name: describe(p) for i, p in enumerate(paths) if i % world == rank}
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        return {name: entry for part in gathered for name, entry in sorted(part.items())}

    def loads_universal(self, source: Manifest | None) -> bool:
        """Whether the engine must be built to load a universal checkpoint: a resume from another
        layout under ZeRO > 0 (at ZeRO-0 cplm_dist.checkpoint.reshape loads it without DeepSpeed)."""
        return (source is not None and self.cfg.train.zero_stage > 0
                and bool(source.layout_change(self.cfg, self.dims.tp_size, self.dims.dp_size)))

    def newest_intact(self, source: Manifest) -> Manifest:
        """`source`, or the newest older complete checkpoint beside it whose files all match their
        manifest (sizes and sha256, hashed by all ranks together), with a warning for each one skipped."""
        root = source.root
        for candidate in reversed([t for t in complete_tags(root) if t <= source.tag]):
            manifest = source if candidate == source.tag else None
            try:
                manifest = manifest or read_manifest(root / candidate)
            except CheckpointError as e:
                bad = [str(e)]
            else:
                bad = damaged_files(manifest, self.dims.rank, self.dims.world_size)
            gathered = [None] * self.dims.world_size
            dist.all_gather_object(gathered, bad)
            bad = sorted({b for part in gathered for b in part})
            if not bad:
                return manifest
            if self.dims.rank == 0:
                log.warning(f"skipping checkpoint {root / candidate}: damaged or missing {bad[:3]} "
                            "(sizes or sha256 differ from its manifest)")
        raise CheckpointError(f"{root}: every complete checkpoint up to {source.tag} has damaged files: "
                              "start a new out_dir (or restore the files)")

    def _prune(self, keep: int, newest: str) -> None:
        t = self.cfg.train  # keep_last, keep_every and the checkpoint before a WSD decay (cplm_dist.checkpoint.pruning)
        for tag in tags_to_delete(complete_tags(self.root), newest, keep, t.keep_every, decay_start(self.cfg)):
            shutil.rmtree(self.root / tag, ignore_errors=True)
        # tags older than the newest complete one that never completed: a save killed midway
        for p in self.root.glob("step-*"):
            if not (p / COMPLETE).is_file() and p.name < newest:
                shutil.rmtree(p, ignore_errors=True)

    def load(self, engine, source: Manifest, reshape: bool = False) -> dict:
        """Weights, optimizer, schedule (DeepSpeed) and our client state from the checkpoint of
        manifest `source`; with `reshape`, also from one saved at another layout
        (cplm_dist.checkpoint.reshape)."""
        check_layout(source, self.cfg, self.dims.tp_size, self.dims.dp_size, reshape)
        use_safe_loading(engine)  # a resume never unpickles code from a received checkpoint
        if source.layout_change(self.cfg, self.dims.tp_size, self.dims.dp_size):
            client_state = load_reshaped(engine, source, self.cfg, self.dims)
        else:
            with saved_as_dense(engine):
                path, client_state = engine.load_checkpoint(str(source.root), tag=source.tag, load_optimizer_states=True,
                                                            load_lr_scheduler_states=True)
            if path is None:
                raise CheckpointError(f"DeepSpeed could not load {source.step_dir}: its files are missing or unreadable")
            load_own_experts(engine.module, source, self.dims)  # DeepSpeed's module states hold ep rank 0's
        set_rng_state(client_state["rng"])
        if source.root.resolve() == self.root.resolve():
            self.on_disk = (client_state["step"], self.root / source.tag)
        return client_state
