"""Blend entries resolved against the files: a glob of dataset prefixes becomes its parts, a
`weight: tokens` the dataset's token count (from its .idx), before anything else reads the blend.

    resolve_blend(cfg)       # in place, idempotent: cfg.data.blend and every stage's blend
    budget_lines(cfg)        # the start banner's: each entry's tokens and epochs at this run's budget

    data:
      blend:
        - {path: data/parts/web-*, weight: tokens}   # web-00000.idx, web-00001.idx, ...: weighed by their tokens
        - {path: data/code, weight: tokens}

A glob entry stands for the merged dataset of its parts: one megatron blend entry per part
(sorted), the entry's weight split over them by their tokens (`weight: tokens`: each part its
token count), each part carrying `source: <the glob>`, so per-source metrics stay one per entry as
the config gives it (cplm_dist.config.curriculum). A path that exists as a prefix is never read as
a glob; a prefix with no dataset of its own but the parts `tools/preprocess_data.py --partition`
wrote under it (`<prefix>-0000I-of-0000N`) stands for them. The expanded form is what a checkpoint saves and a resume compares (the driver resolves
before it looks for a checkpoint), and what the manifest fingerprints, part by part. A glob
matching no `.idx` is one line (DataError, exit code 2). Megatron samples a blend by its weights
normalised, so weights by tokens sample every dataset in proportion to its size: one epoch of each
at the same time.
"""

from __future__ import annotations

import glob

from cplm_dist.config import BlendEntry, Config
from cplm_dist.config.curriculum import source_names, source_of, source_paths, stage_steps, stages_of
from cplm_dist.data.indexed_data import check_indexed_dataset, dataset_files
from cplm_dist.data.merge import partitions_of
from cplm_dist.errors import DataError

_tokens: dict[tuple[str, int, int], int] = {}  # (prefix, .idx mtime, size) -> tokens: each .idx read once per process


def dataset_tokens(prefix: str) -> int:
    """The tokens of the indexed dataset at `prefix` (checked: a broken one is its one line)."""
    idx = dataset_files(prefix)["idx"]
    key = (prefix, *((idx.stat().st_mtime_ns, idx.stat().st_size) if idx.is_file() else (0, 0)))
    if key not in _tokens:
        _tokens[key] = check_indexed_dataset(prefix).tokens
    return _tokens[key]


def _parts(path: str, name: str) -> list[str] | None:
    """The dataset prefixes a glob `path` matches (sorted), or None where `path` is one dataset."""
    if dataset_files(path)["idx"].exists():
        return None
    if not glob.has_magic(path):  # the parts of a --partition run written under this prefix, if any
        return partitions_of(path) or None
    found = sorted(m[: -len(".idx")] for m in glob.glob(path + ".idx"))
    if not found:
        raise DataError(f"{name}.path={path} matches no dataset (no {path}.idx): fix the pattern (it matches "
                        "dataset prefixes, e.g. data/parts/web-* for web-00000.bin/.idx ...)")
    return found


def _resolved(blend: list[BlendEntry], name: str) -> list[BlendEntry]:
    out = []
    for j, entry in enumerate(blend):
        if entry.source is not None:  # a part already expanded
            out.append(entry)
            continue
        parts = _parts(entry.path, f"{name}[{j}]")
        if parts is None:
            weight = float(dataset_tokens(entry.path)) if entry.weight == "tokens" else entry.weight
            out.append(BlendEntry(entry.path, weight))
            continue
        tokens = [dataset_tokens(p) for p in parts]
        for part, n in zip(parts, tokens):
            weight = float(n) if entry.weight == "tokens" else entry.weight * n / sum(tokens)
            out.append(BlendEntry(part, weight, source=entry.path))
    return out


def resolve_blend(cfg: Config) -> None:
    """Expand globs and `weight: tokens` in data.blend and every stage's blend, in place (module
    docstring); a blend already resolved is left as it is."""
    d = cfg.data
    d.blend = _resolved(d.blend, "data.blend")
    for i, stage in enumerate(d.stages):
        stage.blend = _resolved(stage.blend, f"data.stages[{i}].blend")


def budget_lines(cfg: Config) -> list[str]:
    """Per stage, per source (a glob's parts together): its tokens, its share of the stage's
    tokens (train_steps x global batch x seq_length over the stages) and the epochs that make."""
    stages = stages_of(cfg)
    steps = stage_steps(stages, cfg.train.train_steps)
    per_step = cfg.train.global_batch_size * cfg.data.seq_length
    names = dict(zip(source_paths(cfg), source_names(cfg)))
    lines = []
    for i, (stage, n_steps) in enumerate(zip(stages, steps)):
        weights, tokens = {}, {}
        for e in stage.blend:
            weights[source_of(e)] = weights.get(source_of(e), 0.0) + float(e.weight)
            tokens[source_of(e)] = tokens.get(source_of(e), 0) + dataset_tokens(e.path)
        total, budget = sum(weights.values()), n_steps * per_step
        where = f"stage {i} (steps {stage.from_step + 1}-{stage.from_step + n_steps}), " if len(stages) > 1 else ""
        for source, w in weights.items():
            trained = budget * w / total
            lines.append(f"data: {where}{names[source]}: {tokens[source]:,} tokens{_parts_note(stage, source)}, "
                         f"{w / total:.1%} of {budget:,} -> {trained:,.0f} tokens = {trained / tokens[source]:.2f} epochs")
    return lines


def _parts_note(stage, source: str) -> str:
    n = sum(1 for e in stage.blend if e.source == source)
    return f" in {n} part{'s' * (n > 1)}" if n else ""

