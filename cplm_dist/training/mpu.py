"""What DeepSpeed asks of our parallel groups, answered from this rank's ParallelDims: `DeepSpeedMPU`
(the engine's `mpu` at pp = 1) and `ContextPipelineGrid` (the pipeline engine's grid), both on
`DimsMPU`, the answers they share (tensor parallel; cp as DeepSpeed's sequence parallel).

The pipeline grid has a context axis (parallel.cp > 1 at parallel.pp > 1):

DeepSpeed 0.19's `PipelineParallelGrid` knows the axes pipe, data and model only. The stages are
built on its `PipeModelDataParallelTopology` with the model axis tp x cp wide (cp rank x tp + tp
rank), which is Megatron's rank order (cplm_dist.distributed.groups: tp fastest, then cp, dp, pp),
so everything DeepSpeed derives from the topology itself is right as it is: each pipe group (the
point-to-point sends of activations and gradients) joins the stages of one (dp, cp, tp) rank, and
each tied-embedding group the first and last stage of one (dp, cp, tp) rank.

What the grid answers as the engine's `mpu` is not, and `ContextPipelineGrid` answers it instead
(the answers `DeepSpeedMPU` gives at pp = 1, where they apply):

| asked | DeepSpeed's grid would say | here |
|---|---|---|
| tensor / slice parallel rank, size, group | tp x cp (the model axis) | tp: activations are partitioned over the tp ranks that hold the same ones, layer files named by tp rank |
| model parallel group (gradient norms, overflow) | pipe x tp x cp | pipe x tp (Megatron's model-parallel group): parameters are replicated over cp, each counted once |
| data parallel rank, size, group | dp | dp (the batch arithmetic) |
| sequence parallel (DeepSpeed's Ulysses hooks) | none | cp: ZeRO partitions over dp x cp, gradients summed over cp and averaged over dp |

The engine's own gradient reduction at a pipeline (ZeRO-0, and the bf16 optimizer) ignores the
sequence hooks; cplm_dist.training.engine adapts it (`reduce_over_dp_cp`).
"""

from __future__ import annotations

import torch.distributed as dist

from cplm_dist.megatron_compat import parallel_state


class DimsMPU:
    """The answers an mpu and the pipeline grid give alike, from this rank's ParallelDims: tensor
    parallel, and context parallel through the hooks DeepSpeed's Ulysses sequence parallelism reads
    (deepspeed.utils.groups): gradients all-reduced over dp x cp and divided by dp x cp / cp = dp
    (summed over cp, averaged over dp), ZeRO partitioned over dp x cp, while the batch arithmetic
    counts dp alone. At cp = 1 they are dp's."""

    def __init__(self, dims):
        self.dims = dims

    def get_tensor_model_parallel_rank(self):
        return self.dims.tp_rank

    def get_tensor_model_parallel_world_size(self):
        return self.dims.tp_size

    def get_tensor_model_parallel_group(self):
        return self.dims.tp_group

    def get_tensor_model_parallel_src_rank(self):
        return self.dims.rank - self.dims.tp_rank  # tp ranks are consecutive

    def get_sequence_parallel_world_size(self):
        return self.dims.cp_size

    def get_sequence_parallel_rank(self):
        return self.dims.cp_rank

    def get_sequence_parallel_group(self):
        return self.dims.cp_group

    def get_sequence_data_parallel_world_size(self):
        return self.dims.dp_size * self.dims.cp_size

    def get_sequence_data_parallel_rank(self):
        # the rank inside the group itself: DeepSpeed lets its rank 0 write the model states file
        # (and picks the ranks that save ZeRO files by it)
        return dist.get_rank(self.dims.grad_group)

    def get_sequence_data_parallel_group(self):
        return self.dims.grad_group


class DeepSpeedMPU(DimsMPU):
    """What DeepSpeed asks of an `mpu` (model-parallel unit) at pp = 1: model parallel = tensor
    parallel, data parallel = dp (the batch arithmetic)."""

    get_model_parallel_rank = DimsMPU.get_tensor_model_parallel_rank
    get_model_parallel_world_size = DimsMPU.get_tensor_model_parallel_world_size
    get_model_parallel_group = DimsMPU.get_tensor_model_parallel_group

    def get_data_parallel_rank(self):
        return self.dims.dp_rank

    def get_data_parallel_world_size(self):
        return self.dims.dp_size

    def get_data_parallel_group(self):
        return self.dims.dp_group

    def get_pipeline_model_parallel_world_size(self):
        return 1


def context_grid_class():
    """ContextPipelineGrid on DeepSpeed's PipelineParallelGrid (DeepSpeed imported only here)."""
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid

    return type("ContextPipelineGrid", (ContextPipelineGrid, PipelineParallelGrid), {})


class ContextPipelineGrid(DimsMPU):
    """A DeepSpeed pipeline grid (its state taken over as built) that answers tp, cp and the
    model-parallel group from this rank's ParallelDims; see the module docstring. The pipe and
    data axes are the grid's own."""

    def __init__(self, grid, dims):
        self.__dict__.update(grid.__dict__)
        super().__init__(dims)
        self.model_parallel_size = self.slice_parallel_size = dims.tp_size
        self.slice_group, self.slice_proc_group = dist.get_process_group_ranks(dims.tp_group), dims.tp_group
        # tp x pp of this rank's (dp, cp): Megatron's model-parallel group, ranks ascending as DeepSpeed's are
        self.ds_model_proc_group = parallel_state.get_model_parallel_group()
        self.ds_model_rank = dist.get_rank(self.ds_model_proc_group)
        self.ds_model_world_size = dist.get_world_size(self.ds_model_proc_group)

    get_slice_parallel_rank = DimsMPU.get_tensor_model_parallel_rank
    get_slice_parallel_world_size = DimsMPU.get_tensor_model_parallel_world_size
    get_slice_parallel_group = DimsMPU.get_tensor_model_parallel_group
