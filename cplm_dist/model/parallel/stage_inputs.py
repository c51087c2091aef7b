"""What the parts of a pipeline stage read of a micro-batch besides its activations, worked out
once a micro-batch for every part on this rank (cplm_dist.training.pipeline).

    micro = inputs(ids, position_ids)      # the same MicroBatch for every layer of this stage
    micro.positions                        # what RoPE and learned positions read (None: 0 .. T - 1)
    micro.masks(kernel)                    # the core attention's masks (built once a kernel)
    micro.context                          # context parallel: the whole sequence's ids, positions, documents

A stage's layers each receive the micro-batch's ids and position_ids (the same tensors, passed on
from part to part), and would otherwise each build the same masks (on CUDA: create_block_mask over
T x T) and, under context parallelism, gather the same ids and positions over cp. What the cp ranks
gather they gather in the same order: each runs the same schedule over the same parts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cplm_dist.model.documents import document_index
from cplm_dist.model.parallel.context import ContextInputs, ContextShard, context_inputs


@dataclass
class MicroBatch:
    """One micro-batch's positions, document indices and (context parallel) whole-sequence inputs."""

    rows: int  # this rank's positions of each row (T, or T / cp)
    device: torch.device
    positions: torch.Tensor | None  # (B, rows) RoPE / learned positions; None: 0 .. rows - 1
    docs: torch.Tensor | None  # (B, T) document index of every key under document masking, else None
    context: ContextInputs | None = None
    _masks: dict = field(default_factory=dict)

    def masks(self, kernel):
        """`kernel.masks` of this micro-batch (cplm_dist.model.core_attention), built once a kernel."""
        if id(kernel) not in self._masks:
            self._masks[id(kernel)] = (kernel, kernel.masks(self.docs, 0, self.rows, self.device))
        return self._masks[id(kernel)][1]


class StageInputs:
    """The MicroBatch of the last ids and position_ids seen, made anew for another micro-batch;
    `shard`: this rank's place in its cp group (None: cp = 1)."""

    def __init__(self, shard: ContextShard | None = None):
        self.shard = shard
        self.seen, self.micro = None, None

    def __call__(self, ids: torch.Tensor, position_ids: torch.Tensor | None) -> MicroBatch:
        key = (ids, position_ids, ids._version, None if position_ids is None else position_ids._version)
        seen = self.seen
        if seen is None or key[0] is not seen[0] or key[1] is not seen[1] or key[2:] != seen[2:]:
            self.seen, self.micro = key, self._micro_batch(ids, position_ids)
        return self.micro

    def _micro_batch(self, ids: torch.Tensor, position_ids: torch.Tensor | None) -> MicroBatch:
        if self.shard is None:
            docs = None if position_ids is None else document_index(position_ids)
            return MicroBatch(ids.shape[1], ids.device, position_ids, docs)
        context = context_inputs(self.shard, ids, position_ids)  # gathers the ids (and positions) over cp
        return MicroBatch(ids.shape[1], ids.device, context.positions, context.docs, context)
