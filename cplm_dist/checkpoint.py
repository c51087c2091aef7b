"""The checkpoint format, in one place: where checkpoints live, what a complete one holds, how a
run saves, resumes and is loaded for evaluation.

    <out_dir>/checkpoints/step-00000100/   DeepSpeed's files from every rank, then complete.json
    <out_dir>/checkpoints/latest           the tag of the newest complete checkpoint

A save is: every rank writes its DeepSpeed files (model states `mp_rank_XX_model_states.pt`, or
under ZeRO-3 `zero_pp_rank_0_mp_rank_XX_model_states.pt`, plus optimizer shards) with our client
state; a barrier; rank 0 writes the manifest `complete.json` into the tag, then replaces `latest`
(written to a temporary file, fsynced, renamed); then older tags beyond `train.keep_last` are
deleted. A process killed anywhere in between leaves `latest` on the previous complete checkpoint.

The manifest is what a reader needs without unpickling anything: the step, consumed samples and
tokens, the layout (tp, dp, ZeRO stage), the resolved config and the package versions. The client
state inside DeepSpeed's files holds what only a resume needs: the loader position, skipped-step
counters and RNG states.

Anywhere a user names a checkpoint, a run directory, its checkpoints/ directory or one step-*
directory will do (`resolve_checkpoint`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import random
import shutil
import time
from importlib import metadata
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from cplm_dist.config import RESUMABLE_CHANGES, Config, check_tp_divides, from_dict, to_dict
from cplm_dist.errors import ConfigError, UsageError
from cplm_dist.files import sha256_file, write_text_atomic
from cplm_dist.megatron_compat import import_deepspeed
from cplm_dist.parallel import ParallelDims

LATEST = "latest"
COMPLETE = "complete.json"
FORMAT = 1  # complete.json's layout; bumped when it changes

log = logging.getLogger(__name__)

class CheckpointError(UsageError):
    """A checkpoint that cannot be resumed from or loaded (missing, incomplete, another layout)."""


# --- names and resolution -------------------------------------------------------------------------


def tag_for(step: int) -> str:
    return f"step-{step:08d}"


def model_states_file(step_dir: Path, tp_rank: int) -> Path:
    """The DeepSpeed model-states file of tp rank `tp_rank` (its name differs under ZeRO-3)."""
    plain = step_dir / f"mp_rank_{tp_rank:02d}_model_states.pt"
    return plain if plain.is_file() else step_dir / f"zero_pp_rank_0_mp_rank_{tp_rank:02d}_model_states.pt"


def complete_tags(root: Path) -> list[str]:
    """Tags of the complete checkpoints under `root`, oldest first."""
    return sorted(p.name for p in root.glob("step-*") if (p / COMPLETE).is_file())


def latest_tag(root: Path) -> str | None:
    """The newest complete checkpoint's tag under `root` (None: there is none). `latest` names it;
    when `latest` is missing, unreadable or names something incomplete, the complete checkpoints
    are scanned instead (with a warning): a lost pointer never makes a run start over."""
    pointer = root / LATEST
    tags = complete_tags(root)
    try:
        tag = pointer.read_text(encoding="ascii").strip() if pointer.is_file() else None
    except (OSError, UnicodeDecodeError):
        tag = "<unreadable>"
    if tag is not None and tag in tags:
        return tag
    if tags and (tag is not None or pointer.exists()):
        log.warning(f"{pointer} names {tag!r}, not a complete checkpoint: using the newest complete checkpoint, {tags[-1]}")
    elif tags:
        log.warning(f"{pointer} is missing: using the newest complete checkpoint, {tags[-1]}")
    return tags[-1] if tags else None


def resolve_checkpoint(path: str | Path) -> tuple[Path, str]:
    """(checkpoints root, tag) for a run dir, a checkpoints dir, or a step directory."""
    p = Path(path)
    if (p / COMPLETE).is_file():
        return p.parent, p.name
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    tag = latest_tag(root) if root.is_dir() else None
    if tag is None:
        raise CheckpointError(f"{path}: no complete checkpoint there (a run directory, its checkpoints/, or a step-* directory)")
    return root, tag


def find_resume(cfg: Config, resume: str | None, tp: int, dp: int, reshape: bool = False) -> tuple[Path | None, str | None]:
    """(checkpoint root, tag) to resume from, or (None, None) for a fresh start; refuses to
    write over another run, and a layout change unless `reshape`. Reads only: nothing is created
    or changed."""
    out = Path(cfg.train.out_dir)
    if resume is None:
        if (out / "checkpoints").exists() or (out / "logs" / "metrics.jsonl").exists():
            raise UsageError(f"train.out_dir={out} already holds a run: continue it with --resume auto, "
                             "or choose another train.out_dir")
        return None, None
    source = out if resume == "auto" else Path(resume)
    if (source / COMPLETE).is_file():  # one step-* directory: that step, not the newest
        root, tag = source.parent, source.name
    else:
        root = source / "checkpoints" if resume == "auto" or (source / "checkpoints").is_dir() else source
        tag = latest_tag(root) if root.is_dir() else None
    if resume != "auto" and root.resolve() != (out / "checkpoints").resolve() and (out / "checkpoints").exists():
        raise UsageError(f"train.out_dir={out} already holds a run: choose another train.out_dir to continue {resume} into")
    if tag is None:
        if resume == "auto" and not (root.is_dir() and any(root.glob("step-*"))):
            return None, None
        raise CheckpointError(f"--resume {resume}: no complete checkpoint in {root}; "
                              "give a run directory, its checkpoints/ directory or one step-* directory, or --resume auto for a new out_dir")
    tag = readable_tag(root, tag)
    check_layout(root, tag, cfg, tp, dp, reshape)
    check_config_change(root / tag, cfg)
    return root, tag


def readable_tag(root: Path, newest: str) -> str:
    """`newest`, or the newest older complete checkpoint whose manifest reads (with a warning)."""
    candidates = [t for t in complete_tags(root) if t <= newest]
    for tag in reversed(candidates):
        try:
            read_manifest(root / tag)
            return tag
        except CheckpointError as e:
            log.warning(f"skipping {root / tag}: {e}")
    raise CheckpointError(f"{root}: no complete checkpoint with a readable {COMPLETE}: start a new out_dir")


def check_config_change(step_dir: Path, cfg: Config) -> None:
    """A resumed run may change only RESUMABLE_CHANGES; one line names any other difference."""
    saved, here = _flatten(read_manifest(step_dir)["config"]), _flatten(to_dict(cfg))
    changed = [k for k in sorted(saved) if k not in RESUMABLE_CHANGES and saved[k] != here.get(k)]
    if changed:
        what = ", ".join(f"{k} {saved.get(k)!r} -> {here.get(k)!r}" for k in changed[:4]) + (" ..." if len(changed) > 4 else "")
        raise CheckpointError(f"checkpoint {step_dir} was trained with another config ({what}): resume with the saved "
                              f"values, or start a new out_dir; a resume may change only {', '.join(RESUMABLE_CHANGES[:6])}, "
                              "... (cplm_dist.checkpoint.RESUMABLE_CHANGES)")


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def checkpoint_bytes(cfg: Config) -> int:
    """About what one checkpoint takes on disk: the weights and AdamW's states (fp32 master copy
    under bf16, first and second moments) of every parameter."""
    from cplm_dist.model.counting import parameter_count

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


# --- the manifest ---------------------------------------------------------------------------------


def layout(cfg: Config, tp: int, dp: int) -> dict:
    return {"tp": tp, "pp": cfg.parallel.pp, "dp": dp, "zero_stage": cfg.train.zero_stage}


def versions() -> dict:
    out = {}
    for name in ("cplm_dist", "torch", "deepspeed", "megatron-core"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def checkpoint_files(step_dir: Path) -> list[Path]:
    """The files a save wrote into `step_dir` (not the manifest itself), sorted."""
    return sorted(p for p in step_dir.iterdir() if p.is_file() and p.name != COMPLETE)


def damaged_files(step_dir: Path, manifest: dict, rank: int = 0, world: int = 1, names: list[str] | None = None) -> list[str]:
    """The files of the manifest (or `names` of them) that are missing, of another size or whose
    sha256 differs; with several ranks each hashes its share (every world-th file)."""
    files = manifest.get("files", {})
    out = []
    for i, name in enumerate(sorted(names if names is not None else files)):
        entry, path = files.get(name), step_dir / name
        if entry is None or not path.is_file() or path.stat().st_size != entry["bytes"]:
            out.append(name)
        elif i % world == rank and sha256_file(path) != entry["sha256"]:
            out.append(name)
    return out


def read_manifest(step_dir: Path) -> dict:
    """complete.json of a checkpoint, checked to hold what a reader needs."""
    path = step_dir / COMPLETE
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{step_dir} is not a complete checkpoint (no {COMPLETE})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is damaged ({e}): use an earlier step-* directory") from None
    if isinstance(manifest, dict) and manifest.get("format", FORMAT) != FORMAT:
        raise CheckpointError(f"{path} has checkpoint format {manifest.get('format')!r}; this cplm_dist reads format "
                              f"{FORMAT}: use the cplm_dist version that wrote it ({manifest.get('versions')})")
    missing = [k for k in ("step", "layout", "config", "files") if not isinstance(manifest, dict) or k not in manifest]
    if missing:
        raise CheckpointError(f"{path} lacks {missing}: it was not written by this version of cplm-train; "
                              "use a checkpoint saved by it")
    return manifest


def layout_change(root: Path, tag: str, cfg: Config, tp: int, dp: int) -> dict:
    """{field: (saved, now)} of the layout fields that differ in a way the saved files cannot be
    read in place (ZeRO shards by dp, so dp counts only under ZeRO > 0)."""
    saved, here = {"pp": 1, **read_manifest(root / tag)["layout"]}, layout(cfg, tp, dp)
    must_match = ["tp", "pp", "zero_stage"] + (["dp"] if here["zero_stage"] > 0 or saved["zero_stage"] > 0 else [])
    return {k: (saved[k], here[k]) for k in must_match if saved[k] != here[k]}


def check_layout(root: Path, tag: str, cfg: Config, tp: int, dp: int, reshape: bool = False) -> None:
    """A checkpoint resumes with the layout it was saved with, or with another one under
    `reshape` where the new layout can hold it (cplm_dist.reshape)."""
    diff = layout_change(root, tag, cfg, tp, dp)
    if not diff:
        return
    what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in diff.items())
    if not reshape:
        raise CheckpointError(f"checkpoint {root / tag} was saved with another layout ({what}): resume with the "
                              "layout it was saved with, or add --reshape to convert it to this one")
    from cplm_dist.reshape import check_reshape

    check_reshape(read_manifest(root / tag)["layout"], cfg, tp, dp, root / tag)


def _os_error(write, directory: Path | None = None) -> str | None:
    """Run `write`; a failure to write as one line (None: it worked). torch.save hides the
    operating system's reason ("unexpected pos 704 vs 598"), so after any other error a probe
    write into `directory` finds it: no space left, read-only, file too large."""
    try:
        write()
    except OSError as e:
        return f"{e.strerror or e}{f' ({e.filename})' if e.filename else ''}"
    except Exception as e:  # noqa: BLE001 - whatever torch or DeepSpeed raised, the disk's reason is what matters
        probe = _probe_write(directory) if directory is not None else None
        return probe or f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return None


def _probe_write(directory: Path) -> str | None:
    probe = directory / f".write-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            for _ in range(8):
                f.write(b"\0" * (1 << 20))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        free = f", {shutil.disk_usage(directory).free / 1e9:.2f} GB free" if directory.is_dir() else ""
        return f"{e.strerror or e} ({directory}{free})"
    finally:
        probe.unlink(missing_ok=True)
    return None


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


# --- saving and resuming (training) -------------------------------------------------------------------


class Checkpointer:
    """Saves and resumes a run in `root`. It remembers the step whose state is on disk there, so
    that a stop request right after a save (or a resume) does not write that step again in place,
    which a kill during the rewrite would leave half-written under `latest`."""

    def __init__(self, root: str | Path, cfg: Config, dims: ParallelDims):
        self.root, self.cfg, self.dims = Path(root), cfg, dims
        self.layout = layout(cfg, dims.tp_size, dims.dp_size)
        self.on_disk: tuple[int, Path] | None = None

    def latest_tag(self) -> str | None:
        return latest_tag(self.root)

    def save(self, engine, step: int, consumed_samples: int, client_state: dict) -> tuple[Path, bool]:
        """(the step's directory, whether it was written now: False when it already held this step)."""
        if self.on_disk is not None and self.on_disk[0] == step:
            return self.on_disk[1], False
        from cplm_dist.reshape import UNIVERSAL_INFO, universal_info

        tag = tag_for(step)
        state = {**client_state, "step": step, "rng": rng_state()}
        if self.dims.pp_size == 1:  # what a reshape reads; pipeline checkpoints are not reshaped
            state[UNIVERSAL_INFO] = universal_info(engine.module)
        error = _os_error(lambda: engine.save_checkpoint(str(self.root), tag=tag, client_state=state, save_latest=False),
                          self.root)
        if error is None and self.dims.rank == 0:
            error = _os_error(lambda: carry_tokenizer(self.cfg, self.root / tag))
        self._agree(error, tag)  # every rank's files are on disk, or the save is undone everywhere
        files = self._describe_files(self.root / tag)
        error = None
        if self.dims.rank == 0:
            manifest = {"format": FORMAT, "step": step, "time": time.time(), "layout": self.layout, "cwd": os.getcwd(),
                        "consumed_samples": consumed_samples,
                        "consumed_tokens": consumed_samples * self.cfg.data.seq_length,
                        "config": to_dict(self.cfg), "versions": versions(), "files": files}
            error = _os_error(lambda: write_text_atomic(self.root / tag / COMPLETE, json.dumps(manifest, indent=2) + "\n"))
            error = error or _os_error(lambda: write_text_atomic(self.root / LATEST, tag + "\n"))
        self._agree(error, tag)
        if self.dims.rank == 0:
            self._prune(keep=self.cfg.train.keep_last, newest=tag)
        dist.barrier()
        self.on_disk = (step, self.root / tag)
        return self.root / tag, True

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
        mine = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
                for i, p in enumerate(paths) if i % world == rank}
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        return {name: entry for part in gathered for name, entry in sorted(part.items())}

    def loads_universal(self, source_root: Path | None, tag: str | None) -> bool:
        """Whether the engine must be built to load a universal checkpoint: a resume from another
        layout under ZeRO > 0 (at ZeRO-0 cplm_dist.reshape loads it without DeepSpeed)."""
        return (tag is not None and self.cfg.train.zero_stage > 0
                and bool(layout_change(source_root, tag, self.cfg, self.dims.tp_size, self.dims.dp_size)))

    def newest_intact(self, source_root: Path, tag: str) -> tuple[Path, str]:
        """(source_root, `tag` or the newest older complete checkpoint whose files all match their
        manifest (sizes and sha256, hashed by all ranks together)), with a warning for each one skipped."""
        for candidate in reversed([t for t in complete_tags(source_root) if t <= tag]):
            try:
                manifest = read_manifest(source_root / candidate)
            except CheckpointError as e:
                bad = [str(e)]
            else:
                bad = damaged_files(source_root / candidate, manifest, self.dims.rank, self.dims.world_size)
            gathered = [None] * self.dims.world_size
            dist.all_gather_object(gathered, bad)
            bad = sorted({b for part in gathered for b in part})
            if not bad:
                return source_root, candidate
            if self.dims.rank == 0:
                log.warning(f"skipping checkpoint {source_root / candidate}: damaged or missing {bad[:3]} "
                            "(sizes or sha256 differ from its manifest)")
        raise CheckpointError(f"{source_root}: every complete checkpoint up to {tag} has damaged files: "
                              "start a new out_dir (or restore the files)")

    def _prune(self, keep: int, newest: str) -> None:
        for tag in complete_tags(self.root)[:-keep]:
            if tag != newest:
                shutil.rmtree(self.root / tag, ignore_errors=True)
        # tags older than the newest complete one that never completed: a save killed midway
        for p in self.root.glob("step-*"):
            if not (p / COMPLETE).is_file() and p.name < newest:
                shutil.rmtree(p, ignore_errors=True)

    def load(self, engine, source_root: Path, tag: str, reshape: bool = False) -> dict:
        """Weights, optimizer, schedule (DeepSpeed) and our client state from source_root/tag;
        with `reshape`, also from a checkpoint saved at another layout (cplm_dist.reshape)."""
        check_layout(source_root, tag, self.cfg, self.dims.tp_size, self.dims.dp_size, reshape)
        if layout_change(source_root, tag, self.cfg, self.dims.tp_size, self.dims.dp_size):
            client_state = self._load_reshaped(engine, source_root, tag)
        else:
            path, client_state = engine.load_checkpoint(str(source_root), tag=tag, load_optimizer_states=True,
                                                        load_lr_scheduler_states=True)
            if path is None:
                raise CheckpointError(f"DeepSpeed could not load {source_root / tag}: its files are missing or unreadable")
        set_rng_state(client_state["rng"])
        if source_root.resolve() == self.root.resolve():
            self.on_disk = (client_state["step"], self.root / tag)
        return client_state

    def _load_reshaped(self, engine, source_root: Path, tag: str) -> dict:
        """Rank 0 writes the universal form of the checkpoint into out_dir/.reshape-<tag>; every
        rank loads its part (DeepSpeed's universal loader under ZeRO > 0, ours at ZeRO-0); the
        transient copy is removed."""
        from cplm_dist import reshape

        saved = read_manifest(source_root / tag)["layout"]
        tmp = Path(self.cfg.train.out_dir) / f".reshape-{tag}"
        error, start = None, time.perf_counter()
        if self.dims.rank == 0:
            error = _os_error(lambda: reshape.to_universal(source_root / tag, tmp, engine.module, self.cfg, saved), tmp.parent)
        gathered = [None] * self.dims.world_size
        dist.all_gather_object(gathered, error)
        try:
            if gathered[0]:
                raise CheckpointError(f"converting {source_root / tag} (tp={saved['tp']}, dp={saved['dp']}, ZeRO-"
                                      f"{saved['zero_stage']}) for this layout failed: {gathered[0]}")
            # the config's optimizer settings per group (DeepSpeed's ZeRO-3 loader gives every group
            # the first group's, weight decay included); the learning rate is the schedule's
            settings = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")}
                        for g in engine.optimizer.param_groups]
            if self.cfg.train.zero_stage > 0:
                with reshape.trusted_torch_load():
                    path, client_state = engine.load_checkpoint(str(tmp.parent), tag=tmp.name, load_optimizer_states=True,
                                                                load_lr_scheduler_states=True)
                if path is None:
                    raise CheckpointError(f"DeepSpeed could not load the universal form of {source_root / tag}")
            else:
                client_state = reshape.load_zero0(tmp, engine.module, engine.optimizer, engine.lr_scheduler,
                                                  self.dims.tp_rank, self.dims.tp_size)
            for group, kept, lr in zip(engine.optimizer.param_groups, settings, engine.lr_scheduler.get_last_lr()):
                group.update(kept, lr=lr)
            # DeepSpeed's ZeRO-3 loader hands every group one and the same step tensor, which
            # AdamW would then advance once per group and step
            base = getattr(engine.optimizer, "optimizer", engine.optimizer)
            for state in base.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()
        finally:
            dist.barrier()
            if self.dims.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
        log.info(f"reshaped {source_root / tag} from tp={saved['tp']} dp={saved['dp']} ZeRO-{saved['zero_stage']} to "
                 f"tp={self.dims.tp_size} dp={self.dims.dp_size} ZeRO-{self.cfg.train.zero_stage} in "
                 f"{time.perf_counter() - start:.1f}s")
        return client_state


# --- loading for evaluation (no DeepSpeed engine) ------------------------------------------------------


# The tokenizer travels inside each checkpoint (a few hundred KB to a few MB, hashed in the
# manifest like the weights), so evaluation finds it from any directory and after a copy.
CARRIED_TOKENIZER = {"sentencepiece": ("tokenizer.model",),
                     "huggingface": ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")}


def tokenizer_files(cfg: Config) -> dict[str, Path]:
    """{name a copy takes: the file} of the run's tokenizer, those that exist: a SentencePiece
    model, or a Hugging Face tokenizer.json (a file, or in a folder) with the config beside it."""
    source = Path(cfg.data.tokenizer) if cfg.data.tokenizer else None
    names = CARRIED_TOKENIZER.get(cfg.data.tokenizer_backend, ())
    if source is None or not names:
        return {}
    main = source / "tokenizer.json" if cfg.data.tokenizer_backend == "huggingface" and source.is_dir() else source
    files = dict(zip(names, [main] + [main.parent / n for n in names[1:]]))
    return {name: file for name, file in files.items() if file.is_file()}


def carry_tokenizer(cfg: Config, step_dir: Path) -> None:
    """Copy the run's tokenizer into its step directory (rank 0, before the manifest is written)."""
    for name, file in tokenizer_files(cfg).items():
        shutil.copyfile(file, step_dir / name)


def _self_contained(cfg: Config, manifest: dict, step_dir: Path) -> Config:
    """The checkpoint's config with paths that work from here: data.tokenizer is the copy the
    checkpoint carries; relative data paths that do not exist here are taken from the directory
    training ran in (the manifest's `cwd`; for checkpoints older than that, the nearest directory
    above the checkpoint that holds them), when they exist there."""
    bases = ([Path(manifest["cwd"])] if manifest.get("cwd") else []) + list(step_dir.resolve().parents)[1:5]
    carried = CARRIED_TOKENIZER.get(cfg.data.tokenizer_backend, ())
    if carried and (step_dir / carried[0]).is_file():
        cfg.data.tokenizer = str(step_dir / carried[0])  # a Hugging Face tokenizer.json reads its config beside it
    elif cfg.data.tokenizer:
        cfg.data.tokenizer = _found_from(cfg.data.tokenizer, bases, "")
    for entry in cfg.data.blend:
        entry.path = _found_from(entry.path, bases, ".idx")
    return cfg


def _found_from(path: str, bases: list[Path], suffix: str) -> str:
    """`path` if it exists from here (or is absolute), else the first base that holds it."""
    if Path(path).is_absolute() or Path(path + suffix).exists():
        return path
    return next((str(b / path) for b in bases if Path(str(b / path) + suffix).exists()), path)


def load_checkpoint_config(path: str | Path) -> tuple[Config, dict]:
    """The resolved config a checkpoint was trained with (its paths made to work from here,
    `_self_contained`), and its manifest with `root` and `tag`: read from complete.json alone."""
    root, tag = resolve_checkpoint(path)
    manifest = read_manifest(root / tag)
    try:
        cfg = from_dict(manifest["config"])
    except ConfigError as e:
        raise CheckpointError(f"{root / tag / COMPLETE}: its config does not load ({e})") from None
    return _self_contained(cfg, manifest, root / tag), {**manifest, "root": root, "tag": tag}


def deepspeed_safe_globals() -> list:
    """The only non-tensor types a checkpoint may hold beyond plain data (DeepSpeed's optimizer
    states carry these three); anything else is refused when loading."""
    import_deepspeed()
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def safe_load(path, map_location=None):
    """torch.load with weights_only=True and DeepSpeed's allow-list: a crafted file cannot run code
    (evaluation, and DeepSpeed's resume through `use_safe_loading`)."""
    try:
        with torch.serialization.safe_globals(deepspeed_safe_globals()):
            return torch.serialization.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        what = next((line.strip() for line in str(e).splitlines() if "Unsupported global" in line), str(e).splitlines()[0])
        raise CheckpointError(f"{path} holds something a checkpoint of cplm-train never does ({what[:160]}): it was "
                              "not written by cplm-train and is not loaded (it could run code)") from None


def use_safe_loading(engine) -> None:
    """Make DeepSpeed's own checkpoint loading (resume) weights-only with the allow-list."""
    engine.checkpoint_engine.load = safe_load


@contextlib.contextmanager
def weights_only_torch_load(fix=None):
    """DeepSpeed's zero_to_fp32, universal-checkpoint converter and universal loader call
    torch.load(weights_only=False) themselves; while they run, that name loads safely instead,
    each loaded object passed through `fix` when given (cplm_dist.reshape cleans model states)."""
    real = torch.load

    def load(f, map_location=None, **_):
        obj = safe_load(f, map_location)
        return obj if fix is None else fix(obj)

    torch.load = load
    try:
        yield
    finally:
        torch.load = real


def _check_intact(step_dir: Path, manifest: dict, names: list[str] | None) -> None:
    bad = damaged_files(step_dir, manifest, names=names)
    if bad:
        raise CheckpointError(f"{step_dir}: {bad[:3]} missing or damaged (sizes or sha256 differ from its "
                              f"{COMPLETE}): use an earlier step (--checkpoint <run>/checkpoints/step-*)")


def _load_states(file: Path, module: bool = True) -> dict:
    """torch.load of a DeepSpeed model-states file (`module`: one holding the whole module's
    states, not a pipeline layer's); a missing or damaged one is a CheckpointError."""
    try:
        state = safe_load(file, map_location="cpu")
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing although its checkpoint is marked complete: use an earlier step "
                              "(--checkpoint <run>/checkpoints/step-*)") from None
    except Exception as e:  # torch raises RuntimeError, EOFError, UnpicklingError ... on a damaged file
        raise CheckpointError(f"{file} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:100]}): the file is "
                              "damaged; use an earlier step (--checkpoint <run>/checkpoints/step-*)") from None
    if not isinstance(state, dict) or (module and "module" not in state):
        raise CheckpointError(f"{file} is not a DeepSpeed model-states file (no 'module'): point --checkpoint at a run")
    return state


def _pipeline_shards(step_dir: Path, manifest: dict, cfg: Config, saved_tp: int) -> list[dict]:
    """Each saved tp rank's weights under their CPLM names, from a pipeline checkpoint's layer
    files (`layer_XX-model_YY-model_states.pt`, one per pipeline layer and tp rank)."""
    from cplm_dist.model.stages import checkpoint_layer_names

    names = checkpoint_layer_names(cfg)
    files = {(i, r): step_dir / f"layer_{i:02d}-model_{r:02d}-model_states.pt" for i in names for r in range(saved_tp)}
    _check_intact(step_dir, manifest, [f.name for f in files.values()])
    shards = [{} for _ in range(saved_tp)]
    for (i, r), file in files.items():
        shards[r].update({names[i] + k: v for k, v in _load_states(file, module=False).items()})
    return shards


def load_model(path: str | Path, device=None, dtype=torch.float32):
    """(model in eval mode, config, manifest) on this rank, at this launch's tp whatever tp the
    checkpoint was saved at: every saved tp rank's weights are joined into the tp-independent
    tensors (cplm_dist.model.sharding) and this rank's shard is taken. ZeRO-3 checkpoints keep the
    weights only in the optimizer shards, which DeepSpeed's zero_to_fp32 merges (saved at tp = 1).
    A pipeline checkpoint's per-layer files are read under the names a CPLM gives them, so it
    loads as a whole model too (evaluation and generation run without pipeline stages)."""
    from cplm_dist.megatron_compat import parallel_state
    from cplm_dist.model import build_model
    from cplm_dist.model.sharding import full_state_dict, load_full_state_dict

    cfg, info = load_checkpoint_config(path)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp, tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    saved_tp = info["layout"]["tp"]
    try:
        check_tp_divides(cfg.model, tp)
    except ConfigError as e:
        raise CheckpointError(f"{path} (saved at tp={saved_tp}) cannot be loaded with {tp} ranks: {e}") from None
    cfg.parallel.tp = tp
    model = build_model(cfg, device=device, dtype=dtype, activation_checkpointing=False, compile_layers=False,
                        sequence_parallel=False)
    step_dir = info["root"] / info["tag"]
    if info["layout"].get("pp", 1) > 1:
        shards = _pipeline_shards(step_dir, info, cfg, saved_tp)
    else:
        files = [model_states_file(step_dir, r) for r in range(saved_tp)]
        _check_intact(step_dir, info, [f.name for f in files])
        shards = [_load_states(f)["module"] for f in files]
    if any(getattr(v, "numel", lambda: 1)() == 0 for v in shards[0].values()):  # ZeRO-3: weights live in the optimizer shards
        if saved_tp != 1:
            raise CheckpointError(f"{path}: ZeRO-3 checkpoints saved at tp>1 cannot be merged for evaluation yet "
                                  "(DeepSpeed's zero_to_fp32 reads tp rank 0 only); evaluate one saved at tp=1")
        import_deepspeed()
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        _check_intact(step_dir, info, None)
        with weights_only_torch_load():
            shards = [get_fp32_state_dict_from_zero_checkpoint(str(info["root"]), tag=info["tag"])]
    params = dict(model.named_parameters())
    unexpected = [k for k in shards[0] if k not in params and not k.endswith("_extra_state")]
    try:
        if unexpected:
            raise ValueError(f"unexpected {unexpected[:3]}")
        load_full_state_dict(model, full_state_dict(shards, model), tp_rank, tp)
    except ValueError as e:
        raise CheckpointError(f"{path}: weights do not match the model ({e})") from None
    return model.to(dtype).eval(), cfg, info
