"""Muon under DeepSpeed's ZeRO-1/2: which matrices each rank's flat fp32 partition holds, and
where (the one adapter to DeepSpeed's internals for optim.name=muon; written against 0.19.8).

DeepSpeed's `DeepSpeedZeroOptimizer` flattens each parameter group (`round_robin_bit16_groups[i]`
at `round_robin_bit16_offsets[i]`, padded to an equal partition per rank of
`real_dp_process_group[i]`, dp x cp under context parallelism) and hands the base optimizer one
tensor a group: this rank's fp32 partition, `single_partition_of_fp32_groups[i]`, whose `.grad`
holds the averaged, clipped gradient. Muon's momentum is elementwise, so it lives on that
partition as AdamW's moments do; the orthogonalisation needs the whole matrix, so the direction U
is all-gathered over the partition's group (one collective a group, the size of the parameter
all-gather ZeRO does after the step) and every rank orthogonalises the matrices its partition
touches. Ranks of one tp group hold shards of equal shapes in the same order, hence the same
offsets: they take part in each matrix's tp gather together.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from cplm_dist.training.muon import Matrix

ADAPTED = "0.19."


class FlatPartition:
    """One group's partition [start, start + size) of the flat buffer, and its matrices."""

    def __init__(self, matrices: list[tuple[Matrix, int, tuple[int, ...]]], start: int, size: int,
                 group: dist.ProcessGroup):
        self.matrices, self.start, self.size, self.group = matrices, start, size, group

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        world = dist.get_world_size(self.group)
        if world == 1:
            return local
        pieces = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(pieces, local.contiguous(), group=self.group)
        return torch.cat(pieces)

    def updates(self, direction: torch.Tensor, update_of):
        """(slice of this partition, update for it) for each matrix the partition touches, from
        this rank's part of U and `update_of(matrix, shard of U) -> shard of the update`."""
        full = self.gather(direction)
        end = self.start + self.size
        for matrix, offset, shape in self.matrices:
            numel = math.prod(shape)
            lo, hi = max(offset, self.start), min(offset + numel, end)
            if lo >= hi:
                continue
            update = update_of(matrix, full[offset:offset + numel].view(shape)).reshape(-1)
            yield slice(lo - self.start, hi - self.start), update[lo - offset:hi - offset]


def _layout(wrapper, i: int):
    """(params, their offsets, partition start, partition size, group) of ZeRO group i."""
    group = wrapper.real_dp_process_group[i]
    sizes = [part.numel() for part in wrapper.parallel_partitioned_bit16_groups[i]]
    if len(set(sizes)) != 1:  # DeepSpeed aligns the flat buffer to the group: equal partitions
        raise RuntimeError(f"optim.name=muon: ZeRO partitions of unequal sizes {sizes}: use optim.name=adamw")
    return (wrapper.round_robin_bit16_groups[i], wrapper.round_robin_bit16_offsets[i],
            dist.get_rank(group) * sizes[0], sizes[0], group)


def bind_partitions(wrapper, optimizer) -> None:
    """After deepspeed.initialize: tell each orthogonal group's fp32 partition what it holds, and
    the AdamW group's partition where its decayed members lie (`_cplm_decay_slices`). `wrapper`
    is the engine's optimizer, `optimizer` ours (the same object at ZeRO-0 in fp32)."""
    if wrapper is optimizer or not any(g.get("orthogonal") for g in optimizer.param_groups):
        return
    import deepspeed

    name = type(wrapper).__name__
    if name != "DeepSpeedZeroOptimizer" or not deepspeed.__version__.startswith(ADAPTED):
        raise RuntimeError(f"optim.name=muon is adapted to DeepSpeed {ADAPTED}x's ZeRO-1/2 optimizer; this is {name} "
                           f"of DeepSpeed {deepspeed.__version__}: install deepspeed==0.19.8 or use optim.name=adamw")
    for i, base_group in enumerate(optimizer.param_groups):
        flat = wrapper.single_partition_of_fp32_groups[i]
        params, offsets, start, size, group = _layout(wrapper, i)
        if base_group["params"][0] is not flat or any(hasattr(p, "use_muon") for p in params):
            raise RuntimeError("optim.name=muon: DeepSpeed's ZeRO partition is not laid out as "
                               "cplm_dist.training.zero_partitions expects: use optim.name=adamw")
        if base_group.get("orthogonal"):
            matrices = [(p._cplm_matrix, offset, tuple(p.shape)) for p, offset in zip(params, offsets)]
            flat._cplm_partition = FlatPartition(matrices, start, size, group)
            continue
        slices = []
        for p, offset in zip(params, offsets):
            lo, hi = max(offset, start), min(offset + p.numel(), start + size)
            if getattr(p, "_cplm_decay", False) and lo < hi:
                slices.append(slice(lo - start, hi - start))
        flat._cplm_decay_slices = slices
