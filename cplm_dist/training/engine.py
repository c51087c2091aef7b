"""The DeepSpeed engine: its JSON config generated from the typed config, and `deepspeed.initialize`
with our optimizer and schedule and the mpu over our parallel groups (cplm_dist.training.mpu).

| typed field | DeepSpeed key |
|---|---|
| train.global_batch_size | train_batch_size |
| train.micro_batch_size | train_micro_batch_size_per_gpu |
| global / (micro x dp) | gradient_accumulation_steps (checked: a ConfigError gives the numbers) |
| optim.clip_grad | gradient_clipping |
| train.zero_stage | zero_optimization.stage |
| train.overlap_comm (null: on with CUDA) | zero_optimization.overlap_comm (DeepSpeed turns it off for a pipeline) |
| train.contiguous_gradients, reduce_bucket_size, allgather_bucket_size, stage3_prefetch_bucket_size | zero_optimization.* (same names) |
| train.precision | bf16.enabled |
| train.grad_accum_dtype (null: unset) | data_types.grad_accum_dtype (fp32 with bf16 at ZeRO-1: DeepSpeed's BF16_Optimizer) |
| `--reshape` to another layout, ZeRO > 0 | checkpoint.load_universal (cplm_dist.checkpoint.reshape) |
| parallel.pp > 1, sequence_parallel | pipeline.pipe_partitioned, grad_partitioned (off under sp: activations already sharded; off under DualPipeV) |
| parallel.pp_schedule | the PipelineModule class: DeepSpeed's DualPipeVEngine runs a DualPipeVModule (cplm_dist.training.pipeline) |

At parallel.pp > 1 the model is a `PipelineModule` (cplm_dist.training.pipeline) and DeepSpeed builds
its pipeline engine, whose process grid (axes pipe, data, model) is the same rank layout as ours
(the model axis tp x cp wide under context parallelism: cplm_dist.training.mpu).
At ZeRO-0 there DeepSpeed's fp32 clipping would count each later stage's tp-replicated parameters
out and the tied embedding twice, so the optimizer clips itself (`clip_before_step`); so it does
for a sparse model at ZeRO-0, where DeepSpeed averages each dp rank's own norm, and the experts
differ between ep ranks (`clips_itself`).

The optimizer (GuardedAdamW with weight-decay groups, or GuardedMuon) and LR schedule are ours, handed to
DeepSpeed, which steps them at accumulation boundaries and saves them in its checkpoints.
"""

from __future__ import annotations

import torch

from cplm_dist.config import Config, batch_layout
from cplm_dist.distributed import ParallelDims
from cplm_dist.megatron_compat import import_deepspeed
from cplm_dist.model.moe import SparseMLP
from cplm_dist.training.expert_groups import recognised_as_moe, tag_experts
from cplm_dist.training.mpu import DeepSpeedMPU
from cplm_dist.training.optim import build_optimizer, build_scheduler, grad_norm
from cplm_dist.training.zero_partitions import bind_partitions


def deepspeed_config(cfg: Config, dims: ParallelDims, load_universal: bool = False) -> dict:
    t = cfg.train
    accumulation = batch_layout(cfg, dims.dp_size)
    clip_ourselves = clips_itself(cfg, dims)
    # DualPipeV sends whole activations (DeepSpeed refuses partitioned ones with it)
    partitioned = dims.tp_size > 1 and not cfg.parallel.sequence_parallel and cfg.parallel.pp_schedule == "1f1b"
    return {
        "pipeline": {"pipe_partitioned": partitioned, "grad_partitioned": partitioned},
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": 0.0 if clip_ourselves else cfg.optim.clip_grad,
        "zero_optimization": {
            "stage": t.zero_stage,
            "overlap_comm": torch.cuda.is_available() if t.overlap_comm is None else t.overlap_comm,
            "contiguous_gradients": t.contiguous_gradients,
            "reduce_bucket_size": t.reduce_bucket_size,
            "allgather_bucket_size": t.allgather_bucket_size,
            "stage3_prefetch_bucket_size": t.stage3_prefetch_bucket_size,
            **zero3_context_reduction(cfg),
        },
        "bf16": {"enabled": t.precision == "bf16"},
        # fp32 accumulation is reduced over dp in fp32 too (DeepSpeed would cast it back to bf16 to reduce)
        **({"data_types": {"grad_accum_dtype": t.grad_accum_dtype}, "communication_data_type": t.grad_accum_dtype}
           if t.grad_accum_dtype else {}),
        "checkpoint": {"load_universal": load_universal},  # resuming from another layout (cplm_dist.checkpoint.reshape)
        "fp16": {"enabled": False},
        "zero_allow_untested_optimizer": True,  # our AdamW subclass, not DeepSpeed's fused/CPU Adam
        "steps_per_print": 1 << 30,  # our logger reports progress
        "wall_clock_breakdown": False,
    }


def zero3_context_reduction(cfg: Config) -> dict:
    """ZeRO-3 under context parallelism reduces gradients by all-reduce into contiguous buckets:
    its reduce-scatter path (DeepSpeed 0.19.8, stage3 __avg_scatter_grads) divides by the whole
    dp x cp group, ignoring the sequence-parallel size that its all-reduce path divides back out,
    which averages the cp ranks' partial gradients instead of summing them (measured: cp 2 at
    ZeRO-3 left one rank's trajectory at step 2)."""
    if cfg.parallel.cp == 1 or cfg.train.zero_stage != 3:
        return {}
    return {"reduce_scatter": False, "contiguous_gradients": True}


def clips_itself(cfg: Config, dims: ParallelDims) -> bool:
    """Our optimizer takes the gradient norm and clips (`clip_before_step`), not DeepSpeed: at ZeRO-0
    with pipeline stages (DeepSpeed's fp32 clipping counts each later stage's tp-replicated
    parameters out, the tied embedding twice) or with experts (DeepSpeed's averages the dp ranks'
    own norms, which differ where the ranks hold different experts: cplm_dist.training.optim.grad_norm
    counts each expert once)."""
    return cfg.train.zero_stage == 0 and (dims.pp_size > 1 or cfg.model.moe.num_experts > 0)


def build_engine(model: torch.nn.Module, cfg: Config, dims: ParallelDims, load_universal: bool = False):
    """(engine, optimizer we built, scheduler) for the model; DeepSpeed's init joins our process
    group. `load_universal`: the engine will resume from a universal checkpoint (a reshape)."""
    deepspeed = import_deepspeed()
    config = deepspeed_config(cfg, dims, load_universal)
    if cfg.model.tie_embeddings and cfg.train.zero_stage == 3:
        # ZeRO-3 gathers a parameter only around its own module's forward: the LM head reads the
        # embedding's weight, so it must be declared to that module.
        deepspeed.zero.register_external_parameter(model.lm_head, model.embedding.weight)
    experts = tag_experts(model)  # a sparse model: experts reduced over their expert-dp group (expert_groups)
    if experts is not None:
        recognised_as_moe(SparseMLP)
    optimizer = build_optimizer(model, cfg, dims.tp_group, experts)
    scheduler = build_scheduler(optimizer, cfg)
    if dims.cp_size > 1 and cfg.train.zero_stage == 3:
        # ZeRO-3 would partition the parameters over mpu.get_data_parallel_group() (dp alone, the
        # group the batch arithmetic counts: DeepSpeed 0.19.8 parameter_offload), so the cp ranks'
        # partial gradients would never be summed (measured: cp 2 at ZeRO-3 left one rank's
        # trajectory at step 2). Partitioned over dp x cp here, after the optimizer's groups are
        # made from whole parameters, as the engine itself does at ZeRO-1/2; Init gets the config's
        # ZeRO keys alone (it checks batch keys against a world of its own).
        # a parameter larger than the bucket would take the reduce-scatter path all the same
        zero = config["zero_optimization"]
        zero["reduce_bucket_size"] = max(int(zero["reduce_bucket_size"]), max(p.numel() for p in model.parameters()))
        zero_keys = {k: config[k] for k in ("train_micro_batch_size_per_gpu", "zero_optimization", "bf16", "fp16")}
        deepspeed.zero.Init(module=model, data_parallel_group=dims.grad_group, config_dict_or_path=zero_keys,
                            mpu=DeepSpeedMPU(dims), dtype=next(model.parameters()).dtype)
    pipeline = dims.pp_size > 1
    if clips_itself(cfg, dims):
        clip_before_step(optimizer, model, dims, cfg.optim.clip_grad)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config,
        mpu=None if pipeline else DeepSpeedMPU(dims), dist_init_required=False,  # a pipeline brings its own grid
    )
    bind_partitions(engine.optimizer, optimizer)  # Muon under ZeRO-1/2 (a no-op for AdamW)
    if pipeline and dims.cp_size > 1:
        reduce_over_dp_cp(engine)
    return engine, optimizer, scheduler


def reduce_over_dp_cp(engine) -> None:
    """A pipeline engine under context parallelism reduces its gradients over dp x cp, summed over
    cp and averaged over dp, at every ZeRO stage. DeepSpeed 0.19's ZeRO-1 optimizer does so through
    the grid's sequence hooks (cplm_dist.training.mpu); the engine's own reduction
    (ZeRO-0, and the bf16 optimizer's) takes the grid's dp group alone at a pipeline, so it runs its
    other branch here (dp x cp, divided by dp), the one it takes without a pipeline."""
    import deepspeed

    reduce = type(engine)._reduce_non_expert_gradients
    if not deepspeed.__version__.startswith("0.19.") or "pipeline_parallelism" not in reduce.__code__.co_names:
        raise RuntimeError(f"parallel.cp > 1 with parallel.pp > 1 is adapted to DeepSpeed 0.19's pipeline gradient "
                           f"reduction; this is DeepSpeed {deepspeed.__version__}: install deepspeed==0.19.8")

    def over_dp_cp(grads, elements_per_buffer):
        engine.pipeline_parallelism = False  # read by this function alone: its non-pipeline groups
        try:
            return reduce(engine, grads, elements_per_buffer)
        finally:
            engine.pipeline_parallelism = True

    engine._reduce_non_expert_gradients = over_dp_cp


def clip_before_step(optimizer, model: torch.nn.Module, dims: ParallelDims, max_norm: float) -> None:
    """Before each optimizer step: the global gradient norm over tp and pipeline stages (each
    parameter once), kept as `optimizer.grad_norm`, and the gradients clipped to `max_norm`."""

    def clip():
        norm = grad_norm(model, dims.tp_group, dims.pp_group)
        optimizer.grad_norm = norm
        if max_norm > 0 and norm > max_norm:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            torch._foreach_mul_(grads, max_norm / (norm + 1e-6))

    optimizer.before_step = clip
