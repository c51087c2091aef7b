"""The validation loss a run logs every train.eval_interval steps: the mean per-token loss over
the first train.eval_batches micro-batches of each dp rank's share of the validation split.

    loss = evaluate(engine, datasets.valid, cfg, dims, device)
    figures = validation_figures(engine, datasets.valid, cfg, dims, device)   # .token_loss, .per_source(names)
    figures = token_loss(model, batches, device, ReduceGroups.of(dims))   # any model and micro-batches

Both sum each micro-batch's nll and trained tokens and reduce them over dp x cp the way the train
step reduces its figures (cplm_dist.training.reduction); evaluation's perplexity
(cplm_dist.evaluation.perplexity) is `token_loss` on one rank's whole split. At parallel.pp > 1
DeepSpeed's pipeline engine runs the micro-batches (`eval_batch`) and the last stage adds them
(cplm_dist.training.pipeline); the figure reaches every stage.
"""

from __future__ import annotations

from typing import Iterable

import torch

from cplm_dist.config import Config
from cplm_dist.config.curriculum import source_ids, source_names, stages_of
from cplm_dist.data.loader import ResumableLoader, label_inputs, model_inputs
from cplm_dist.distributed import ParallelDims
from cplm_dist.model.parallel.context import context_of
from cplm_dist.training.reduction import BatchFigures, BatchSums, ReduceGroups


@torch.no_grad()
def evaluate(engine, dataset, cfg: Config, dims: ParallelDims, device) -> float:
    """Mean per-token loss over the first eval_batches micro-batches of the validation split."""
    return validation_figures(engine, dataset, cfg, dims, device).token_loss


@torch.no_grad()
def validation_figures(engine, dataset, cfg: Config, dims: ParallelDims, device) -> BatchFigures:
    """The first eval_batches micro-batches of the validation split: `.token_loss` is their mean
    per-token loss, `.per_source(source_names(cfg))` each source's."""
    loader = ResumableLoader(dataset, cfg.train.micro_batch_size, dims.dp_rank, dims.dp_size, context=context_of(dims),
                             sources=source_ids(cfg, len(stages_of(cfg)) - 1))
    if dims.pp_size > 1:
        return evaluate_pipeline(engine, loader, cfg, dims, device)
    engine.eval()
    figures = token_loss(engine, (batch for _, batch in zip(range(cfg.train.eval_batches), loader)), device,
                         ReduceGroups.of(dims), len(source_names(cfg)))
    engine.train()
    return figures


@torch.no_grad()
def token_loss(model, batches: Iterable[dict], device, groups: ReduceGroups, sources: int = 0) -> BatchFigures:
    """The micro-batches' summed nll and trained tokens through `model` (a CPLM, or DeepSpeed's
    engine around one), reduced over `groups` (ReduceGroups(): this rank's alone):
    `.token_loss` is their mean per-token loss, `.tokens` the count; with `sources` (how many)
    the batches' "source" rows give the per-source sums too."""
    sums = BatchSums(device, sources)
    for batch in batches:
        inputs = model_inputs(batch, device)  # position_ids too where the run masks documents
        out = model(*inputs)
        sums.add_tokens(out.nll, inputs[1], batch.get("source"), out.lm_nll, out.copy_share)
    return groups.reduce(sums)


@torch.no_grad()
def evaluate_pipeline(engine, loader: ResumableLoader, cfg: Config, dims: ParallelDims, device) -> BatchFigures:
    """`evaluate` through the pipeline: the last stage adds nll and tokens over its micro-batches
    (cplm_dist.training.pipeline), the sums are reduced over dp x cp, and the ratio goes to every stage."""
    batches = ((model_inputs(b), label_inputs(b)) for b in loader)
    module = engine.module
    module.sums.zero_()
    trained = engine.micro_batches  # DeepSpeed 0.19.8's DualPipeV finds a micro-batch's phase-1 buffer
    engine.micro_batches = cfg.train.eval_batches  # by this count, not eval_batch's own
    try:
        engine.eval_batch(batches if engine.is_first_stage() or engine.is_last_stage() else None,
                          num_micro_batches=cfg.train.eval_batches, bcast_loss=False)
    finally:
        engine.micro_batches = trained
    return module.groups.reduce(module.sums)
