# Requeue bookkeeping of launch/slurm.sbatch and launch/slurm-torchrun.sbatch (sourced by both).
#
# A job is requeued for two reasons, counted apart:
#   planned  the time limit's SIGUSR1 (#SBATCH --signal=B:USR1@300) or a SIGTERM (preemption,
#            scancel --signal=TERM): the ranks save, the job is requeued and resumes. Not limited:
#            a 4-day run in 24-hour jobs is a chain of planned requeues.
#   crash    a failed step, a lost or killed rank (exit 1, 4, >= 128), or a requeue Slurm made by
#            itself (a node failure): at most CPLM_MAX_REQUEUES (default 3) over the job's life.
# SLURM_RESTART_COUNT counts both. Every planned requeue writes a line into the job's requeue log,
#     ${CPLM_REQUEUE_DIR:-<the submit directory>/.cplm-requeues}/job-<SLURM_JOB_ID>
#     planned <restart> <signal> <UTC time>       (crash requeues add "crash <restart> <exit code> <time>")
# and the crash requeues so far are SLURM_RESTART_COUNT minus the restarts that wrote a planned
# line. So a requeue nothing recorded (Slurm's own, a log that could not be written) counts as a
# crash: where the log is lost, the bound is the old one, every requeue counted. The job id stays
# across requeues, so the log is the job's; a new sbatch starts a new one.

requeue_log() { echo "${CPLM_REQUEUE_DIR:-.cplm-requeues}/job-${SLURM_JOB_ID:-unknown}"; }

# note_requeue KIND DETAIL: one line in the job's requeue log (a warning where it cannot be written)
note_requeue() {
  local log; log=$(requeue_log)
  if ! { mkdir -p "$(dirname "$log")" && echo "$1 ${SLURM_RESTART_COUNT:-0} $2 $(date -u +%Y-%m-%dT%H:%M:%SZ)" >>"$log"; } 2>/dev/null; then
    echo "[slurm] cannot write the requeue log $log: this requeue will count as a crash (CPLM_MAX_REQUEUES)"
  fi
}

# planned_requeues: the earlier restarts of this job that a planned requeue made
planned_requeues() {
  local log; log=$(requeue_log)
  [ -r "$log" ] || { echo 0; return 0; }
  awk -v now="${SLURM_RESTART_COUNT:-0}" '$1 == "planned" && $2 + 0 < now + 0 { print $2 }' "$log" | sort -u | wc -l | tr -d ' '
}

# crash_requeues: the requeues of this job so far that were not planned
crash_requeues() {
  local n=$(( ${SLURM_RESTART_COUNT:-0} - $(planned_requeues) ))
  if [ "$n" -lt 0 ]; then n=0; fi
  echo "$n"
}

# after_training RC: requeue the job after a crash (exit 1, 4 or >= 128) while the crash budget
# lasts, then exit; usage errors (2) and non-finite steps (3) end the job: they need a person
after_training() {
  local rc=$1 crashes planned max=${CPLM_MAX_REQUEUES:-3}
  if [ "$rc" = 1 ] || [ "$rc" = 4 ] || [ "$rc" -ge 128 ]; then
    crashes=$(crash_requeues); planned=$(planned_requeues)
    if [ "$crashes" -lt "$max" ]; then
      echo "[slurm] training ended with exit $rc (a failed step, a lost rank or host): requeueing job $SLURM_JOB_ID (restart $((crashes + 1)) of at most $max) after a crash; $planned planned requeues (time limit, preemption) before it do not count; it resumes from the newest intact checkpoint"
      note_requeue crash "$rc"
      trap "" USR1 TERM  # the requeue's own SIGTERM is not a planned requeue
      scontrol requeue "$SLURM_JOB_ID" && exit 0
    else
      echo "[slurm] training ended with exit $rc: not requeued, the job's $crashes crash requeues reached CPLM_MAX_REQUEUES=$max ($planned planned requeues not counted); see the log above, then resubmit (the run continues with --resume auto)"
    fi
  fi
  exit "$rc"
}
