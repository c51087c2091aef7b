#!/usr/bin/env bash
# Submit a training job to Slurm; every argument after `--` goes to cplm_dist.train.
#
#   launch/submit.sh --nodes 2 --gpus-per-node 8 --time 24:00:00 --partition gpu \
#       -- --config configs/runs/cplm-1.7b.yaml optim.lr=1e-3
#   launch/submit.sh --torchrun --nodes 4 --gpus-per-node 8 --time 48:00:00 -- --config configs/runs/cplm-3b.yaml
#   launch/submit.sh --nodes 2 --gpus-per-node 8 --time 24:00:00 --qos high --exclusive --mem=0 \
#       --constraint h100 -- --config configs/runs/cplm-1.7b.yaml      # other sbatch options pass through
#   launch/submit.sh --nodes 1 --tasks-per-node 2 --gpus-per-node 0 --time 00:10:00 --wait -- --config configs/quickstart.yaml
#
# Options: --nodes N, --gpus-per-node G (0 on CPU), --tasks-per-node T (default G, or 1),
# --cpus-per-task C (default: the partition's CPUs per node, from sinfo, / tasks per node; where
# sinfo cannot tell, not set, with a note: Slurm then gives a task 1 CPU; nor with --cpus-per-gpu), --time HH:MM:SS,
# --partition P, --account A, --job-name NAME, --log-dir DIR (default logs/slurm:
# <DIR>/<name>-<jobid>.out), --torchrun, --wait, --dry-run, --max-requeues N (default 3: how often
# the job requeues itself after a crash, a lost or killed rank; passed to the job as
# CPLM_MAX_REQUEUES; 0: never).
# Any other long sbatch option passes through to sbatch as given, `--qos=high` or `--qos high`
# (a word after an option is its value unless it starts with `-`: write `--opt=-x` for such a
# value; a flag such as --exclusive takes none; launch/sbatch_options.sh, shared with
# submit_preprocess.sh). Refused with one line: short options (give the long form), options this
# script sets under its own name (--ntasks-per-node, --output, ...), and --wrap / --array /
# --ntasks, which do not describe this job.
# The job's threads follow --cpus-per-task: launch/env.sh sets OMP_NUM_THREADS from
# SLURM_CPUS_PER_TASK, and each rank's data.num_workers is capped to it less one
# (cplm_dist/data/loader.py).
# Before sbatch (and in --dry-run) the training arguments are checked against the job's size
# (nodes x tasks per node = tp x pp x dp, the batch arithmetic): a layout that cannot run is
# refused with one line instead of failing after its wait in the queue.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/sbatch_options.sh"  # take_sbatch_option: the sbatch options passed through
nodes=1; gpus=""; tasks=""; cpus=""; time_limit=""; partition=""; account=""; name="cplm"
log_dir="logs/slurm"; script="$here/slurm.sbatch"; wait_flag=""; dry_run=""; max_requeues=""; passed=(); cpus_per_gpu=""
usage="usage: launch/submit.sh --nodes N --gpus-per-node G --time HH:MM:SS [--partition P] [--<sbatch option> ...] -- <train args>"
# sbatch options that do not pass through: this script sets them under its own name, or they do
# not describe this job (the one line refusing them)
refused() {
  case "$1" in
    --ntasks-per-node) echo "$1 is set by launch/submit.sh: use --tasks-per-node" ;;
    --output|--error) echo "$1 is set by launch/submit.sh: the log is <--log-dir>/<name>-<jobid>.out, use --log-dir DIR" ;;
    --ntasks) echo "$1 is set by launch/submit.sh: the job's tasks are --nodes x --tasks-per-node" ;;
    --export) echo "$1 is set by launch/submit.sh: the job inherits this environment, export variables before submitting" ;;
    --wrap) echo "$1 does not fit launch/submit.sh: it submits launch/slurm.sbatch (--torchrun: slurm-torchrun.sbatch), not a command" ;;
    --array) echo "$1 does not fit launch/submit.sh: a training run is one job (preprocessing arrays: launch/submit_preprocess.sh)" ;;
  esac
}
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
    --nodes=*|--gpus-per-node=*|--tasks-per-node=*|--cpus-per-task=*|--time=*|--partition=*|--account=*|--job-name=*|--log-dir=*)
      opt=${1%%=*}; set -- "$opt" "${1#*=}" "${@:2}" ;;  # --opt=value: as --opt value
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
    -?*)  # another sbatch option: passed through as given (a short one refused)
      [ "${1%%=*}" != --cpus-per-gpu ] || cpus_per_gpu=1  # sbatch takes it or --cpus-per-task, not both
      take_sbatch_option "$@"; shift "$taken" ;;
    *) echo "error: unexpected argument '$1' before -- (training arguments go after --; $usage)" >&2; exit 2 ;;
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
if [ -z "$cpus" ] && [ -z "$cpus_per_gpu" ]; then
  # the partition's smallest node's CPUs (sinfo's %c, '64+' where its nodes differ) / tasks per node
  node_cpus=$(command -v sinfo >/dev/null && timeout 10 sinfo -h -o '%P %c' ${partition:+-p "$partition"} 2>/dev/null |
    awk -v want="$partition" '(want != "" || $1 ~ /\*$/) {sub(/\+$/, "", $2); if ($2 ~ /^[0-9]+$/ && (m == "" || $2 + 0 < m)) m = $2 + 0}
                                END {print m}' || true)
  if [ -n "$node_cpus" ]; then
    cpus=$((node_cpus / tasks > 0 ? node_cpus / tasks : 1))
  else
    echo "note: --cpus-per-task not set: sinfo could not tell the CPUs of a node${partition:+ of partition $partition}, so Slurm gives each task 1 CPU; pass --cpus-per-task C (a node's cores / tasks per node)" >&2
  fi
fi
[ -n "$cpus" ] && args+=(--cpus-per-task "$cpus")
[ -n "$partition" ] && args+=(--partition "$partition")
[ -n "$account" ] && args+=(--account "$account")
[ -n "$wait_flag" ] && args+=("$wait_flag")
args+=(${passed[@]+"${passed[@]}"})  # the sbatch options given beyond this script's own
# the job inherits this environment (CPLM_ROOT, CPLM_PROCS_PER_NODE) and this one variable on top
[ -n "$max_requeues" ] && args+=(--export "ALL,CPLM_MAX_REQUEUES=$max_requeues")
if [ -n "$dry_run" ]; then
  printf '%q ' sbatch "${args[@]}" "$script" "$@"; echo
  exit 0
fi
mkdir -p "$log_dir"
export CPLM_ROOT="$(dirname "$here")"  # the job finds launch/env.sh through it
exec sbatch "${args[@]}" "$script" "$@"
