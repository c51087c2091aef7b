"""The train loader of a (staged) data mixture: one ResumableLoader per stage of data.stages
(cplm_dist.config.curriculum; data.blend is one stage), each over its own megatron dataset and with its own
position, and the step that says which one reads.

    data, loader = build_train_data(cfg, dims, tokenizer, valid_samples, saved=client_state, step=step)
    loader.at_step(step)          # before each optimizer step: the stage step + 1 belongs to
    batch = next(loader)          # that stage's next micro-batch ("source": the run's source ids)

A stage's dataset holds as many samples as its steps need at the global batch it started with; the
checkpoint records that size and the samples the stage has consumed, so a resume rebuilds the very
same dataset and continues at the very same sample, also when the global batch changed since (a
stage that then needs more samples than it holds is rebuilt larger: one line says so, the order of
its remaining samples changes). Stages that have ended are not rebuilt; stages not yet begun are
built from the config as it is now (they may change on resume).
"""

from __future__ import annotations

from cplm_dist.config import Config
from cplm_dist.config.curriculum import source_ids, stage_for_step, stage_steps, stages_of
from cplm_dist.data.gpt_data import Datasets, build_datasets
from cplm_dist.data.loader import ResumableLoader, worker_count


class StagedLoader:
    """Micro-batches of the current stage; state_dict()/load_state_dict() as ResumableLoader's,
    with every stage's position and dataset size (a state with only consumed_samples is stage 0's)."""

    def __init__(self, cfg: Config, loaders: dict[int, ResumableLoader], consumed: list[int], sizes: list[int], step: int = 0):
        self.stages = stages_of(cfg)
        self.loaders, self.sizes = loaders, sizes
        self._ended = consumed  # consumed samples of the stages without a loader (ended before the resume)
        self.stage = stage_for_step(self.stages, step + 1)

    def at_step(self, step: int) -> None:
        """`step` optimizer steps are done: the next micro-batches are the stage of step + 1's."""
        self.stage = stage_for_step(self.stages, step + 1)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.loaders[self.stage])

    def skip(self, micro_batches: int) -> None:
        self.loaders[self.stage].skip(micro_batches)

    def stage_consumed(self) -> list[int]:
        return [self.loaders[i].consumed_samples if i in self.loaders else self._ended[i] for i in range(len(self.stages))]

    @property
    def consumed_samples(self) -> int:
        return sum(self.stage_consumed())

    def state_dict(self) -> dict:
        """ResumableLoader's state: the samples consumed over all stages."""
        return {"consumed_samples": self.consumed_samples}

    def stages_state(self) -> list[dict]:
        """Each stage's position and dataset size (the checkpoint's "data_stages")."""
        return [{"consumed_samples": c, "size": n} for c, n in zip(self.stage_consumed(), self.sizes)]


def saved_positions(saved: dict | None, stages: int) -> list[dict]:
    """[{consumed_samples, size}] per stage from a checkpoint's client state (its "data_stages";
    without them, as saved before stages existed: stage 0 at the loader's position, size 0: not recorded)."""
    if not saved:
        return [{"consumed_samples": 0, "size": 0} for _ in range(stages)]
    recorded = saved.get("data_stages") or [{"consumed_samples": int(saved["loader"]["consumed_samples"]), "size": 0}]
    recorded = [{"consumed_samples": int(r["consumed_samples"]), "size": int(r.get("size", 0))} for r in recorded]
    return (recorded + [{"consumed_samples": 0, "size": 0}] * stages)[:stages]


def stage_sizes(cfg: Config, positions: list[dict], step: int, info=print) -> list[int]:
    """The train samples each stage's dataset holds: what it recorded where it has begun (enough for
    its remaining steps at today's global batch), else its steps x the global batch."""
    t, stages = cfg.train, stages_of(cfg)
    sizes = [n * t.global_batch_size for n in stage_steps(stages, t.train_steps)]
    bounds = [s.from_step for s in stages] + [t.train_steps]
    for i, position in enumerate(positions):
        if position["size"] == 0 or stages[i].from_step >= step:
            continue
        need = position["consumed_samples"] + max(0, bounds[i + 1] - max(step, bounds[i])) * t.global_batch_size
        sizes[i] = position["size"] if need <= position["size"] else need
        if need > position["size"]:
            info(f"data stage {i} holds {position['size']} samples, its remaining steps need {need} at "
                 f"train.global_batch_size={t.global_batch_size}: rebuilt with {need} (its remaining order changes)")
    return sizes


def build_train_data(cfg: Config, dims, tokenizer, valid_samples: int, saved: dict | None = None, step: int = 0,
                     context=None, pin_memory: bool = False, info=print) -> tuple[Datasets, StagedLoader]:
    """(the last stage's Datasets: its valid split is validation's, StagedLoader over every stage not
    yet ended at `step`) from the client state `saved` of a checkpoint at `step` (None: a fresh run)."""
    stages = stages_of(cfg)
    positions = saved_positions(saved, len(stages))
    sizes = stage_sizes(cfg, positions, step, info)
    current = stage_for_step(stages, step + 1)
    loaders, data = {}, None
    for i in range(current, len(stages)):
        last = i == len(stages) - 1
        if sizes[i] == 0 and not last:
            continue
        built = build_datasets(cfg, (sizes[i], valid_samples if last else 0, 0), tokenizer, stage=i)
        data = built if last else data
        if built.train is None:
            continue
        loaders[i] = ResumableLoader(built.train, cfg.train.micro_batch_size, dims.dp_rank, dims.dp_size,
                                     num_workers=worker_count(cfg.data.num_workers), consumed_samples=positions[i]["consumed_samples"],
                                     pin_memory=pin_memory, context=context, sources=source_ids(cfg, i))
    consumed = [p["consumed_samples"] for p in positions]
    return data, StagedLoader(cfg, loaders, consumed, sizes, step)
