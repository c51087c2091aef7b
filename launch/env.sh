# Sourced by every launch script: the environment a training process runs with, in one place.
# Override any of these by exporting it before launching.

# Threads: one OpenMP/MKL pool per process, sized to the cores the scheduler gave it: a Slurm
# task's --cpus-per-task (launch/submit.sh sets it from the node's cores / tasks per node), shared
# by the CPLM_TASK_PROCS processes one task runs (slurm-torchrun.sbatch: a torchrun per node
# starting a process per GPU; else 1). Each rank's data workers follow the same share
# (cplm_dist/data/loader.py caps data.num_workers to it less one).
_procs=${CPLM_TASK_PROCS:-1}
_share=$(( ${SLURM_CPUS_PER_TASK:-1} / (_procs > 0 ? _procs : 1) ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( _share > 0 ? _share : 1 ))}
unset _procs _share
export MKL_NUM_THREADS=${MKL_NUM_THREADS:-$OMP_NUM_THREADS}
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}

# CUDA / NCCL: megatron's tp linears need one hardware queue per device to keep their
# all-reduces in order; async error handling turns a dead peer into an error, not a hang.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# Site-specific fabric settings go here or in the environment, e.g.
#   export NCCL_SOCKET_IFNAME=ib0  NCCL_IB_HCA=mlx5  NCCL_NET_GDR_LEVEL=PHB

export PYTHONUNBUFFERED=1
# The interpreter with cplm_dist installed (the project's .venv when there is one).
if [ -z "${PYTHON:-}" ]; then
  _root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  if [ -x "$_root/.venv/bin/python" ]; then PYTHON="$_root/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHON
