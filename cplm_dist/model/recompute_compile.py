"""What is applied to a built model, in one place and in order, the same for the whole CPLM and a
pipeline stage (torchtitan's way: build the model plain, then apply to it):

| step | applied | how |
|---|---|---|
| tensor and sequence parallelism | at build | megatron-core's linears are built sharded for the tp group (cplm_dist.model.parts) |
| activation checkpointing (train.activation_checkpointing) | here | each TransformerLayer keeps only its input and runs again in backward (`recompute`) |
| compile (train.compile) | here | each layer's block compiled on its own (`compiled`), the copy head's pointwise parts |

Nothing here wraps a module, so the parameter names (the state-dict keys) never change: no
`_checkpoint_wrapped_module.` or `_orig_mod.` prefixes.
"""

from __future__ import annotations

import logging

import torch

from cplm_dist.model.block import TransformerLayer
from cplm_dist.model.compiled import unavailable_reason
from cplm_dist.model.copy_head import CopyHead

log = logging.getLogger(__name__)


def recompute_and_compile(model: torch.nn.Module, *, activation_checkpointing: bool, compile: bool,
                          device: torch.device) -> torch.nn.Module:
    """Apply the training options to every transformer layer and copy head in `model` (a CPLM
    or a pipeline stage); returns `model`."""
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        layer.recompute = activation_checkpointing
    if compile:
        reason = unavailable_reason(device)
        if reason:
            log.warning("train.compile=true but %s: training runs the layers eager", reason)
            return model
        for layer in layers:
            layer.compiled = torch.compile(layer.block)
        for head in (m for m in model.modules() if isinstance(m, CopyHead)):
            head.compile_pointwise(device)
    return model
