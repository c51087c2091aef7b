"""Experts as DeepSpeed's engine and ZeRO see them: a sparse model's expert parameters
(cplm_dist.model.moe: megatron's experts, `expert_id` on each) are reduced over the
expert-data-parallel group (the ranks holding the same experts), dense ones over dp (x cp).

DeepSpeed 0.19 recognises expert parameters only inside its own MoE modules: an expert parameter
is one with `allreduce = False` and a `group_name` naming its groups in deepspeed.utils.groups;
its optimizer keeps them in parameter groups marked `moe` with that name (ZeRO-1/2 partition
each such group over its expert-data-parallel group); and the engine reduces them apart only when
it found a MoE module while it was built (`has_moe_layers`). So, before deepspeed.initialize:

    name = tag_experts(model)          # the marks, and our megatron groups registered under `name`
    groups = with_expert_groups(groups, name)   # optimizer groups split into dense and `moe` ones
    recognised_as_moe(SparseMLP)       # the engine counts our sparse layer as a MoE module

DeepSpeed's expert reduction sums an expert's gradient over the expert-dp group and divides by
dp (its dense average's divisor: an expert saw the tokens of all its ep ranks), so an expert's
gradient equals the one-process gradient at every ep. ZeRO-3 with experts is refused in config
validation (cplm_dist.config.sparse).

The gradient norm (clipping): ZeRO-1/2 sum each rank's squares over dp, then over the
model-parallel group (tp; pipe x tp at a pipeline), so over all of a stage's ranks, counting a
parameter without a model-parallel mark on model-parallel rank 0 only (a replicated one). An
expert is never replicated there: the ranks holding one (its expert-dp group) each keep a
different ZeRO partition of it, and at expert_tp = 1 the tp ranks hold different experts (ep
over the tp ranks). So experts are marked `model_parallel` (DeepSpeed's is_model_parallel_parameter)
and counted on every rank: each element exactly once. Unmarked, the experts of tp rank 1 were
left out of the norm (measured: ep 2 x tp 2 at expert_tp = 1, 1.8967 for 1.9102 at step 1, the
loss off by 3e-4 at step 5 through the clip). ZeRO-0 takes its norm and clipping from us
(cplm_dist.training.engine.clips_itself), where DeepSpeed would average each rank's own norm.
"""

from __future__ import annotations

import contextlib

import torch

from cplm_dist.megatron_compat import import_deepspeed, parallel_state


def is_expert(param: torch.Tensor) -> bool:
    return getattr(param, "expert_id", None) is not None


def tag_experts(model: torch.nn.Module) -> str | None:
    """Mark `model`'s expert parameters as DeepSpeed's MoE parameters and register megatron's
    expert-parallel and expert-data-parallel groups with DeepSpeed under the returned name; None
    for a dense model."""
    experts = [p for p in model.parameters() if is_expert(p)]
    if not experts:
        return None
    import_deepspeed()
    from deepspeed.utils import groups

    ep = parallel_state.get_expert_model_parallel_world_size()
    name = f"ep_size_{ep}"
    ep_group = parallel_state.get_expert_model_parallel_group()
    edp_group = parallel_state.get_expert_data_parallel_group()
    groups._EXPERT_PARALLEL_GROUP[name] = ep_group
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = edp_group
    groups._EXPERT_PARALLEL_GROUP_RANKS[name] = torch.distributed.get_process_group_ranks(ep_group)
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = torch.distributed.get_process_group_ranks(edp_group)
    for param in experts:
        param.allreduce = False
        param.group_name = name
        param.model_parallel = True  # counted on every rank in ZeRO's gradient norm (above)
    return name


def with_expert_groups(param_groups: list[dict], name: str | None) -> list[dict]:
    """Each optimizer group split in two: its dense parameters, and its experts in a group marked
    `moe` with `name` (the same settings). Empty groups are kept where they were (every pipeline
    stage holds the same groups); an expert group is added only where the model has experts."""
    if name is None:
        return param_groups
    out = []
    for group in param_groups:
        dense = [p for p in group["params"] if not is_expert(p)]
        experts = [p for p in group["params"] if is_expert(p)]
        out.append({**group, "params": dense})
        if experts:
            out.append({**group, "params": experts, "moe": True, "name": name})
    return out


def recognised_as_moe(layer_class: type) -> None:
    """DeepSpeed's engine sets has_moe_layers for the modules that are instances of its MoE
    class (deepspeed/runtime/engine.py, `isinstance(module, MoE)` while it configures the model):
    that name in the engine module becomes (its MoE, our sparse layer), so a model with our layer
    gets the engine's expert reduction and its ZeRO optimizer's expert groups. Version-checked:
    the engine must still name `MoE` so."""
    deepspeed = import_deepspeed()
    from deepspeed.runtime import engine

    current = getattr(engine, "MoE", None)
    if current is None or not deepspeed.__version__.startswith("0.19."):
        raise RuntimeError(f"model.moe with DeepSpeed {deepspeed.__version__}: cplm_dist's expert groups are adapted "
                           "to DeepSpeed 0.19's engine; install deepspeed==0.19.8")
    classes = current if isinstance(current, tuple) else (current,)
    if layer_class not in classes:
        engine.MoE = (*classes, layer_class)


@contextlib.contextmanager
def saved_as_dense(engine):
    """DeepSpeed's checkpoint path for a model with MoE layers is written for its own MoE modules
    (their `deepspeed_moe.experts` keys, its expert files): around our saves and loads the engine
    takes its dense path (the module states from dp rank 0, every rank's ZeRO partitions, expert
    groups included); the experts of every ep rank are written and read by global id apart
    (cplm_dist.checkpoint)."""
    moe = getattr(engine, "has_moe_layers", False)
    engine.has_moe_layers = False
    try:
        yield
    finally:
        engine.has_moe_layers = moe
