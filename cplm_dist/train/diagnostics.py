"""The bottleneck, live: every train.diagnostics_interval steps, the copy head's gradient path and
the mixture's statistics (cplm_dist.model.gradient_paths) on the step's last micro-batch, through
the model as its update left it; a "diagnostics" record in metrics.jsonl, TensorBoard and W&B.

It runs the model once more (a forward and a backward to the hidden states, by
torch.autograd.grad: no parameter's .grad is touched and no random number drawn), so training's
losses are the same with it on or off. It needs the whole model on the rank's tp group:
parallel.pp = 1, parallel.cp = 1 and ZeRO stage <= 2 (refused at start-up otherwise:
cplm_dist.config.validation).
"""

from __future__ import annotations

from cplm_dist.data.loader import model_inputs
from cplm_dist.model.gradient_paths import gradient_paths


def diagnose(engine, batch: dict, device) -> dict:
    """The figures of `batch` (a micro-batch as the loader gives it) through the engine's model."""
    inputs = model_inputs(batch, device)  # ids, labels (, position_ids under document masking)
    figures = gradient_paths(engine.module, *inputs)
    del figures["grad_norm_logits"]  # the bottleneck tool's figure (tools/grad_bottleneck.py), not the live record's
    return figures


def due(interval: int, step: int) -> bool:
    return interval > 0 and step % interval == 0
