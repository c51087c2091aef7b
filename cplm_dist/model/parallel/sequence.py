"""Sequence parallelism's pieces that megatron-core's linears do not hold (docs/parallelism.md).

Between the tensor-parallel regions (norms, residuals, the copy head's queries) a rank holds
T/tp positions in Megatron's sequence-first layout (T/tp, B, D); megatron's sequence-parallel
linears all-gather the sequence into a region and reduce-scatter it out. What is left here:

  - `sum_grad_over`: a replicated weight applied to this rank's positions only gets a partial
    gradient; megatron's copy-to-tensor-parallel region (identity forward, all-reduce backward)
    sums it inside the autograd graph, so DeepSpeed receives the whole gradient at every ZeRO
    stage (Megatron instead all-reduces such gradients after backward, in its own DDP);
  - `ReplicatedLinear`: a torch Linear whose weights go through `sum_grad_over` (its own forward
    runs, so ZeRO-3 gathers its parameters as for any module);
  - `gather_sequence`: (T/tp, ...) -> (T, ...) for what is not a linear's input (the copy head's
    keys and per-token terms, the chunked loss's hidden states).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cplm_dist.megatron_compat import tensor_parallel


def active(group) -> bool:
    return group is not None and group.size() > 1


def sum_grad_over(weight: torch.Tensor, group) -> torch.Tensor:
    """`weight` as is; in backward its gradient summed over `group` (None or one rank: untouched)."""
    if not active(group):
        return weight
    return tensor_parallel.copy_to_tensor_model_parallel_region(weight, group=group)


def gather_sequence(x: torch.Tensor, group, sum_grad: bool) -> torch.Tensor:
    """(T/tp, ...) -> (T, ...) over `group`. Backward: reduce-scatter the gradient (sum_grad, when
    each rank's is a partial sum) or keep this rank's rows of it (when it is replicated)."""
    return tensor_parallel.gather_from_sequence_parallel_region(x.contiguous(), tensor_parallel_output_grad=sum_grad,
                                                                group=group)


class ReplicatedLinear(torch.nn.Linear):
    """nn.Linear (same parameters and state-dict keys) replicated on every tp rank; with
    `grad_group` its gradients are summed over that group (sequence parallelism)."""

    def __init__(self, *args, grad_group=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.grad_group = grad_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else sum_grad_over(self.bias, self.grad_group)
        return F.linear(x, sum_grad_over(self.weight, self.grad_group), bias)
