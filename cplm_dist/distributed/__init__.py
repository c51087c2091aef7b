"""Distributed set-up: where this process sits in the job and the groups it talks over.

    launch_env.py  the one reader of launcher variables (torchrun, DeepSpeed, Open MPI, MPICH, Slurm)
    hosts.py       joining the job across hosts: the rendezvous store, what the hosts must agree on
    groups.py      `init_distributed` -> `ParallelDims`: the TP x CP x DP x PP groups (megatron-core's)
    heartbeat.py   each rank's last sign of life, in the job's store
    lost_rank.py   the one line for a collective that failed because another rank died or hung

    dims = init_distributed(tp_size=2, pp_size=2)    # from cplm_dist.distributed

The names below load on first use, so that `python -m cplm_dist.distributed.launch_env` and the
login-node checks import no megatron-core.
"""

__all__ = ["ParallelDims", "check_world", "context_dims", "default_device", "destroy_distributed", "evaluation_tp",
           "free_port", "init_distributed", "parallel_dims", "synchronize"]


def __getattr__(name: str):
    if name in __all__:
        from cplm_dist.distributed import groups

        return getattr(groups, name)
    raise AttributeError(f"module 'cplm_dist.distributed' has no attribute {name!r}")
