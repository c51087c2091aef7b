"""The validation loss a run logs every train.eval_interval steps: the mean per-token loss over
the first train.eval_batches micro-batches of each dp rank's share of the validation split.

    loss = evaluate(engine, datasets.valid, cfg, dims, device)

At parallel.pp > 1 DeepSpeed's pipeline engine runs the micro-batches (`eval_batch`) and the last
stage sums them (cplm_dist.model.parallel.pipeline); the figure reaches every stage.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cplm_dist.config import Config
from cplm_dist.data.loader import ResumableLoader, model_inputs
from cplm_dist.distributed import ParallelDims
from cplm_dist.model.loss import IGNORE_INDEX
from cplm_dist.model.parallel.context import context_of


@torch.no_grad()
def evaluate(engine, dataset, cfg: Config, dims: ParallelDims, device) -> float:
    """Mean per-token loss over the first eval_batches micro-batches of the validation split."""
    loader = ResumableLoader(dataset, cfg.train.micro_batch_size, dims.dp_rank, dims.dp_size, context=context_of(dims))
    if dims.pp_size > 1:
        return evaluate_pipeline(engine, loader, cfg, dims, device)
    engine.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for _, batch in zip(range(cfg.train.eval_batches), loader):
        out = engine(*model_inputs(batch, device))
        total += torch.stack([out.nll.double().sum(), (batch["labels"] != IGNORE_INDEX).sum().to(device).double()])
    dist.all_reduce(total, group=dims.grad_group)  # context parallel: each cp rank's tokens are its own
    engine.train()
    return float(total[0] / total[1])


@torch.no_grad()
def evaluate_pipeline(engine, loader: ResumableLoader, cfg: Config, dims: ParallelDims, device) -> float:
    """`evaluate` through the pipeline: the last stage sums nll and tokens over its micro-batches
    (cplm_dist.model.parallel.pipeline), the sums are added over dp, and the ratio goes to every stage."""
    batches = ((model_inputs(b), b["labels"]) for b in loader)
    engine.module.eval_sums.zero_()
    engine.eval_batch(batches if engine.is_first_stage() or engine.is_last_stage() else None,
                      num_micro_batches=cfg.train.eval_batches, bcast_loss=False)
    sums = engine.module.eval_sums
    dist.all_reduce(sums, group=dims.dp_group)
    dist.broadcast(sums, src=dist.get_global_rank(dims.pp_group, dims.pp_size - 1), group=dims.pp_group)
    return float(sums[0] / sums[1])
