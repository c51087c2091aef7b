"""The dry run held to the real thing: in a real job (torchrun, gloo on CPU), each rank runs what
the dry run traces for its role with real tensors (cplm_dist.profiling.dry_run.trace_rank), and a
real training step (cplm_dist.training.step: DeepSpeed's engine, its ZeRO optimizer, the dp
collectives), measured the same way: torch's MemTracker, tensors only, no allocator caches.

    torchrun --nproc-per-node 2 tools/dry_run.py --config tiny --gpus 2 --real --json real.json
    python tools/dry_run.py --config tiny --gpus 2 --json dry.json      # the same layout, fake

`real.json` has, for every rank, its role, the trace's parameters, peak and collectives (the dry
run's own figures, real) and `step_peak_bytes`: the real step's peak of live tensors from the
model's build to the end of its second optimizer step (the first creates the optimizer's states), what the dry run's `peak_bytes` predicts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cplm_dist.config import Config
from cplm_dist.distributed import ParallelDims
from cplm_dist.profiling.dry_run import RunLayout, trace_rank

STEPS = 2  # the first step creates AdamW's states; the second runs with them, as every later one


def step_peak(cfg: Config, dims: ParallelDims, device: torch.device) -> dict[str, int]:
    """MemTracker's peak (by kind, and its "total") over building this rank's model and DeepSpeed's engine and running
    `STEPS` real training steps on random tokens."""
    from cplm_dist.profiling.live_tensors import StepTracker, peak_by_kind
    from cplm_dist.profiling.measure import synthetic_batches
    from cplm_dist.training.step import build_train_step

    batches = synthetic_batches(cfg, cfg.train.micro_batch_size, cfg.data.seq_length, device,
                                torch.Generator().manual_seed(cfg.seed))
    with StepTracker() as tracker:
        step = build_train_step(cfg, dims, device)
        tracker.track_external(step.engine.module)
        for _ in range(STEPS):
            step(batches)
    return peak_by_kind(tracker)


def real_roles(cfg: Config, dims: ParallelDims, layout: RunLayout, device: torch.device) -> list[dict] | None:
    """Every rank's real trace and real step peak, gathered on rank 0 (None elsewhere)."""
    trace = trace_rank(cfg, dims, layout, device)
    dist.barrier()
    peak = step_peak(cfg, dims, device)
    mine = {"rank": dims.rank, "tp_rank": dims.tp_rank, "pp_stage": dims.pp_rank, "dp_rank": dims.dp_rank,
            "parameters": trace.parameters, "peak_bytes": trace.peak_bytes, "by_kind": trace.by_kind,
            "collectives": {**trace.collectives, **trace.boundary}, "step_peak_bytes": peak.pop("total"), "step_by_kind": peak}
    everyone = [None] * dims.world_size
    dist.all_gather_object(everyone, mine)
    return everyone if dims.rank == 0 else None
