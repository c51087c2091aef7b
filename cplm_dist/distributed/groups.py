"""Process groups: joins the job the launcher started and builds the TP x CP x DP x PP groups.

    dims = init_distributed(tp_size=2, pp_size=2)   # torchrun, slurm, mpirun, DeepSpeed's launcher, or one process
    dims = init_distributed(tp_size=2, cp_size=2)   # context parallelism (cplm_dist.model.parallel.context)
    dims.tp_group, dims.dp_group, dims.pp_group      # passed explicitly to everything below
    dims.cp_group, dims.dp_cp_group                  # the cp ranks of one sequence; dp x cp (gradients, token counts)

Where this process sits comes from cplm_dist.distributed.launch_env, the one reader of launcher variables.
Groups come from `megatron.core.parallel_state`; the backend is gloo on CPU and nccl on GPU.
Ranks are laid out Megatron's way, which is also DeepSpeed's pipeline topology (axes pipe, data,
model): the tp ranks of one group are consecutive, then cp, then dp, and the pipeline stage varies
slowest, rank = ((pp_rank x dp + dp_rank) x cp + cp_rank) x tp + tp_rank (megatron's order
tp-cp-ep-dp-pp; DeepSpeed's pipeline grid sees tp x cp as its model axis, the same order:
cplm_dist.training.mpu).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from cplm_dist.config import check_world, divisors  # check_world: the world -> dp arithmetic, BatchLayout's
from cplm_dist.distributed.hosts import JoinedHosts, join
from cplm_dist.distributed.launch_env import LaunchEnv
from cplm_dist.errors import ConfigError
from cplm_dist.megatron_compat import parallel_state


@dataclass(frozen=True)
class ParallelDims:
    """This rank's coordinates in the TP x DP x PP grid and the groups to talk over."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    tp_group: dist.ProcessGroup
    dp_rank: int
    dp_size: int
    dp_group: dist.ProcessGroup
    pp_rank: int = 0
    pp_size: int = 1
    pp_group: dist.ProcessGroup | None = None
    cp_rank: int = 0
    cp_size: int = 1
    cp_group: dist.ProcessGroup | None = None  # the ranks that share one sequence (None: cp = 1)
    dp_cp_group: dist.ProcessGroup | None = None  # dp x cp: where gradients and token counts are summed (None: dp_group)
    ep_rank: int = 0  # expert parallelism (model.moe): this rank's share of each sparse layer's experts
    ep_size: int = 1
    ep_group: dist.ProcessGroup | None = None  # the ranks that split one layer's experts (None: ep = 1)
    expert_tp_size: int = 1  # the experts' own tensor parallelism (parallel.expert_tp)
    expert_dp_group: dist.ProcessGroup | None = None  # the ranks holding the same experts: their gradients' group (None: no experts)
    hosts: JoinedHosts = field(default_factory=JoinedHosts)  # where each rank joined from (names for messages)

    @property
    def grad_group(self) -> dist.ProcessGroup:
        """The ranks a gradient and a step's token counts are summed over: dp x cp (Megatron's
        data-parallel group with context parallelism), dp alone at cp = 1."""
        return self.dp_cp_group if self.dp_cp_group is not None else self.dp_group

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last_stage(self) -> bool:
        """This rank holds the LM head and the loss (always at pp = 1)."""
        return self.pp_rank == self.pp_size - 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU), so that a host clock measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def evaluation_tp(saved_tp: int | None = None, asked: int | None = None, world: int | None = None) -> int:
    """The tp of an evaluation launch (evaluate, generate, the gradient bottleneck, lm-eval) of
    `world` ranks (default: this launch's): `asked` if given, else the checkpoint's `saved_tp`
    where it divides the world (dp = world / tp replicas), else all ranks one replica. A
    checkpoint loads at any tp (cplm_dist.checkpoint.load_model) and evaluates the same at every tp."""
    if world is None:
        world = dist.get_world_size() if dist.is_initialized() else LaunchEnv.from_environ(mpi_rendezvous=False).world_size
    tp = asked if asked is not None else saved_tp if saved_tp and world % saved_tp == 0 else world
    if tp < 1 or world % tp:
        raise ConfigError(f"tp={tp} does not divide the launch's {world} ranks: choose tp from {divisors(world)}")
    return tp


def init_distributed(tp_size: int = 1, *, pp_size: int = 1, cp_size: int = 1, ep_size: int = 1,
                     expert_tp_size: int | None = None, backend: str | None = None,
                     timeout_minutes: float = 10, join_timeout_minutes: float = 5,
                     shared_dir: str | os.PathLike | None = None) -> ParallelDims:
    """Join the job (once per process) and build the TP, CP, DP and PP groups through parallel_state,
    and the expert groups (ep x expert_tp x expert-dp over each stage's tp x cp x dp ranks, megatron's:
    `expert_tp_size` None is tp).
    Joining (every rank arriving, the hosts' addresses checked, `shared_dir` the same directory on
    every host) takes at most `join_timeout_minutes` (cplm_dist.distributed.hosts); each collective at most
    `timeout_minutes`."""
    # Megatron's tp linears overlap their all-reduce with compute; on GPU that needs one hardware
    # queue per device to keep the order (Megatron's own launchers set this). Harmless on CPU.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    env = LaunchEnv.from_environ()
    check_world(tp_size, env.world_size, pp_size, cp_size)
    joined = JoinedHosts()
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
        if env.world_size == 1 and (env.master_addr is None or env.master_port is None):
            init_method = f"tcp://127.0.0.1:{free_port()}"
            dist.init_process_group(backend, init_method=init_method, rank=0, world_size=1,
                                    timeout=timedelta(minutes=timeout_minutes))
        else:
            init_method = f"tcp://{env.master_addr}:{env.master_port}"
            store, joined = join(env, backend, join_timeout_minutes=join_timeout_minutes,
                               shared_dir=None if shared_dir is None else Path(shared_dir))
            dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size,
                                    timeout=timedelta(minutes=timeout_minutes))
        # DeepSpeed (and anything else downstream) reads the torchrun-style variables: publish
        # what we resolved, whatever the launcher was.
        host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
        os.environ.update(RANK=str(env.rank), WORLD_SIZE=str(env.world_size), LOCAL_RANK=str(env.local_rank),
                          MASTER_ADDR=host, MASTER_PORT=port)
    else:
        check_world(tp_size, dist.get_world_size(), pp_size, cp_size)
    expert_tp_size = tp_size if expert_tp_size is None else expert_tp_size
    if parallel_state.model_parallel_is_initialized():
        if (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_context_parallel_world_size(), parallel_state.get_expert_model_parallel_world_size(),
                parallel_state.get_expert_tensor_parallel_world_size()) != (tp_size, pp_size, cp_size, ep_size, expert_tp_size):
            raise RuntimeError("parallel groups already built with another tp, pp, cp or ep size; call destroy_distributed first")
    else:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size, context_parallel_size=cp_size,
            expert_model_parallel_size=ep_size, expert_tensor_parallel_size=expert_tp_size,
            create_gloo_process_groups=False, distributed_timeout_minutes=timeout_minutes,
        )
    return parallel_dims(joined)


def parallel_dims(joined: JoinedHosts | None = None) -> ParallelDims:
    """The coordinates of this rank, from the groups `init_distributed` built (`joined`: where
    the ranks joined from, when this process joined the job)."""
    return ParallelDims(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        dp_group=parallel_state.get_data_parallel_group(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pp_group=parallel_state.get_pipeline_model_parallel_group(),
        **context_dims(),
        **expert_dims(),
        hosts=joined or JoinedHosts(),
    )


def context_dims() -> dict:
    """ParallelDims' context-parallel fields from parallel_state (cp = 1: no cp groups)."""
    cp = parallel_state.get_context_parallel_world_size()
    if cp == 1:
        return {}
    return dict(cp_rank=parallel_state.get_context_parallel_rank(), cp_size=cp,
                cp_group=parallel_state.get_context_parallel_group(),
                dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True))


def expert_dims() -> dict:
    """ParallelDims' expert fields from parallel_state: the ep group and the expert-data-parallel
    group (the ranks holding the same experts) whenever experts could exist."""
    ep = parallel_state.get_expert_model_parallel_world_size()
    return dict(ep_rank=parallel_state.get_expert_model_parallel_rank(), ep_size=ep,
                ep_group=parallel_state.get_expert_model_parallel_group() if ep > 1 else None,
                expert_tp_size=parallel_state.get_expert_tensor_parallel_world_size(),
                expert_dp_group=parallel_state.get_expert_data_parallel_group())


def destroy_distributed() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
