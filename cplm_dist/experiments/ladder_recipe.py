"""A ladder point's training recipe: its learning rate, micro-batch, global batch and job size, from
a rule or from the ladder file's table (tools/scaling.py --ladder-file), so that a 1.7B point built
on a 135M config does not keep the 135M's learning rate, micro-batch and job.

    recipe = Recipe.from_file("ladder.yaml")   # or Recipe() for the default rules
    r = recipe.for_point(base, cfg, target, shape, tokens, job)   # -> PointRecipe

Rules (`rules:` in the ladder file; the defaults first):
- lr: `width` (default): the base config's optim.lr x its model.hidden_size / the point's, the
  hidden-weight rule of muP for Adam (Yang et al. 2022, "Tensor Programs V", Table 3: learning rate
  ~ 1/width): the lr the base config was tuned with, carried along the width (our parametrisation
  is the standard one otherwise, so this is muP's rule, not muP). `deepseek`: the power law fitted
  in DeepSeek LLM (Bi et al. 2024, section 3.1), lr = 0.3118 C^-0.1250 with C the point's
  training FLOPs (theirs count non-embedding FLOPs; ours include the LM head). `base`: the base
  config's at every size. optim.min_lr keeps its ratio to optim.lr.
- batch: `deepseek` (default): the same fit's batch, 0.2920 C^0.3271 tokens a step, in sequences of
  data.seq_length. `base`: the base config's train.global_batch_size.
- micro: `memory` (default): what fits the base config's micro-batch at the point's width and
  depth, activations a sequence growing as layers x hidden: the base micro-batch x (base layers x
  hidden) / (the point's), rounded down to a power of two, at least 1 and at most the base's (the
  micro-batch a smaller point could take is not measured). `base`: the base's.
- job size (Slurm, GPU nodes): the fewest GPUs (tp x cp x pp times a power of two, at most the
  --slurm options' --nodes x --gpus-per-node) that train the point within `hours` at `mfu` of
  `peak_tflops` a GPU (defaults 24 h, 0.35, 989: an H100's dense bf16); nodes = GPUs / GPUs a node,
  rounded up. A CPU job (--gpus-per-node 0) keeps its options.

The global batch is then rounded up to a multiple of micro-batch x data-parallel ranks (the batch
arithmetic every run checks). A `table:` row names a point by its parameter target (`params`,
matched within 10%) and sets any of lr, min_lr, global_batch, micro_batch, nodes, gpus; what it
sets wins over the rules, and what it leaves out follows them. A value given on the command line
for every point (optim.lr=..., train.global_batch_size=..., train.micro_batch_size=...) wins over
both. Example ladder file:

    rules: {lr: width, batch: deepseek, micro: memory, hours: 24, mfu: 0.35, peak_tflops: 989}
    table:
      - {params: 1.7e9, lr: 8.0e-4, global_batch: 512, micro_batch: 4, nodes: 4}
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from cplm_dist.config import Config
from cplm_dist.errors import UsageError

RULES = {"lr": ("width", "deepseek", "base"), "batch": ("deepseek", "base"), "micro": ("memory", "base")}
TABLE_KEYS = {"params", "lr", "min_lr", "global_batch", "micro_batch", "nodes", "gpus"}
DEEPSEEK_LR = (0.3118, -0.1250)  # DeepSeek LLM (2024), section 3.1: lr_opt = 0.3118 C^-0.1250
DEEPSEEK_BATCH = (0.2920, 0.3271)  # B_opt = 0.2920 C^0.3271 tokens


@dataclass(frozen=True)
class Job:
    """The Slurm job size a ladder may use: --nodes (the most), --gpus-per-node and (CPU jobs)
    --tasks-per-node of its options."""

    max_nodes: int = 1
    gpus_per_node: int = 0
    tasks_per_node: int = 1
    slurm: bool = False  # False: the points train here, on the --launcher's ranks


@dataclass(frozen=True)
class PointRecipe:
    lr: float
    min_lr: float
    global_batch: int
    micro_batch: int
    nodes: int
    gpus: int  # the job's GPUs (0: CPU), dp = gpus / (tp x pp)
    source: str  # what set it: "rules: lr width, batch deepseek, micro memory" or "table row params=..."

    def overrides(self) -> list[str]:
        """The point's training overrides."""
        out = {"optim.lr": self.lr, "optim.min_lr": self.min_lr, "train.global_batch_size": self.global_batch,
               "train.micro_batch_size": self.micro_batch}
        # floats as 8.400000e-04: YAML (the override parser) reads 1e-05 as a string
        return [f"{k}={v:.6e}" if isinstance(v, float) else f"{k}={v}" for k, v in out.items()]

    def submit_options(self, job: Job) -> list[str]:
        """submit.sh options that size this point's job (after the ladder's own: the last wins)."""
        if job.gpus_per_node <= 0:
            return []
        per_node = min(self.gpus, job.gpus_per_node)
        return ["--nodes", str(self.nodes), "--gpus-per-node", str(per_node), "--tasks-per-node", str(per_node)]


@dataclass(frozen=True)
class Recipe:
    lr: str = "width"
    batch: str = "deepseek"
    micro: str = "memory"
    hours: float = 24.0
    mfu: float = 0.35
    peak_tflops: float = 989.0
    table: tuple = field(default_factory=tuple)

    @classmethod
    def from_file(cls, path: str | Path | None) -> "Recipe":
        """The ladder file's rules and table (module docstring); None: the default rules."""
        if path is None:
            return cls()
        import yaml

        where = f"--ladder-file {path}"
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise UsageError(f"{where}: cannot be read as YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(data, dict) or set(data) - {"rules", "table"}:
            found = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise UsageError(f"{where}: give a mapping with `rules:` and/or `table:` (found {found})")
        rules, table = data.get("rules") or {}, data.get("table") or []
        names = {f.name for f in fields(cls)} - {"table"}
        if not isinstance(rules, dict) or set(rules) - names:
            raise UsageError(f"{where}: rules takes {sorted(names)}")
        for key, choices in RULES.items():
            if key in rules and rules[key] not in choices:
                raise UsageError(f"{where}: rules.{key}={rules[key]!r}: choose one of {list(choices)}")
        for key in ("hours", "mfu", "peak_tflops"):
            if key in rules and not (isinstance(rules[key], (int, float)) and rules[key] > 0):
                raise UsageError(f"{where}: rules.{key}={rules[key]!r}: give a positive number")
        if not isinstance(table, list) or any(not isinstance(r, dict) or "params" not in r or set(r) - TABLE_KEYS
                                              for r in table):
            raise UsageError(f"{where}: table is a list of rows, each with params and any of {sorted(TABLE_KEYS - {'params'})}")
        return replace(cls(), **rules, table=tuple(table))

    def row(self, target: float) -> dict | None:
        """The table row naming the parameter target `target` (within 10%), if any."""
        rows = [r for r in self.table if abs(math.log(float(r["params"]) / target)) <= math.log(1.1)]
        return min(rows, key=lambda r: abs(math.log(float(r["params"]) / target))) if rows else None

    def for_point(self, base: Config, target: float, layers: int, hidden: int, flops: float, job: Job,
                  world: int = 1, given: frozenset[str] = frozenset()) -> PointRecipe:
        """The recipe of the point of `layers` x `hidden` for `target` parameters trained with
        `flops` FLOPs (the rules' C), in `job` (Slurm) or on `world` local ranks (a `job` without
        GPUs). `given`: the overrides the command line set for every point (their keys), which keep
        the base config's values."""
        row, seq = dict(self.row(target) or {}), base.data.seq_length
        for key, column in (("optim.lr", "lr"), ("optim.min_lr", "min_lr"), ("train.global_batch_size", "global_batch"),
                            ("train.micro_batch_size", "micro_batch")):
            if key in given:
                row[column] = {"lr": base.optim.lr, "min_lr": base.optim.min_lr, "global_batch": base.train.global_batch_size,
                               "micro_batch": base.train.micro_batch_size}[column]
        lr = {"width": base.optim.lr * base.model.hidden_size / hidden, "base": base.optim.lr,
              "deepseek": DEEPSEEK_LR[0] * flops ** DEEPSEEK_LR[1]}[self.lr]
        lr = float(row.get("lr", lr))
        min_lr = float(row.get("min_lr", lr * base.optim.min_lr / base.optim.lr if base.optim.lr else 0.0))
        if self.batch == "deepseek":
            batch = max(1, round(DEEPSEEK_BATCH[0] * flops ** DEEPSEEK_BATCH[1] / seq))
        else:
            batch = base.train.global_batch_size
        micro = base.train.micro_batch_size
        scaled = micro * base.model.num_layers * base.model.hidden_size / (layers * hidden)
        if self.micro == "memory" and scaled < micro:  # a larger point: fewer sequences a forward
            micro = 2 ** math.floor(math.log2(scaled)) if scaled >= 1 else 1
        micro = int(row.get("micro_batch", micro))
        model_parallel = base.parallel.tp * base.parallel.pp * base.parallel.cp
        gpus, nodes = self._job(flops, job, model_parallel, row)
        ranks = gpus or (job.max_nodes * job.tasks_per_node if job.slurm else world)
        dp = max(1, ranks // model_parallel)
        unit = micro * dp
        batch = int(row.get("global_batch", -(-max(batch, unit) // unit) * unit))
        source = f"table row params={float(row['params']):g}, else " if "params" in row else ""
        return PointRecipe(lr, min_lr, batch, micro, nodes, gpus,
                           f"{source}rules: lr {self.lr}, batch {self.batch}, micro {self.micro}")

    def _job(self, flops: float, job: Job, model_parallel: int, row: dict) -> tuple[int, int]:
        """(GPUs, nodes) of the point's job: the table's, else the fewest that fit in `hours`."""
        if job.gpus_per_node <= 0:  # here, or a CPU job: the options' size
            return 0, job.max_nodes
        most = job.max_nodes * job.gpus_per_node
        if "gpus" in row or "nodes" in row:
            gpus = int(row.get("gpus", int(row.get("nodes", 1)) * job.gpus_per_node))
        else:
            seconds_on_one = flops / (self.peak_tflops * 1e12 * self.mfu)
            gpus = model_parallel
            while gpus < most and seconds_on_one / gpus > self.hours * 3600:
                gpus *= 2
            gpus = min(gpus, max(model_parallel, most))
        return gpus, int(row.get("nodes", -(-gpus // job.gpus_per_node)))
