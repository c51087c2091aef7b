"""A sparse layer under activation checkpointing counts each training forward once.

A checkpointed layer (train.activation_checkpointing: cplm_dist.model.block, torch's
non-reentrant checkpoint) runs twice a micro-batch, in forward and again in backward, both with
grad enabled. megatron-core's router adds its routed-token counts (`local_tokens_per_expert`, the
expert bias's input; `global_tokens_per_expert` and `ga_steps`, the global auxiliary loss's
running average) whenever grad is enabled, so the recomputation would count the micro-batch
twice, and recompute the global auxiliary loss from counts that already hold it (a gradient
other than the one its forward saved). Our own figures (SparseMLP.load, the auxiliary-loss
tracker) would double the same way. megatron's own recompute never meets this: its first run is
under no_grad.

So the recomputation replays: the checkpointed forward (`checkpoint_contexts()[0]`) keeps each
router's counters as they were before it ran, in order; the recomputation (`[1]`) runs the router
on that state and then puts back the state it found, so it leaves no trace and computes what the
forward computed. Order: the backward of micro-batches runs in their forward order (1F1B too),
one queue per layer; the queues are emptied once a step (`SparseMLP.reset_replay`).

    torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=checkpoint_contexts)
"""

from __future__ import annotations

import contextlib

_STATE = {"checkpointed": False, "recomputing": False}


@contextlib.contextmanager
def _flag(name: str):
    before = _STATE[name]
    _STATE[name] = True
    try:
        yield
    finally:
        _STATE[name] = before


def checkpoint_contexts():
    """torch.utils.checkpoint's context_fn: (the checkpointed forward's context, the recomputation's)."""
    return _flag("checkpointed"), _flag("recomputing")


def recomputing() -> bool:
    """Inside a checkpointed layer's recomputation (backward): nothing may be counted."""
    return _STATE["recomputing"]


def checkpointed() -> bool:
    """Inside a checkpointed layer's first run (forward)."""
    return _STATE["checkpointed"]
