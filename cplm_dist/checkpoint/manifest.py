"""The checkpoint format: where checkpoints live, what a complete one's manifest says, which
layouts can read it, and what a resume may change.

    <out_dir>/checkpoints/step-00000100/   DeepSpeed's files from every rank, the tokenizer, complete.json
    <out_dir>/checkpoints/latest           the tag of the newest complete checkpoint

complete.json, format 2 (`Manifest`), is what a reader needs without unpickling anything:

    format            2
    step, time        the step it holds, when it was written
    layout            {tp, pp, dp, zero_stage[, cp][, ep]}  (cp: context parallelism, ep: expert
                      parallelism; absent = 1)
    cwd               the directory training ran in (relative data paths resolve from it)
    consumed_samples  the loader position (all ranks' samples), and consumed_tokens
    config            the resolved config
    versions          of cplm_dist, torch, deepspeed, megatron-core
    files             {name: {bytes, sha256}} of every file the save wrote (the tokenizer's too; a
                      sparse model's expert files at ep > 1: cplm_dist.checkpoint.expert_files)
    tokenizer_files   the names of the tokenizer files it carries
    data_fingerprints {data.blend path: content fingerprint} of the datasets it trained on (optional:
                      absent in checkpoints saved before it, read as None); a resume compares them

Format 1 (cplm_dist before format 2) had no tokenizer_files, and its older variants no layout.pp
and no cwd: `upgrade` makes it format 2 as it is read, the one place that knows format 1.

Anywhere a user names a checkpoint, a run directory, its checkpoints/ directory or one step-*
directory will do (`resolve_checkpoint`). A resume reads its manifest once (`find_resume`) and
hands the `Manifest` on.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from cplm_dist.config import RESUMABLE_CHANGES, Config, Layout, check_tp_divides, to_dict
from cplm_dist.config.curriculum import all_entries, check_begun_stages, uses_stages
from cplm_dist.data.indexed_data import content_fingerprint
from cplm_dist.distributed.launch_env import LaunchEnv
from cplm_dist.errors import CheckpointError, ConfigError, DataError, UsageError
from cplm_dist.files import sha256_file, write_text_atomic

LATEST = "latest"
COMPLETE = "complete.json"
FORMAT = 2  # complete.json's layout; bumped when it changes, with an `upgrade` from the one before

log = logging.getLogger(__name__)

# The tokenizer travels inside each checkpoint (a few hundred KB to a few MB, hashed in the
# manifest like the weights), so evaluation finds it from any directory and after a copy.
CARRIED_TOKENIZER = {"sentencepiece": ("tokenizer.model",),
                     "huggingface": ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")}


class ReshapeError(CheckpointError):
    """A checkpoint that cannot continue at the asked layout."""


# --- names and resolution -------------------------------------------------------------------------


def tag_for(step: int) -> str:
    return f"step-{step:08d}"


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


def final_checkpoint(run: Path, steps: int) -> Path | None:
    """The step directory of the latest complete checkpoint of `run` (a run directory or its
    checkpoints/) when it holds step `steps` or later, else None."""
    root = run / "checkpoints" if (run / "checkpoints").is_dir() else run
    tag = latest_tag(root) if root.is_dir() else None
    return root / tag if tag is not None and read_manifest(root / tag).step >= steps else None


# --- the tokenizer a checkpoint carries -------------------------------------------------------------


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


# --- the manifest -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """complete.json of the checkpoint in `step_dir` (format 2; the module docstring)."""

    step_dir: Path
    step: int
    layout: Layout
    config: dict
    files: dict
    tokenizer_files: tuple[str, ...] = ()
    cwd: str | None = None
    consumed_samples: int | None = None
    consumed_tokens: int | None = None
    time: float | None = None
    versions: dict = field(default_factory=dict)
    data_fingerprints: dict | None = None  # optional in format 2: None where a checkpoint was saved without them

    @property
    def root(self) -> Path:
        return self.step_dir.parent

    @property
    def tag(self) -> str:
        return self.step_dir.name

    def to_json(self) -> dict:
        return {"format": FORMAT, "step": self.step, "time": self.time, "layout": self.layout.as_json(), "cwd": self.cwd,
                "consumed_samples": self.consumed_samples, "consumed_tokens": self.consumed_tokens, "config": self.config,
                "versions": self.versions, "files": self.files, "tokenizer_files": list(self.tokenizer_files),
                **({} if self.data_fingerprints is None else {"data_fingerprints": self.data_fingerprints})}

    def info(self) -> dict:
        """The manifest as plain data with its `root` and `tag` (what load_model hands evaluation)."""
        return {**self.to_json(), "root": self.root, "tag": self.tag}

    def layout_change(self, cfg: Config, tp: int, dp: int) -> dict:
        """{field: (saved, now)} of the layout fields that differ in a way the saved files cannot
        be read in place (ZeRO shards by dp x cp, so dp counts only under ZeRO > 0; cp always, as
        the checkpoint records which ranks held which part of each sequence; pp_schedule always,
        as the optimizer's files record which stages each pipeline rank held; ep always, as each
        ep rank's optimizer partitions hold its own experts; a sparse model's expert_tp, as its
        partitions hold each expert's expert-tp shard)."""
        saved, here = self.layout, Layout.of(cfg, tp, dp)
        must_match = ["tp", "pp", "pp_schedule", "cp", "ep", "zero_stage"] + (["dp"] if here.zero_stage > 0 or saved.zero_stage > 0 else [])
        diff = {k: (getattr(saved, k), getattr(here, k)) for k in must_match if getattr(saved, k) != getattr(here, k)}
        # a sparse model's experts split over expert_tp (null: tp): another split is another layout too
        etp = (saved_expert_tp(self), cfg.parallel.expert_tp or tp)
        if cfg.model.moe.num_experts and etp[0] != etp[1]:
            diff["expert_tp"] = etp
        return diff


def saved_expert_tp(manifest: Manifest) -> int:
    """The experts' tensor-parallel size a checkpoint was saved at (its config's parallel.expert_tp;
    null: its tp)."""
    return int((manifest.config.get("parallel") or {}).get("expert_tp") or manifest.layout.tp)


def upgrade(data: dict) -> dict:
    """A format-1 manifest as format 2: layout.pp 1 where it has none (saved before pipeline
    stages), cwd null where it has none (before it was recorded: relative data paths are then
    looked for above the checkpoint), and tokenizer_files the carried tokenizer files it lists
    (none before the tokenizer travelled with the checkpoint)."""
    backend = (data.get("config", {}).get("data") or {}).get("tokenizer_backend", "sentencepiece")
    carried = [n for n in CARRIED_TOKENIZER.get(backend, ()) if n in data["files"]]
    return {**data, "format": FORMAT, "layout": {"pp": 1, **data["layout"]}, "cwd": data.get("cwd"),
            "tokenizer_files": carried}


def _typed(data: dict, fmt: int, step_dir: Path, path: Path) -> Manifest:
    """The Manifest of complete.json's `data` (format `fmt`, upgraded where it is 1)."""
    try:
        data = upgrade(data) if fmt == 1 else data
        lay = data["layout"]
        layout = Layout(**{k: int(lay[k]) for k in ("tp", "pp", "dp", "zero_stage")}, cp=int(lay.get("cp", 1)),
                        pp_schedule=str(lay.get("pp_schedule", "1f1b")), ep=int(lay.get("ep", 1)))
        if not isinstance(data["config"], dict) or not isinstance(data["files"], dict):
            raise TypeError("config and files must be mappings")
        fingerprints = data.get("data_fingerprints")
        if fingerprints is not None and (not isinstance(fingerprints, dict)
                                         or not all(isinstance(v, str) for v in fingerprints.values())):
            raise TypeError("data_fingerprints must map dataset paths to fingerprints")
        return Manifest(step_dir=step_dir, step=int(data["step"]), layout=layout, config=data["config"],
                        files=data["files"], tokenizer_files=tuple(data["tokenizer_files"]), cwd=data.get("cwd"),
                        consumed_samples=data.get("consumed_samples"), consumed_tokens=data.get("consumed_tokens"),
                        time=data.get("time"), versions=data.get("versions") or {}, data_fingerprints=fingerprints)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path} is malformed ({type(e).__name__}: {e}): use an earlier step-* directory") from None


def read_manifest(step_dir: Path) -> Manifest:
    """complete.json of a checkpoint, checked to hold what a reader needs (format 1 upgraded)."""
    path = step_dir / COMPLETE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{step_dir} is not a complete checkpoint (no {COMPLETE})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is damaged ({e}): use an earlier step-* directory") from None
    fmt = data.get("format", 1) if isinstance(data, dict) else None
    if isinstance(data, dict) and fmt not in (1, FORMAT):
        raise CheckpointError(f"{path} has checkpoint format {fmt!r}; this cplm_dist reads formats 1 and {FORMAT}: use "
                              f"the cplm_dist version that wrote it ({data.get('versions')})")
    missing = [k for k in ("step", "layout", "config", "files") if not isinstance(data, dict) or k not in data]
    if missing:
        raise CheckpointError(f"{path} lacks {missing}: it was not written by this version of cplm-train; "
                              "use a checkpoint saved by it")
    return _typed(data, fmt, step_dir, path)


def write_manifest(manifest: Manifest) -> None:
    """complete.json, replaced atomically (the last file of a save: its presence marks it complete)."""
    write_text_atomic(manifest.step_dir / COMPLETE, json.dumps(manifest.to_json(), indent=2) + "\n")


def versions() -> dict:
    out = {}
    for name in ("cplm_dist", "torch", "deepspeed", "megatron-core"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def damaged_files(manifest: Manifest, rank: int = 0, world: int = 1, names: list[str] | None = None) -> list[str]:
    """The files of the manifest (or `names` of them) that are missing, of another size or whose
    sha256 differs; with several ranks each hashes its share (every world-th file)."""
    out = []
    for i, name in enumerate(sorted(names if names is not None else manifest.files)):
        entry, path = manifest.files.get(name), manifest.step_dir / name
        if entry is None or not path.is_file() or path.stat().st_size != entry["bytes"]:
            out.append(name)
        elif i % world == rank and sha256_file(path) != entry["sha256"]:
            out.append(name)
    return out


def check_intact(manifest: Manifest, names: list[str] | None = None) -> None:
    """One line when a file of the checkpoint (or `names` of them) is missing or damaged."""
    bad = damaged_files(manifest, names=names)
    if bad:
        raise CheckpointError(f"{manifest.step_dir}: {bad[:3]} missing or damaged (sizes or sha256 differ from its "
                              f"{COMPLETE}): use an earlier step (--checkpoint <run>/checkpoints/step-*)")


# --- what a resume may do ------------------------------------------------------------------------------


def find_resume(cfg: Config, resume: str | None, tp: int, dp: int, reshape: bool = False,
                allow_data_change: bool = False) -> Manifest | None:
    """The manifest of the checkpoint to resume from, or None for a fresh start; refuses to write
    over another run, a layout change unless `reshape`, and data whose contents changed since the
    save unless `allow_data_change` (`check_data_change`). Reads only: nothing is created or changed."""
    out = Path(cfg.train.out_dir)
    if resume is None:
        if (out / "checkpoints").exists() or (out / "logs" / "metrics.jsonl").exists():
            raise UsageError(f"train.out_dir={out} already holds a run: continue it with --resume auto, "
                             "or choose another train.out_dir")
        return None
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
            return None
        if resume == "auto" and not (root / LATEST).exists():  # `latest` is written once a save completes
            log.warning(f"{root}: no save there ever completed (a kill during the first one): starting afresh")
            return None
        raise CheckpointError(f"--resume {resume}: no complete checkpoint in {root}; "
                              "give a run directory, its checkpoints/ directory or one step-* directory, or --resume auto for a new out_dir")
    manifest = newest_readable(root, tag)
    check_layout(manifest, cfg, tp, dp, reshape)
    check_config_change(manifest, cfg)
    check_data_change(manifest, cfg, allow_data_change)
    return manifest


def newest_readable(root: Path, newest: str) -> Manifest:
    """The manifest of `newest`, or of the newest older complete checkpoint that reads (with a warning)."""
    for tag in reversed([t for t in complete_tags(root) if t <= newest]):
        try:
            return read_manifest(root / tag)
        except CheckpointError as e:
            log.warning(f"skipping {root / tag}: {e}")
    raise CheckpointError(f"{root}: no complete checkpoint with a readable {COMPLETE}: start a new out_dir")


def layout_change(root: Path, tag: str, cfg: Config, tp: int, dp: int) -> dict:
    """Manifest.layout_change of the checkpoint root/tag (read here)."""
    return read_manifest(Path(root) / tag).layout_change(cfg, tp, dp)


def check_layout(manifest: Manifest, cfg: Config, tp: int, dp: int, reshape: bool = False) -> None:
    """A checkpoint resumes with the layout it was saved with, or with another one under
    `reshape` where the new layout can hold it (`check_reshape`); not one saved at ep > 1 under
    ZeRO-0 (its optimizer states are ep rank 0's only: cplm_dist.checkpoint.expert_files)."""
    diff = manifest.layout_change(cfg, tp, dp)
    if manifest.layout.ep > 1 and manifest.layout.zero_stage == 0:
        raise CheckpointError(f"checkpoint {manifest.step_dir} was saved at parallel.ep={manifest.layout.ep} with "
                              "train.zero_stage=0, whose optimizer states only dp rank 0 writes (ep rank 0's experts): "
                              "it cannot resume yet; evaluate it, or train sparse models at ep > 1 with ZeRO-1 or 2")
    if not diff:
        return
    what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in diff.items())
    if not reshape:
        raise CheckpointError(f"checkpoint {manifest.step_dir} was saved with another layout ({what}): resume with the "
                              "layout it was saved with, or add --reshape to convert it to this one")
    check_reshape(manifest, cfg, tp)


def check_reshape(manifest: Manifest, cfg: Config, tp: int) -> None:
    """One line when the saved run cannot continue at this layout (before any process starts);
    the conversion itself is cplm_dist.checkpoint.reshape's."""
    saved, path = manifest.layout, manifest.step_dir
    if cfg.model.moe.num_experts and saved.zero_stage == 3 and (saved.ep, saved_expert_tp(manifest)) != (
            cfg.parallel.ep, cfg.parallel.expert_tp or tp):
        raise ReshapeError(f"{path}: --reshape of a sparse model saved at ZeRO-3 to another ep or expert_tp is not "
                           f"supported (its experts' partitions are converted from ZeRO-1/2 only): resume at its layout "
                           f"({saved}), or reshape it to ZeRO-1 at its ep first")
    try:
        check_tp_divides(cfg.model, tp)
    except ConfigError as e:
        raise ReshapeError(f"{path} (saved at tp={saved.tp}) cannot continue at tp={tp}: {e}") from None
    for stage, where in ((saved.zero_stage, "saved"), (cfg.train.zero_stage, "asked")):
        if stage == 0 and cfg.train.precision != "fp32":
            raise ReshapeError(f"{path}: reshaping a {where} ZeRO-0 layout is supported in fp32 only (under bf16 "
                               "DeepSpeed wraps the optimizer at ZeRO-0): reshape with train.zero_stage>=1")


def check_config_change(manifest: Manifest, cfg: Config) -> None:
    """A resumed run may change only RESUMABLE_CHANGES; one line names any other difference."""
    saved, here = _flatten(manifest.config), _flatten(to_dict(cfg))
    data_saved, data_here = manifest.config.get("data", {}), to_dict(cfg)["data"]
    if uses_stages(data_saved) or uses_stages(data_here):  # a staged mixture: begun stages fixed, later ones free
        check_begun_stages(manifest.step_dir, data_saved, data_here, manifest.step)
        for flat in (saved, here):
            flat.pop("data.blend", None)
    given_saved, given_here = _as_given(saved), _as_given(here)
    changed = [k for k in sorted(saved) if k not in RESUMABLE_CHANGES and given_saved[k] != given_here.get(k)]
    # a mapping set where the saved run had null (model.rope_scaling): its keys are new, their parent was None
    parents = [k.rpartition(".")[0] for k in sorted(set(here) - set(saved))]
    changed += [k for k in dict.fromkeys(parents) if k in saved and saved[k] is None and k not in RESUMABLE_CHANGES]
    if changed:
        what = ", ".join(f"{k} {_value(saved, k)!r} -> {_value(here, k)!r}" for k in changed[:4]) + (
            " ..." if len(changed) > 4 else "")
        longer = set(changed) & {"data.seq_length", "model.max_seq_len", "model.rope_theta", "model.rope_scaling",
                                 "model.rope_scaling.type", "model.rope_scaling.factor"}
        raise CheckpointError(f"checkpoint {manifest.step_dir} was trained with another config ({what}): resume with "
                              f"the saved values, or start a new out_dir"
                              + (f" (a context extension is a new run: model.init_from={manifest.step_dir})" if longer else "")
                              + f"; a resume may change only "
                              f"{', '.join(RESUMABLE_CHANGES[:6])}, ... (cplm_dist.checkpoint.RESUMABLE_CHANGES)")


# --- the data a checkpoint was trained on ------------------------------------------------------------------


def data_fingerprints(cfg: Config) -> dict[str, str]:
    """{data.blend path, as the config gives it: its content fingerprint} (cplm_dist.data.indexed_data:
    bounded reads whatever the size) of the datasets that exist; a missing one is check_data's to report.
    The valid and test splits are megatron's split of these same datasets (data.split): nothing else to record."""
    out = {}
    for entry in all_entries(cfg):  # every stage's (cplm_dist.config.curriculum)
        try:
            out[entry.path] = content_fingerprint(entry.path)
        except FileNotFoundError:
            pass
    return out


def check_data_change(manifest: Manifest, cfg: Config, allow: bool = False) -> list[str]:
    """The datasets of data.blend whose contents differ from the fingerprints the manifest recorded
    at save: one line naming the first of them and the fixes, unless `allow` (then a warning, and the
    run records their new fingerprints from its next save on). A dataset added to or removed from
    the blend is a config change (data.blend), refused before this by check_config_change."""
    saved = manifest.data_fingerprints
    if saved is None:
        _warn(f"checkpoint {manifest.step_dir} has no data fingerprints (saved before they were recorded): the data "
              "cannot be checked against it; recording them from now on")
        return []
    now = data_fingerprints(cfg)
    changed = [path for path in now if path in saved and now[path] != saved[path]]
    if changed and not allow:
        others = ", ".join(changed[1:4]) + (" ..." if len(changed) > 4 else "")
        more = f" (and {len(changed) - 1} more: {others})" if len(changed) > 1 else ""
        raise DataError(f"dataset {changed[0]} changed since step {manifest.step} was saved ({manifest.step_dir}): its "
                        f"contents differ from the fingerprint in its {COMPLETE}{more}; restore the data the run was "
                        "trained on, or resume with --allow-data-change to accept it")
    if changed:
        _warn(f"--allow-data-change: resuming {manifest.step_dir} although dataset{'s' if len(changed) > 1 else ''} "
              f"{', '.join(changed)} changed since step {manifest.step} was saved; the next checkpoint records "
              f"{'their' if len(changed) > 1 else 'its'} new fingerprint{'s' if len(changed) > 1 else ''}")
    return changed


def _warn(message: str) -> None:
    """A warning from the first rank only (a resume is checked on every rank, before the process group)."""
    if LaunchEnv.from_environ(mpi_rendezvous=False).rank == 0:
        log.warning(message)


def _value(flat: dict, key: str):
    """A flattened tree's value at `key`: a leaf, or the mapping its dotted children make."""
    if key in flat:
        return flat[key]
    return {k[len(key) + 1:]: v for k, v in flat.items() if k.startswith(key + ".")} or None


def _as_given(flat: dict) -> dict:
    """`flat` with the fields the config fills in from others back to null where they hold the filled-in
    value (model.head_dim = hidden_size / num_heads), so a resume that changes hidden_size is named by
    hidden_size, not by a head_dim nobody set; a head_dim set to another width still counts as itself."""
    out = dict(flat)
    hidden, heads = flat.get("model.hidden_size"), flat.get("model.num_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads == 0 \
            and out.get("model.head_dim") == hidden // heads:
        out["model.head_dim"] = None
    return out


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
