# Sourced by the batch scripts: run the training step, forward SIGUSR1 to it, requeue after a
# preemption checkpoint. One copy of the signal/requeue logic for every batch script.
#   run_step RUN_DIR PYTHON COMMAND...   -> exits the batch script with the step's status
# bash runs a trap only between commands, and `wait` is interruptible while a foreground srun is
# not: so the step runs in the background and this shell waits for it in a loop.
# Environment: CAPSTONE_REQUEUE (1: requeue after a preemption checkpoint; 0: just exit 0),
# CAPSTONE_MAX_REQUEUES (default 20).

step_log() { echo "[capstone.sbatch $(date +%H:%M:%S)] $*"; }

run_step() {
  local run_dir="$1" python="$2"; shift 2
  local signalled=0 step_pid="" rc=0 status restarts
  # shellcheck disable=SC2317  # called by the trap
  on_usr1() {
    signalled=1
    step_log "SIGUSR1 (time limit near or preemption): asking the job step to checkpoint and stop"
    if [[ -n "$step_pid" ]]; then kill -USR1 "$step_pid" 2>/dev/null || true; fi
  }
  trap on_usr1 USR1
  "$@" &
  step_pid=$!
  while kill -0 "$step_pid" 2>/dev/null; do
    wait "$step_pid" || true       # returns early (status > 128) when a trap ran
  done
  wait "$step_pid" || rc=$?        # bash keeps the exit status of the finished step
  trap - USR1
  step_log "job step exited with status $rc"
  status="$("$python" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("status",""))' \
    "$run_dir/summary.json" 2>/dev/null || true)"
  step_log "summary status: ${status:-<no summary.json>}"
  if [[ $rc -eq 0 && "$status" == preempted ]]; then
    restarts="${SLURM_RESTART_COUNT:-0}"
    if [[ "${CAPSTONE_REQUEUE:-1}" == 1 && $restarts -lt ${CAPSTONE_MAX_REQUEUES:-20} ]]; then
      step_log "checkpointed; requeueing job $SLURM_JOB_ID (restart $((restarts + 1))) to resume from $run_dir/checkpoints/latest"
      if scontrol requeue "$SLURM_JOB_ID"; then
        exit 0   # Slurm ends this run and queues the job again; the next run resumes
      fi
      step_log "scontrol requeue failed"
    fi
    step_log "checkpointed; to resume: CAPSTONE_RUN_DIR=$run_dir sbatch <this script> [same flags]"
    exit 0
  fi
  if [[ $rc -eq 0 && $signalled -eq 1 && "$status" != completed ]]; then
    step_log "warning: signalled, exit status 0, but summary status is '${status:-none}'"
  fi
  exit "$rc"
}
