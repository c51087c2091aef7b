"""Pipeline stage arithmetic: which layers each stage of parallel.pp holds, what they weigh and
what they are called, from the config alone (no DeepSpeed, no allocation). The stages themselves
(DeepSpeed's PipelineModule) are cplm_dist.training.pipeline; the memory estimator, the
communication model, the planner and checkpoint loading read the split from here.

The layers, in order (`pipeline_layers`):

    0       the embedding (and learned positions)                      first stage
    1..L    transformer layer i
    L+1     the tied embedding again (tie_embeddings): its weight for the head
    L+1/2   the head: final norm, copy head, LM head, mixed loss        last stage

The split (`partition`) is contiguous and balanced by parameters, the embedding counted on the
first stage and the LM head (tied or not, V x D either way, the heaviest part of the step) on the
last.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from cplm_dist.config import Config
from cplm_dist.model.counting import parameter_count, parameters_per_device, per_model, tensor_sizes_per_device
from cplm_dist.model.layer_shapes import layer_kind_list, layer_kinds
from cplm_dist.model.loss import padded_vocab_size


@dataclass(frozen=True)
class PipelineLayer:
    """One entry of the pipeline's layer list (the module docstring's table)."""

    kind: str  # embedding | layer | tied (the embedding's copy on the last stage) | head
    prefix: str  # its parameters' names in CPLM: prefix + the module's own names
    weight: int  # parameters it counts for the stage split (over tp; the LM head's V x D with the head)
    saved: bool  # DeepSpeed writes a layer_XX file for it (not for the tied copy)


@per_model
def pipeline_layers(cfg: Config) -> list[PipelineLayer]:
    """The pipeline's layers in order, in one place: DeepSpeed's specs, the stage split, its
    summary and the checkpoint's layer files all read them."""
    m, D = cfg.model, cfg.model.hidden_size
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, cfg.parallel.tp)
    parts = parameter_count(cfg)
    layers = [PipelineLayer("embedding", "", vocab * D + parts["positions"], True)]
    sizes = {id(kind): sum(s.numel for s in kind) for kind, _ in layer_kinds(m)}  # a sparse layer weighs its experts
    layers += [PipelineLayer("layer", f"layers.{i}.", sizes[id(kind)], True) for i, kind in enumerate(layer_kind_list(m))]
    if m.tie_embeddings:
        layers.append(PipelineLayer("tied", "", 0, False))
    return layers + [PipelineLayer("head", "", vocab * D + parts["final_norm"] + parts["copy_head"], True)]


def layer_parameters(cfg: Config) -> list[int]:
    """The weights `partition` balances: the layers' without the tied copy (it travels with the head)."""
    return [layer.weight for layer in pipeline_layers(cfg) if layer.kind != "tied"]


def partition(weights: list[int], stages: int) -> list[int]:
    """Stage boundaries (stages + 1 indices into the layers; stage s runs [b[s], b[s+1])): each
    stage at least one transformer layer, the first layer (embedding) on stage 0 and the last
    (head) on the last stage, minimising the largest stage's weight (ties: earlier stages lighter)."""
    return list(_partition(tuple(weights), stages))


@functools.lru_cache(maxsize=4096)  # the planner and the estimator ask for the same splits many times
def _partition(weights: tuple[int, ...], stages: int) -> tuple[int, ...]:
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def fits(limit: int) -> list[int] | None:
        bounds, start = [0], 0
        for s in range(stages - 1):
            # the furthest end for this stage under `limit`, leaving one layer for each later stage
            # and never cutting the head (index n-1) off the layers before it
            end = start + 1 + (s == 0)
            while end + 1 <= n - (stages - 1 - s) - 1 and prefix[end + 1] - prefix[start] <= limit:
                end += 1
            if prefix[end] - prefix[start] > limit:
                return None
            bounds.append(end)
            start = end
        return bounds + [n] if prefix[n] - prefix[start] <= limit else None

    lo, hi = max(weights), prefix[n]
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    return tuple(fits(lo))


def stage_bounds(cfg: Config, pp: int) -> list[int]:
    """The pipeline's stage boundaries over `pipeline_layers` (`partition` of `layer_parameters`;
    the tied copy, just before the head, on the head's stage)."""
    bounds = partition(layer_parameters(cfg), pp)
    return bounds[:-1] + [bounds[-1] + 1] if cfg.model.tie_embeddings else bounds


def dualpipev_bounds(cfg: Config, pp: int) -> list[int]:
    """The 2 pp stage boundaries over `pipeline_layers` for DualPipeV, balanced by rank: rank r runs
    stages r and 2 pp - 1 - r, so rank 0 holds the embedding and the head (with the tied copy).
    Each rank takes at least two transformer layers (one a stage); the rest go one by one to the
    rank with the least weight (ties: the later rank), and a rank's layers split between its two
    stages, the outbound one taking the odd layer."""
    layers = pipeline_layers(cfg)
    ends = [layer.weight for layer in layers if layer.kind in ("embedding", "head")]
    each = next(layer.weight for layer in layers if layer.kind == "layer")
    counts = [2] * pp
    load = [sum(ends) + 2 * each] + [2 * each] * (pp - 1)
    for _ in range(cfg.model.num_layers - 2 * pp):
        r = min(range(pp), key=lambda q: (load[q], -q))
        counts[r] += 1
        load[r] += each
    per_stage = [(counts[r] + 1) // 2 for r in range(pp)] + [counts[r] // 2 for r in reversed(range(pp))]
    bounds = [0]
    for n in per_stage:
        bounds.append(bounds[-1] + n + (len(bounds) == 1))  # stage 0 also holds the embedding
    bounds[-1] = len(layers)  # the last stage: its layers, the tied copy and the head
    return bounds


def schedule_bounds(cfg: Config, pp: int) -> list[int]:
    """The stage boundaries CPLMPipe builds at pp ranks: pp stages under 1F1B (`stage_bounds`),
    2 pp under DualPipeV (`dualpipev_bounds`)."""
    return dualpipev_bounds(cfg, pp) if pp > 1 and cfg.parallel.pp_schedule == "dualpipev" else stage_bounds(cfg, pp)


def stage_transformer_layers(cfg: Config, pp: int) -> list[int]:
    """How many transformer layers each stage runs (DualPipeV: each of its 2 pp stages)."""
    bounds, layers = schedule_bounds(cfg, pp), pipeline_layers(cfg)
    return [sum(layer.kind == "layer" for layer in layers[bounds[s]:bounds[s + 1]]) for s in range(len(bounds) - 1)]


def stage_summary(cfg: Config, pp: int) -> str:
    """One line: each stage's layers and parameters (over tp), as `partition` balanced them
    (DualPipeV: 2 pp stages, each named with the pipeline rank that runs it)."""
    stages = pp * stages_per_rank(cfg)
    weights, bounds = [layer.weight for layer in pipeline_layers(cfg)], schedule_bounds(cfg, pp)
    rank = (lambda s: f" (rank {min(s, stages - 1 - s)})") if stages > pp else (lambda s: "")
    return "; ".join(f"stage {s}{rank(s)}: layers [{bounds[s]}, {bounds[s + 1]}) "
                     f"{sum(weights[bounds[s]:bounds[s + 1]]) / 1e6:.1f}M" for s in range(stages))


def checkpoint_layer_names(cfg: Config) -> dict[int, str]:
    """{pipeline layer index: its CPLM name prefix} of the layers DeepSpeed saves as
    layer_XX-model_YY-model_states.pt."""
    return {i: layer.prefix for i, layer in enumerate(pipeline_layers(cfg)) if layer.saved}


@dataclass(frozen=True)
class Stage:
    """One pipeline stage's share of the model (pp = 1: the whole model, one stage)."""
    index: int
    stages: int
    layers: int  # transformer layers
    first: bool  # holds the embedding; its input is the ids
    last: bool  # holds the final norm, the LM head (or the tied embedding copy) and the copy head
    chunks: int = 1  # pipeline stages this rank runs: 2 under DualPipeV (stage `index` and 2 pp - 1 - index)


def _at_tp(cfg: Config, tp: int | None) -> Config:
    """`cfg` with parallel.tp = tp: the stage split pads the vocabulary for the tp it runs at."""
    return cfg if tp is None or tp == cfg.parallel.tp else replace(cfg, parallel=replace(cfg.parallel, tp=tp))


def pipeline_stages(cfg: Config, pp: int, tp: int | None = None) -> list[Stage]:
    """The stages CPLMPipe builds (`stage_transformer_layers`: `partition` of `layer_parameters`,
    the tied copy with the head), the vocabulary padded for `tp`."""
    L = cfg.model.num_layers
    if pp == 1:
        return [Stage(0, 1, L, True, True)]
    dual = cfg.parallel.pp_schedule == "dualpipev"  # a rank: stages r and 2 pp - 1 - r of 2 pp
    if pp * (1 + dual) > L:
        raise ValueError(f"pp={pp} exceeds model.num_layers={L}{' / 2 (DualPipeV)' if dual else ''}: every stage "
                         "needs a transformer layer")
    if dual:
        layers = stage_transformer_layers(_at_tp(cfg, tp), pp)
        return [Stage(r, pp, layers[r] + layers[2 * pp - 1 - r], r == 0, r == 0, chunks=2) for r in range(pp)]
    layers = stage_transformer_layers(_at_tp(cfg, tp), pp)
    return [Stage(s, pp, n, s == 0, s == pp - 1) for s, n in enumerate(layers)]


def stage_layer_indices(cfg: Config, stage: Stage, tp: int | None = None) -> list[int]:
    """The transformer layers (0-based) one rank of `stage` runs, as CPLMPipe splits them
    (`stage_transformer_layers`; DualPipeV: its stages r and 2 pp - 1 - r): what tells a sparse
    model's stages apart (model.moe.sparse_layers), e.g. DeepSeek-V3's dense first layers."""
    if stage.stages == 1:
        return list(range(cfg.model.num_layers))
    counts = stage_transformer_layers(_at_tp(cfg, tp), stage.stages)
    starts = [sum(counts[:s]) for s in range(len(counts))]
    held = [stage.index] + ([len(counts) - 1 - stage.index] if stage.chunks == 2 else [])
    return [i for s in held for i in range(starts[s], starts[s] + counts[s])]


def stage_tensor_sizes(cfg: Config, tp: int, pp: int = 1, stage: int = 0) -> list[int]:
    """counting.tensor_sizes_per_device of one rank of pipeline `stage` (the whole model at pp = 1)."""
    if pp == 1:
        return tensor_sizes_per_device(cfg, tp)
    s = pipeline_stages(cfg, pp, tp)[stage]
    return tensor_sizes_per_device(_at_tp(cfg, tp), tp, layers=s.layers, first=s.first, last=s.last)


def stage_parameters(cfg: Config, stage: Stage, tp: int) -> float:
    """Parameters one rank of `stage` holds (before ZeRO-3 sharding), padded vocabulary included:
    counting's of the stage (the tied embedding on the first and last)."""
    if stage.stages == 1:
        return parameters_per_device(cfg, tp)
    return sum(stage_tensor_sizes(cfg, tp, stage.stages, stage.index))


def stages_per_rank(cfg: Config) -> int:
    """Pipeline stages a pipeline rank runs: two under DualPipeV (stage r and 2 pp - 1 - r), else one."""
    return 2 if cfg.parallel.pp > 1 and cfg.parallel.pp_schedule == "dualpipev" else 1


def loss_stage(cfg: Config) -> int:
    """The pipeline rank that holds the head and computes the loss: the last under 1F1B, the first
    under DualPipeV (its micro-batches come back to rank 0)."""
    return 0 if stages_per_rank(cfg) == 2 else cfg.parallel.pp - 1
