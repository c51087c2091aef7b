#!/usr/bin/env bash
# torchrun, single or multi node; every argument after `--` goes to cplm_dist.train.
#
#   launch/torchrun.sh --nproc-per-node 8 -- --config configs/runs/cplm-1.7b.yaml --resume auto
#   # two nodes: run on each, same --master (the first node's address)
#   launch/torchrun.sh --nnodes 2 --nproc-per-node 8 --master node001:29500 -- --config ...
set -euo pipefail
source "$(dirname "$0")/env.sh"
nnodes=1; nproc=1; master=""; node_rank=""
while [ $# -gt 0 ]; do
  case "$1" in
    --nnodes) nnodes=$2; shift 2 ;;
    --nproc-per-node) nproc=$2; shift 2 ;;
    --master) master=$2; shift 2 ;;
    --node-rank) node_rank=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "error: unknown option $1 (usage: launch/torchrun.sh [--nnodes N] [--nproc-per-node K] [--master HOST:PORT] -- <train args>)" >&2; exit 2 ;;
  esac
done
if [ "$nnodes" -gt 1 ] && [ -z "$master" ]; then
  echo "error: --nnodes $nnodes needs --master HOST:PORT (the first node's address, the same on every node)" >&2; exit 2
fi
args=(--nnodes "$nnodes" --nproc-per-node "$nproc")
if [ -n "$master" ]; then
  args+=(--rdzv-backend c10d --rdzv-endpoint "$master" --rdzv-id "${CPLM_RDZV_ID:-cplm}")
  [ -n "$node_rank" ] && args+=(--node-rank "$node_rank")
else
  args+=(--standalone)
fi
exec "$PYTHON" -m torch.distributed.run "${args[@]}" -m cplm_dist.train "$@"
