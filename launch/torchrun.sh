#!/usr/bin/env bash
# torchrun, single or multi node; every argument after `--` goes to cplm_dist.train.
#
#   launch/torchrun.sh --nproc-per-node 8 -- --config configs/runs/cplm-1.7b.yaml --resume auto
#   # two nodes: run on each, same --master (the first node's address)
#   launch/torchrun.sh --nnodes 2 --nproc-per-node 8 --node-rank R --master node001:29500 -- --config ...
#   (--node-rank: 0 on the node --master names, which then hosts the rendezvous at any of its addresses)
set -euo pipefail
source "$(dirname "$0")/env.sh"
nnodes=1; nproc=1; master=""; node_rank=""; join_timeout=300
while [ $# -gt 0 ]; do
  case "$1" in
    --nnodes) nnodes=$2; shift 2 ;;
    --nproc-per-node) nproc=$2; shift 2 ;;
    --master) master=$2; shift 2 ;;
    --node-rank) node_rank=$2; shift 2 ;;
    --join-timeout) join_timeout=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "error: unknown option $1 (usage: launch/torchrun.sh [--nnodes N] [--nproc-per-node K] [--master HOST:PORT] [--node-rank R] [--join-timeout S] -- <train args>)" >&2; exit 2 ;;
  esac
done
if [ "$nnodes" -gt 1 ] && [ -z "$master" ]; then
  echo "error: --nnodes $nnodes needs --master HOST:PORT (the first node's address, the same on every node)" >&2; exit 2
fi
args=(--nnodes "$nnodes" --nproc-per-node "$nproc")
if [ -n "$master" ]; then
  args+=(--rdzv-backend c10d --rdzv-endpoint "$master" --rdzv-id "${CPLM_RDZV_ID:-cplm}")
  # the agents' own rendezvous waits at most --join-timeout seconds for every node (torchrun's
  # default is 600); the ranks' join after it is bounded by train.join_timeout_minutes
  conf="join_timeout=$join_timeout"
  if [ -n "$node_rank" ]; then
    # node rank 0 hosts the c10d store whatever address --master names (torchrun's own guess
    # compares the endpoint with what this hostname resolves to: a multi-homed node 0 named by
    # its fabric address would leave the store unhosted and every node waiting)
    args+=(--node-rank "$node_rank")
    conf+=",is_host=$([ "$node_rank" = 0 ] && echo true || echo false)"
  fi
  args+=(--rdzv-conf "$conf")
else
  args+=(--standalone)
fi
exec "$PYTHON" -m torch.distributed.run "${args[@]}" -m cplm_dist.train "$@"
