#!/usr/bin/env bash
# DeepSpeed's own launcher (pdsh/ssh over a hostfile for several nodes); every argument after
# `--` goes to cplm_dist.train.
#
#   launch/deepspeed.sh --num-gpus 8 -- --config configs/runs/cplm-1.7b.yaml
#   launch/deepspeed.sh --hostfile hosts --num-nodes 2 --num-gpus 8 -- --config ... --resume auto
# A hostfile lists `hostname slots=8` per line. On CPU, --num-gpus is the number of processes.
set -euo pipefail
source "$(dirname "$0")/env.sh"
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --hostfile) args+=(--hostfile "$2"); shift 2 ;;
    --num-nodes) args+=(--num_nodes "$2"); shift 2 ;;
    --num-gpus) args+=(--num_gpus "$2"); shift 2 ;;
    --master-port) args+=(--master_port "$2"); shift 2 ;;
    --) shift; break ;;
    *) echo "error: unknown option $1 (usage: launch/deepspeed.sh [--hostfile F] [--num-nodes N] [--num-gpus K] -- <train args>)" >&2; exit 2 ;;
  esac
done
# --no_local_rank: our entry reads LOCAL_RANK from the environment, not a --local_rank argument.
exec "$PYTHON" -m deepspeed.launcher.runner "${args[@]}" --no_local_rank --module cplm_dist.train "$@"
