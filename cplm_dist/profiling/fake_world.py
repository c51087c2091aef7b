"""One rank of a job of any size, in one process and with no device: torch's fake process group
(backend "fake": every collective returns at once, nothing moves) at the rank's place in the real
world size, with megatron-core's tp, cp, dp and pp groups (and a sparse model's ep, expert-tp and expert-dp
groups) built as training builds them
(cplm_dist.distributed), and tensors under FakeTensorMode (shapes, dtypes and storages, no memory,
no arithmetic). cplm_dist.profiling.dry_run traces the real model in it.

    with fake_rank(rank=5, world=512, tp=4, pp=4) as dims, FakeTensorMode():
        model = build_model(cfg, tp_group=dims.tp_group, device="cpu", dtype=torch.bfloat16)

Ranks are placed as parallel.py places them: rank = ((pp_rank x dp + dp_rank) x cp + cp_rank) x tp
+ tp_rank (megatron's order tp-cp-dp-pp; cp = 1: (pp_rank x dp + dp_rank) x tp + tp_rank).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from unittest import mock

import torch.distributed as dist

from cplm_dist.distributed import destroy_distributed, parallel_dims
from cplm_dist.megatron_compat import parallel_state


def rank_of(*, tp_rank: int, pp_stage: int, tp: int, dp: int, dp_rank: int = 0, cp_rank: int = 0, cp: int = 1) -> int:
    """The global rank of a tp rank (and cp rank) of a pipeline stage (Megatron's and DeepSpeed's layout)."""
    return ((pp_stage * dp + dp_rank) * cp + cp_rank) * tp + tp_rank


@contextlib.contextmanager
def fake_rank(*, rank: int, world: int, tp: int, pp: int = 1, cp: int = 1, ep: int = 1, expert_tp: int | None = None):
    """Yield the ParallelDims of `rank` in a fake job of `world` ranks (a sparse model's expert
    groups too: `ep`, `expert_tp` null = tp); the groups are torn down after. Refuses to run
    inside a real job (its groups would be replaced)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a fake rank needs a process without a process group: this one has joined a job")
    # what a launcher would have set: DeepSpeed's pipeline module reads LOCAL_RANK
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0"}
    with mock.patch.dict(os.environ, env), _joined(rank, world, FakeStore()):
        with warnings.catch_warnings():  # megatron warns once per group it builds at this world size
            warnings.simplefilter("ignore")
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                     context_parallel_size=cp, expert_model_parallel_size=ep,
                                                     expert_tensor_parallel_size=tp if expert_tp is None else expert_tp,
                                                     create_gloo_process_groups=False)
        yield parallel_dims()


@contextlib.contextmanager
def _joined(rank: int, world: int, store):
    dist.init_process_group("fake", store=store, rank=rank, world_size=world)
    try:
        yield
    finally:
        destroy_distributed()
