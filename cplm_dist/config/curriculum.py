"""Staged data mixtures (SmolLM2's recipe: the decay on the best data): `data.stages` lists
{from_step, blend}; a stage begins after `from_step` optimizer steps, so the first step it trains is
from_step + 1; the first stage has from_step 0. `data.blend` is the one-stage form.

    plan = stages_of(cfg)                  # [DataStage], data.blend as one stage at 0
    stage_for_step(plan, step)             # the stage optimizer step `step` (1-based) reads
    names = source_names(cfg)              # every blend entry of every stage, by path (a glob's parts: by the glob)
    ids = source_ids(cfg, stage)           # stage-local dataset_id -> source id

Each stage has its own megatron dataset (seed data.seed + its index, as many samples as its steps
need) and its own position, so a resume continues inside the stage where it stopped, also when the
global batch changed (cplm_dist.data.staged_loader). Validation reads the last stage's blend: the
mixture the run ends on. A resume may change stages that have not begun; a begun one
(from_step < the checkpoint's step) must stay as it was (`check_begun_stages`).
"""

from __future__ import annotations

from pathlib import Path

from cplm_dist.config.tree import BlendEntry, Config, DataStage
from cplm_dist.errors import CheckpointError


def stages_of(cfg: Config) -> list[DataStage]:
    """The run's stages: data.stages, or data.blend as a single stage from step 0."""
    d = cfg.data
    return list(d.stages) if d.stages else [DataStage(0, list(d.blend))]


def all_entries(cfg: Config) -> list[BlendEntry]:
    """Every blend entry of every stage (a path may appear in several)."""
    return [entry for stage in stages_of(cfg) for entry in stage.blend]


def stage_for_step(stages: list[DataStage], step: int) -> int:
    """The index of the stage optimizer step `step` (1-based) belongs to: the last with from_step < step."""
    index = 0
    for i, stage in enumerate(stages):
        if stage.from_step < step:
            index = i
    return index


def stage_steps(stages: list[DataStage], train_steps: int) -> list[int]:
    """How many optimizer steps each stage trains in a run of `train_steps`."""
    bounds = [s.from_step for s in stages] + [train_steps]
    return [max(0, min(b, train_steps) - min(a, train_steps)) for a, b in zip(bounds, bounds[1:])]


def source_of(entry: BlendEntry) -> str:
    """The source an entry's metrics count under: the config's entry (a glob's parts share their glob)."""
    return entry.source or entry.path


def source_paths(cfg: Config) -> list[str]:
    """The distinct sources over all stages (a dataset path, or the glob parts were expanded from:
    cplm_dist.data.blend), in order of first appearance: source i is path i."""
    return list(dict.fromkeys(source_of(e) for e in all_entries(cfg)))


def source_names(cfg: Config) -> list[str]:
    """A short name per source (the path's last part; a repeated one gets its source id appended)."""
    paths = source_paths(cfg)
    names = [Path(p).name or p for p in paths]
    return [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]


def source_ids(cfg: Config, stage: int) -> list[int]:
    """stage-local dataset_id (the entry's index in that stage's blend) -> the run's source id."""
    index = {p: i for i, p in enumerate(source_paths(cfg))}
    return [index[source_of(e)] for e in stages_of(cfg)[stage].blend]


def _plan(data: dict) -> list[tuple[int, list[tuple[str, float]]]]:
    """A saved config's data section as [(from_step, [(path, weight)])], the one-stage form included."""
    stages = data.get("stages") or [{"from_step": 0, "blend": data.get("blend") or []}]
    return [(int(s["from_step"]), [(e["path"], float(e.get("weight", 1.0))) for e in s["blend"]]) for s in stages]


def uses_stages(data: dict) -> bool:
    return bool(data.get("stages"))


def check_begun_stages(step_dir, saved_data: dict, data: dict, step: int) -> None:
    """A resume at `step` keeps every stage that has begun (from_step < step) as it was, and begins
    no new one before `step`; later stages may change. Paths are compared by name as given."""
    saved = [s for s in _plan(saved_data) if s[0] < step]
    here = [s for s in _plan(data) if s[0] < step]
    if saved == here:
        return
    diff = next(i for i in range(max(len(saved), len(here))) if i >= len(saved) or i >= len(here) or saved[i] != here[i])
    was = saved[diff] if diff < len(saved) else "no such stage"
    now = here[diff] if diff < len(here) else "no such stage"
    raise CheckpointError(f"checkpoint {step_dir} (step {step}) trained stage {diff} of its data mixture as {was!r}, "
                          f"the config gives {now!r}: a resume may change only stages that begin after step {step}; "
                          "restore the begun stages, or start a new out_dir")
