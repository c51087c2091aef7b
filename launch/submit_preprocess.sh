#!/usr/bin/env bash
# Submit preprocessing as a Slurm array, one task a partition; every argument after `--` goes to
# tools/preprocess_data.py (its --partition and --workers are the array's).
#
#   launch/submit_preprocess.sh --parts 64 --max-running 16 --cpus-per-task 32 --time 04:00:00 --partition cpu \
#       --merge -- --input /data/raw/ --tokenizer data/tok.model --output-prefix /data/web --dedup exact
#
# Options: --parts N (array tasks, partitions), --max-running M (at most M tasks at once), --cpus-per-task C
# (each task's --workers), --mem M, --time HH:MM:SS, --partition P, --account A, --qos Q, --job-name NAME,
# --log-dir DIR (default logs/slurm: <DIR>/<name>-<jobid>_<task>.out), --merge (a job after the array
# that merges the parts into --output-prefix: tools/merge_data.py), --wait, --dry-run (print the sbatch
# commands). Before sbatch (and in --dry-run) the inputs are resolved and cut into the N parts
# (preprocess_data.py --check): missing inputs, fewer files than parts or a bad tokenizer are one
# line and exit 2 before anything queues.
# Any other long sbatch option passes through as launch/submit.sh passes it (`--constraint cpu`,
# `--exclusive`, `--reservation=R`: launch/sbatch_options.sh), to the array and to the merge job
# alike, but for --dependency (the array's only: the merge waits for the array). Refused with one
# line: short options (give the long form), and the options this script sets itself (--array,
# --ntasks, --output, ...) or that do not describe its jobs (--wrap, --cpus-per-gpu).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/sbatch_options.sh"  # take_sbatch_option: the sbatch options passed through
parts=""; max_running=""; cpus=1; mem=""; time_limit=""; partition=""; account=""; qos=""; name="cplm-preprocess"
log_dir="logs/slurm"; merge=""; wait_flag=""; dry_run=""; passed=(); merge_passed=()
usage="usage: launch/submit_preprocess.sh --parts N --time HH:MM:SS [--cpus-per-task C] [--merge] [--<sbatch option> ...] -- <preprocess args>"
# sbatch options that do not pass through: this script sets them, or they do not describe its jobs
refused() {
  case "$1" in
    --array) echo "$1 is set by launch/submit_preprocess.sh: use --parts N (and --max-running M)" ;;
    --ntasks|--ntasks-per-node) echo "$1 is set by launch/submit_preprocess.sh: each array task is one process of --cpus-per-task workers" ;;
    --output|--error) echo "$1 is set by launch/submit_preprocess.sh: the logs are <--log-dir>/<name>-<jobid>_<task>.out, use --log-dir DIR" ;;
    --export) echo "$1 is set by launch/submit_preprocess.sh: the jobs inherit this environment, export variables before submitting" ;;
    --cpus-per-gpu) echo "$1 does not fit launch/submit_preprocess.sh: a task's CPUs are --cpus-per-task (its workers)" ;;
    --wrap) echo "$1 does not fit launch/submit_preprocess.sh: it submits launch/preprocess.sbatch (and --merge's job)" ;;
  esac
}
while [ $# -gt 0 ]; do
  case "$1" in
    --parts=*|--max-running=*|--cpus-per-task=*|--mem=*|--time=*|--partition=*|--account=*|--qos=*|--job-name=*|--log-dir=*)
      opt=${1%%=*}; set -- "$opt" "${1#*=}" "${@:2}" ;;  # --opt=value: as --opt value
    --parts) parts=$2; shift 2 ;;
    --max-running) max_running=$2; shift 2 ;;
    --cpus-per-task) cpus=$2; shift 2 ;;
    --mem) mem=$2; shift 2 ;;
    --time) time_limit=$2; shift 2 ;;
    --partition) partition=$2; shift 2 ;;
    --account) account=$2; shift 2 ;;
    --qos) qos=$2; shift 2 ;;
    --job-name) name=$2; shift 2 ;;
    --log-dir) log_dir=$2; shift 2 ;;
    --merge) merge=1; shift ;;
    --wait) wait_flag="--wait"; shift ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; break ;;
    -h|--help) echo "$usage"; exit 0 ;;
    -?*)  # another sbatch option: passed through as given (a short one refused)
      take_sbatch_option "$@"
      [ "${1%%=*}" = --dependency ] || merge_passed+=("${@:1:$taken}")
      shift "$taken" ;;
    *) echo "error: unexpected argument '$1' before -- (preprocessing arguments go after --; $usage)" >&2; exit 2 ;;
  esac
done
[[ "$parts" =~ ^[1-9][0-9]*$ ]] || { echo "error: --parts N is required, a whole number >= 1 (the array's tasks)" >&2; exit 2; }
[[ "$cpus" =~ ^[1-9][0-9]*$ ]] || { echo "error: --cpus-per-task '$cpus' must be a whole number >= 1" >&2; exit 2; }
[ -z "$max_running" ] || [[ "$max_running" =~ ^[1-9][0-9]*$ ]] || { echo "error: --max-running '$max_running' must be a whole number >= 1" >&2; exit 2; }
[ -n "$time_limit" ] || { echo "error: --time HH:MM:SS is required (a task's limit; a task cut off continues when requeued)" >&2; exit 2; }
[ $# -gt 0 ] || { echo "error: give the preprocessing arguments after --, e.g. -- --input raw/ --tokenizer tok.model --output-prefix data/web" >&2; exit 2; }
for a in "$@"; do
  case "$a" in --partition|--partition=*|--workers|--workers=*)
    echo "error: $a is set by the array (task I of --parts N, --cpus-per-task workers): drop it after --" >&2; exit 2 ;;
  esac
done
root="$(dirname "$here")"
python=${PYTHON:-$([ -x "$root/.venv/bin/python" ] && echo "$root/.venv/bin/python" || echo python3)}
"$python" -m cplm_dist_tools.preprocess_data --check --partition "0/$parts" "$@" >&2 || exit 2
array="0-$((parts - 1))${max_running:+%$max_running}"
args=(--job-name "$name" --array "$array" --ntasks 1 --cpus-per-task "$cpus" --time "$time_limit"
      --output "$log_dir/%x-%A_%a.out")
for opt in mem:"$mem" partition:"$partition" account:"$account" qos:"$qos"; do
  [ -n "${opt#*:}" ] && args+=("--${opt%%:*}" "${opt#*:}")
done
args+=(${passed[@]+"${passed[@]}"})  # the sbatch options given beyond this script's own
prefix=""; dedup=(); prev=""
for a in "$@"; do
  case "$prev" in --output-prefix) prefix=$a ;; --dedup) dedup=(--dedup "$a") ;; esac
  case "$a" in --output-prefix=*) prefix=${a#*=} ;; --dedup=*) dedup=(--dedup "${a#*=}") ;; esac
  prev=$a
done
merge_cmd=("$python" -m cplm_dist_tools.merge_data --inputs "$prefix-*-of-$(printf '%05d' "$parts")" --output-prefix "$prefix" "${dedup[@]}")
# a task that failed for good leaves the merge's dependency unmet: the merge is then cancelled, not left pending
merge_args=(--job-name "$name-merge" --ntasks 1 --cpus-per-task 1 --time "$time_limit" --output "$log_dir/%x-%j.out"
            --kill-on-invalid-dep=yes)
for opt in partition:"$partition" account:"$account" qos:"$qos"; do
  [ -n "${opt#*:}" ] && merge_args+=("--${opt%%:*}" "${opt#*:}")
done
merge_args+=(${merge_passed[@]+"${merge_passed[@]}"})
if [ -n "$dry_run" ]; then
  printf '%q ' sbatch "${args[@]}" ${wait_flag:+"$wait_flag"} "$here/preprocess.sbatch" "$@"; echo
  [ -n "$merge" ] && { printf '%q ' sbatch "${merge_args[@]}" --dependency "afterok:<array job>" --wrap "$(printf '%q ' "${merge_cmd[@]}")"; echo; }
  exit 0
fi
mkdir -p "$log_dir"
export CPLM_ROOT="$root"
if [ -z "$merge" ]; then
  exec sbatch "${args[@]}" ${wait_flag:+"$wait_flag"} "$here/preprocess.sbatch" "$@"
fi
job=$(sbatch --parsable "${args[@]}" "$here/preprocess.sbatch" "$@")
echo "Submitted array job $job ($parts tasks)"
exec sbatch "${merge_args[@]}" ${wait_flag:+"$wait_flag"} --dependency "afterok:${job%%;*}" --wrap "$(printf '%q ' "${merge_cmd[@]}")"
