#!/usr/bin/env bash
# DeepSpeed's own launcher (pdsh/ssh over a hostfile for several nodes); every argument after
# `--` goes to cplm_dist.train.
#
#   launch/deepspeed.sh --num-gpus 8 -- --config configs/runs/cplm-1.7b.yaml
#   launch/deepspeed.sh --hostfile hosts --master-addr node001 -- --config ... --resume auto      # pdsh (ssh)
#   launch/deepspeed.sh --hostfile hosts --launcher openmpi --master-addr node001 -- --config ...  # mpirun
# A hostfile lists `hostname slots=8` per line. On CPU, --num-gpus is the number of processes.
# --master-addr: node 0's address as the others reach it (without it DeepSpeed asks the first host
# for `hostname -I` over ssh, and takes its first address, which need not be the fabric's).
set -euo pipefail
source "$(dirname "$0")/env.sh"
usage="usage: launch/deepspeed.sh [--hostfile F] [--launcher pdsh|openmpi|mpich|impi|slurm] [--master-addr A] [--master-port P] [--num-nodes N] [--num-gpus K] [--no-ssh-check] -- <train args>"
args=(); launcher=""; limits=()
while [ $# -gt 0 ]; do
  case "$1" in
    --hostfile) args+=(--hostfile "$2"); shift 2 ;;
    --launcher) launcher=$2; args+=(--launcher "$2"); shift 2 ;;
    --master-addr) args+=(--master_addr "$2"); shift 2 ;;
    --master-port) args+=(--master_port "$2"); shift 2 ;;
    --num-nodes) limits+=(--num_nodes "$2"); shift 2 ;;
    --num-gpus) limits+=(--num_gpus "$2"); shift 2 ;;
    --no-ssh-check) args+=(--no_ssh_check); shift ;;
    --) shift; break ;;
    *) echo "error: unknown option $1 ($usage)" >&2; exit 2 ;;
  esac
done
# DeepSpeed's MPI backends start every slot of the hostfile and refuse --num_nodes / --num_gpus
# (ValueError after start-up): say so before anything starts.
case "$launcher" in
  openmpi|mpich|impi|mvapich)
    if [ ${#limits[@]} -gt 0 ]; then
      echo "error: --launcher $launcher starts every slot of the hostfile and takes no --num-nodes / --num-gpus: list the hosts and slots to use in the hostfile" >&2
      exit 2
    fi
    # as launch/mpirun.sh passes --allow-run-as-root: containers and CI run as root
    if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi ;;
esac
# --no_local_rank: our entry reads LOCAL_RANK from the environment, not a --local_rank argument.
exec "$PYTHON" -m deepspeed.launcher.runner "${args[@]}" "${limits[@]}" --no_local_rank --module cplm_dist.train "$@"
