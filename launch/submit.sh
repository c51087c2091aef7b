#!/usr/bin/env bash
# Submit a training job to Slurm; every argument after `--` goes to cplm_dist.train.
#
#   launch/submit.sh --nodes 2 --gpus-per-node 8 --time 24:00:00 --partition gpu \
#       -- --config configs/runs/cplm-1.7b.yaml optim.lr=1e-3
#   launch/submit.sh --torchrun --nodes 4 --gpus-per-node 8 --time 48:00:00 -- --config configs/runs/cplm-3b.yaml
#   launch/submit.sh --nodes 1 --tasks-per-node 2 --gpus-per-node 0 --time 00:10:00 --wait -- --config configs/quickstart.yaml
#
# Options: --nodes N, --gpus-per-node G (0 on CPU), --tasks-per-node T (default G, or 1),
# --cpus-per-task C, --time HH:MM:SS, --partition P, --account A, --job-name NAME,
# --log-dir DIR (default logs/slurm: <DIR>/<name>-<jobid>.out), --torchrun, --wait, --dry-run,
# --max-requeues N (default 3: how often the job requeues itself after a crash, a lost or killed
# rank; passed to the job as CPLM_MAX_REQUEUES; 0: never).
# Before sbatch (and in --dry-run) the training arguments are checked against the job's size
# (nodes x tasks per node = tp x pp x dp, the batch arithmetic): a layout that cannot run is
# refused with one line instead of failing after its wait in the queue.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
nodes=1; gpus=""; tasks=""; cpus=""; time_limit=""; partition=""; account=""; name="cplm"
log_dir="logs/slurm"; script="$here/slurm.sbatch"; wait_flag=""; dry_run=""; max_requeues=""
usage="usage: launch/submit.sh --nodes N --gpus-per-node G --time HH:MM:SS [--partition P] [...] -- <train args>"
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) nodes=$2; shift 2 ;;
    --gpus-per-node) gpus=$2; shift 2 ;;
    --tasks-per-node) tasks=$2; shift 2 ;;
    --cpus-per-task) cpus=$2; shift 2 ;;
    --time) time_limit=$2; shift 2 ;;
    --partition) partition=$2; shift 2 ;;
    --account) account=$2; shift 2 ;;
    --job-name) name=$2; shift 2 ;;
    --log-dir) log_dir=$2; shift 2 ;;
    --torchrun) script="$here/slurm-torchrun.sbatch"; shift ;;
    --wait) wait_flag="--wait"; shift ;;
    --dry-run) dry_run=1; shift ;;
    --max-requeues)
      max_requeues=${2-}; shift $(($# > 1 ? 2 : 1))
      [[ "$max_requeues" =~ ^[0-9]+$ ]] || {
        echo "error: --max-requeues '$max_requeues' is not a whole number >= 0 (how often the job requeues itself after a failure)" >&2; exit 2; } ;;
    --) shift; break ;;
    -h|--help) echo "$usage"; exit 0 ;;
    *) echo "error: unknown option $1 ($usage)" >&2; exit 2 ;;
  esac
done
[ -n "$gpus" ] || { echo "error: --gpus-per-node is required (0 for CPU nodes)" >&2; exit 2; }
[ -n "$time_limit" ] || { echo "error: --time HH:MM:SS is required (the job is signalled to save 5 minutes before it)" >&2; exit 2; }
[ $# -gt 0 ] || { echo "error: give the training arguments after --, e.g. -- --config configs/runs/cplm-1.7b.yaml" >&2; exit 2; }
if [ "$script" = "$here/slurm.sbatch" ]; then
  tasks=${tasks:-$([ "$gpus" -gt 0 ] && echo "$gpus" || echo 1)}
else
  tasks=1  # one torchrun per node
  export CPLM_PROCS_PER_NODE=${CPLM_PROCS_PER_NODE:-$([ "$gpus" -gt 0 ] && echo "$gpus" || echo 1)}
fi
# before queueing: the config validates and tp x pp divides the job (cplm_dist/train/preflight.py)
per_node=$([ "$script" = "$here/slurm.sbatch" ] && echo "$tasks" || echo "$CPLM_PROCS_PER_NODE")
root="$(dirname "$here")"
python=${PYTHON:-$([ -x "$root/.venv/bin/python" ] && echo "$root/.venv/bin/python" || echo python3)}
"$python" -m cplm_dist.train.preflight --world $((nodes * per_node)) "$@" || exit 2
args=(--job-name "$name" --nodes "$nodes" --ntasks-per-node "$tasks" --time "$time_limit"
      --output "$log_dir/%x-%j.out")
[ "$gpus" -gt 0 ] && args+=(--gpus-per-node "$gpus")
[ -n "$cpus" ] && args+=(--cpus-per-task "$cpus")
[ -n "$partition" ] && args+=(--partition "$partition")
[ -n "$account" ] && args+=(--account "$account")
[ -n "$wait_flag" ] && args+=("$wait_flag")
# the job inherits this environment (CPLM_ROOT, CPLM_PROCS_PER_NODE) and this one variable on top
[ -n "$max_requeues" ] && args+=(--export "ALL,CPLM_MAX_REQUEUES=$max_requeues")
if [ -n "$dry_run" ]; then
  printf '%q ' sbatch "${args[@]}" "$script" "$@"; echo
  exit 0
fi
mkdir -p "$log_dir"
export CPLM_ROOT="$(dirname "$here")"  # the job finds launch/env.sh through it
exec sbatch "${args[@]}" "$script" "$@"
