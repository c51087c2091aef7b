#!/usr/bin/env bash
# torchrun, single or multi node; every argument after `--` goes to cplm_dist.train.
#
#   launch/torchrun.sh --nproc-per-node 8 -- --config configs/runs/cplm-1.7b.yaml --resume auto
#   # two nodes: run on each, same --master (the first node's address)
#   launch/torchrun.sh --nnodes 2 --nproc-per-node 8 --node-rank R --master node001:29500 -- --config ...
#   (--node-rank: 0 on the node --master names, which then hosts the rendezvous at any of its addresses)
#   # unattended: torchrun restarts every rank up to N times after a rank fails (killed, hung past
#   # train.collective_timeout_minutes, a crash); each restart resumes from the newest intact checkpoint
#   launch/torchrun.sh --nproc-per-node 8 --max-restarts 3 -- --config configs/runs/cplm-1.7b.yaml
#   (--max-restarts N > 0 adds --resume auto to the train arguments unless they name a --resume)
set -euo pipefail
source "$(dirname "$0")/env.sh"
nnodes=1; nproc=1; master=""; node_rank=""; join_timeout=300; max_restarts=0
while [ $# -gt 0 ]; do
  case "$1" in
    --nnodes) nnodes=$2; shift 2 ;;
    --nproc-per-node) nproc=$2; shift 2 ;;
    --master) master=$2; shift 2 ;;
    --node-rank) node_rank=$2; shift 2 ;;
    --join-timeout) join_timeout=$2; shift 2 ;;
    --max-restarts) max_restarts=${2-}; shift $(($# > 1 ? 2 : 1)) ;;
    --) shift; break ;;
    *) echo "error: unknown option $1 (usage: launch/torchrun.sh [--nnodes N] [--nproc-per-node K] [--master HOST:PORT] [--node-rank R] [--join-timeout S] [--max-restarts N] -- <train args>)" >&2; exit 2 ;;
  esac
done
if [ "$nnodes" -gt 1 ] && [ -z "$master" ]; then
  echo "error: --nnodes $nnodes needs --master HOST:PORT (the first node's address, the same on every node)" >&2; exit 2
fi
[[ "$max_restarts" =~ ^[0-9]+$ ]] || {
  echo "error: --max-restarts '$max_restarts' is not a whole number >= 0 (how often torchrun restarts the ranks after a failure)" >&2; exit 2; }
args=(--nnodes "$nnodes" --nproc-per-node "$nproc")
if [ "$max_restarts" -gt 0 ]; then
  args+=(--max-restarts "$max_restarts")
  # every restart continues from the newest intact checkpoint, not from scratch (nor refuses the existing run)
  resume_given=""
  for a in "$@"; do case "$a" in --resume|--resume=*) resume_given=1 ;; esac; done
  [ -n "$resume_given" ] || set -- "$@" --resume auto
fi
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
