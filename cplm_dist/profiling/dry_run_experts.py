"""How the dry run (cplm_dist.profiling.dry_run) routes a sparse model's tokens on a fake rank:
balanced, the routing the estimator assumes (cplm_dist.profiling.expert_cost).

A fake tensor has shapes and no values, and megatron-core's dropless dispatcher sizes its buffers
from values: the tokens each expert was given (the all-to-all's split sizes, the permutation's
masked_select, SequentialMLP's split). Under `balanced_routing` every sparse layer built runs
megatron's own drop-and-pad path instead (moe_pad_expert_input_to_capacity at capacity factor 1,
or the config's capacity_factor where it is set), whose shapes are static: each expert receives
exactly its capacity, ceil(tokens x top_k / E x factor) rows from every rank, which at factor 1 is
what a perfectly balanced dropless router gives it. The counts handed to the experts are plain
integers (numpy), as the dispatcher hands them after its device-to-host copy. The experts run as a
GPU runs them (`traced_experts`): model.moe.expert_impl auto is traced as the grouped GEMM in bf16
(what auto picks on CUDA), one expert after another in fp32.

What the real layer does beside routing and a fake one cannot: its routing statistics
(SparseMLP's counters: `float()` of a sum) and the auxiliary losses' log entries, both left out;
neither is kept for backward. Megatron's class-level auxiliary-loss scale is put back on exit, so
no fake tensor outlives the trace. Only the all-to-all dispatcher is traced (the all-gather one
sizes its permutation from values too): `check_traceable` says so in one line.
"""

from __future__ import annotations

import contextlib

import numpy as np

from cplm_dist.config import Config
from cplm_dist.errors import UsageError


def check_traceable(cfg: Config) -> None:
    """One line where the dry run cannot trace this sparse model's dispatcher."""
    if cfg.model.moe.num_experts and cfg.model.moe.dispatcher != "alltoall":
        raise UsageError(f"model.moe.dispatcher={cfg.model.moe.dispatcher}: the dry run traces the alltoall dispatcher "
                         "only (the allgather one sizes its buffers from the routing's values); the planner and the "
                         "estimator cost both")


def traced_experts(cfg: Config) -> Config:
    """cfg with model.moe.expert_impl as a GPU would run it (the module docstring): the fake rank
    builds on the CPU device, where auto would pick the sequential loop."""
    from dataclasses import replace

    from cplm_dist.profiling.expert_cost import grouped_experts

    e = cfg.model.moe
    if not e.num_experts or e.expert_impl != "auto":
        return cfg
    impl = "grouped" if grouped_experts(cfg) else "sequential"
    return replace(cfg, model=replace(cfg.model, moe=replace(e, expert_impl=impl)))


@contextlib.contextmanager
def balanced_routing(cfg: Config):
    """While active, sparse layers built route as the module docstring says; a no-op for a dense model."""
    if not cfg.model.moe.num_experts:
        yield
        return
    from cplm_dist.megatron_compat import moe_modules
    from cplm_dist.model import moe as sparse_module
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    mods = moe_modules()
    factor = cfg.model.moe.capacity_factor or 1.0
    build_config, record, count = sparse_module.megatron_moe_config, sparse_module.record_aux_loss, sparse_module.SparseMLP._count
    postprocess = MoEAlltoAllTokenDispatcher.dispatch_postprocess
    scale = mods.moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale

    def padded_config(*args, **kwargs):
        config = build_config(*args, **kwargs)
        config.moe_expert_capacity_factor, config.moe_pad_expert_input_to_capacity = factor, True
        return config

    def counted(self, global_input_tokens, global_probs):
        tokens, _, probs = postprocess(self, global_input_tokens, global_probs)
        return tokens, np.full(self.num_local_experts, self.capacity * self.tp_size * self.ep_size), probs

    sparse_module.megatron_moe_config = padded_config
    sparse_module.record_aux_loss = lambda *a, **k: None
    sparse_module.SparseMLP._count = lambda self, *a: None
    MoEAlltoAllTokenDispatcher.dispatch_postprocess = counted
    mods.moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = None
    try:
        yield
    finally:
        sparse_module.megatron_moe_config, sparse_module.record_aux_loss = build_config, record
        sparse_module.SparseMLP._count = count
        MoEAlltoAllTokenDispatcher.dispatch_postprocess = postprocess
        mods.moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = scale
        mods.router_module.save_to_aux_losses_tracker = record
