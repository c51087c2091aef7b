"""Checkpoints: DeepSpeed's save/load plus our client state, published atomically.

    <out_dir>/checkpoints/step-00000100/   DeepSpeed's files from every rank, then complete.json
    <out_dir>/checkpoints/latest           the tag of the newest complete checkpoint

A save is: every rank writes its DeepSpeed files; a barrier; rank 0 writes `complete.json` into
the tag, then replaces `latest` (written to a temporary file, fsynced, renamed); then older tags
beyond `train.keep_last` are deleted. A process killed anywhere in between leaves `latest` on
the previous complete checkpoint. The client state holds what DeepSpeed does not: the step, the
loader's consumed samples, tokens seen, skipped-step counters, RNG states and the resolved config.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from cplm_dist.config import Config, to_dict
from cplm_dist.errors import UsageError
from cplm_dist.parallel import ParallelDims

LATEST = "latest"
COMPLETE = "complete.json"


class CheckpointError(UsageError):
    """A checkpoint that cannot be resumed from (missing, incomplete, another layout)."""


def tag_for(step: int) -> str:
    return f"step-{step:08d}"


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def layout(cfg: Config, tp: int, dp: int) -> dict:
    return {"tp": tp, "dp": dp, "zero_stage": cfg.train.zero_stage}


def latest_tag(root: Path) -> str | None:
    """The newest complete checkpoint's tag under `root`, None when there is none; a `latest`
    pointing at something incomplete is an error (it should never happen, so it is not papered over)."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    tag = pointer.read_text().strip()
    if not (root / tag / COMPLETE).is_file():
        raise CheckpointError(f"{pointer} names '{tag}', which is not a complete checkpoint: "
                              f"point it at a complete step-* directory under {root} or start a new out_dir")
    return tag


def check_layout(root: Path, tag: str, cfg: Config, tp: int, dp: int) -> None:
    """A checkpoint resumes only with the layout it was saved with (ZeRO shards by dp)."""
    saved = json.loads((root / tag / COMPLETE).read_text())["layout"]
    here = layout(cfg, tp, dp)
    must_match = ["tp", "zero_stage"] + (["dp"] if here["zero_stage"] > 0 or saved["zero_stage"] > 0 else [])
    diff = {k: (saved[k], here[k]) for k in must_match if saved[k] != here[k]}
    if diff:
        what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in diff.items())
        raise CheckpointError(f"checkpoint {root / tag} was saved with another layout ({what}): "
                              "resume with the layout it was saved with")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Checkpointer:
    def __init__(self, root: str | Path, cfg: Config, dims: ParallelDims):
        self.root, self.cfg, self.dims = Path(root), cfg, dims
        self.layout = layout(cfg, dims.tp_size, dims.dp_size)

    def latest_tag(self) -> str | None:
        return latest_tag(self.root)

    # --- saving --------------------------------------------------------------------------------

    def save(self, engine, step: int, client_state: dict) -> Path:
        tag = tag_for(step)
        state = {**client_state, "step": step, "rng": rng_state(), "config": to_dict(self.cfg),
                 "layout": self.layout}
        engine.save_checkpoint(str(self.root), tag=tag, client_state=state, save_latest=False)
        dist.barrier()  # every rank's files are on disk
        if self.dims.rank == 0:
            marker = {"step": step, "time": time.time(), "layout": self.layout,
                      "consumed_samples": client_state.get("consumed_samples")}
            _write_atomic(self.root / tag / COMPLETE, json.dumps(marker, indent=2) + "\n")
            _write_atomic(self.root / LATEST, tag + "\n")
            self._prune(keep=self.cfg.train.keep_last, newest=tag)
        dist.barrier()
        return self.root / tag

    def _prune(self, keep: int, newest: str) -> None:
        complete = sorted(p.name for p in self.root.glob("step-*") if (p / COMPLETE).is_file())
        for tag in complete[:-keep]:
            if tag != newest:
                shutil.rmtree(self.root / tag, ignore_errors=True)
        # tags older than the newest complete one that never completed: a save killed midway
        for p in self.root.glob("step-*"):
            if not (p / COMPLETE).is_file() and p.name < newest:
                shutil.rmtree(p, ignore_errors=True)

    # --- loading -------------------------------------------------------------------------------

    def load(self, engine, tag: str) -> dict:
        check_layout(self.root, tag, self.cfg, self.dims.tp_size, self.dims.dp_size)
        path, client_state = engine.load_checkpoint(str(self.root), tag=tag, load_optimizer_states=True,
                                                    load_lr_scheduler_states=True)
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load {self.root / tag}: its files are missing or unreadable")
        set_rng_state(client_state["rng"])
        return client_state
