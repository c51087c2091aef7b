"""A checkpoint's validation perplexity (tools/evaluate.py): the mean per-token loss over a
validation split, summed and reduced as training's validation does (cplm_dist.training.validation_loss
`token_loss`, cplm_dist.training.reduction), with the documents decoded for the needle
task's filler.

    data = build_datasets(cfg, (0, batches * cfg.train.micro_batch_size, 0))
    valid, filler = validation_perplexity(model, data, cfg.train.micro_batch_size)

Every rank of an evaluation launch reads the whole split (its tp ranks hold one model replica;
replicas compute the same figure), so nothing is reduced across ranks.
"""

from __future__ import annotations

import math

from cplm_dist.data.loader import ResumableLoader
from cplm_dist.evaluation.generation import device_of
from cplm_dist.training.reduction import ReduceGroups
from cplm_dist.training.validation_loss import token_loss


def validation_perplexity(model, data, micro_batch_size: int) -> tuple[dict, list[str]]:
    """({loss, perplexity, tokens} of `model` over data.valid (a Datasets of
    cplm_dist.data.gpt_data.build_datasets), the validation documents decoded)."""
    filler = []

    def batches():
        for batch in ResumableLoader(data.valid, micro_batch_size):
            yield batch
            filler.extend(data.tokenizer.decode(row.tolist()) for row in batch["input_ids"])

    figures = token_loss(model, batches(), device_of(model), ReduceGroups())
    loss = figures.token_loss
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": figures.tokens}, filler
