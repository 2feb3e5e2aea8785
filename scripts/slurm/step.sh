# Sourced by the batch scripts: run the training step, forward SIGUSR1 to it, requeue after a
# preemption checkpoint. One copy of the signal/requeue logic for every batch script.
#   run_step RUN_DIR PYTHON COMMAND...   -> exits the batch script with the step's status
# bash runs a trap only between commands, and `wait` is interruptible while a foreground srun is
# not: so the step runs in the background and this shell waits for it in a loop.
# A collective timeout (a rank writes RUN_DIR/collective-timeout.json, capstone/collective/deadline.py, then
# aborts): if the step is still running CAPSTONE_ABORT_GRACE seconds later (mpirun waiting for an
# unreachable node's daemon, srun for a lost node's slurmstepd: docs/multinode.md), this script
# ends it; then, with a checkpoint to
# resume from, it requeues the job like a preemption (the node is probably bad: see the note printed).
# Environment: CAPSTONE_REQUEUE (1: requeue after a preemption checkpoint or a collective timeout;
# 0: just exit), CAPSTONE_MAX_REQUEUES (default 20), CAPSTONE_ABORT_GRACE (default 3) (other values: exit 2),
# CAPSTONE_SIGNAL_SETTLE (default 3000: a stop request is forwarded once the step is this many ms old).

step_log() { echo "[capstone.sbatch $(date +%H:%M:%S)] $*"; }

run_step() {
  local run_dir="$1" python="$2"; shift 2
  local signalled=0 pending=0 step_pid="" launched=0 rc=0 status restarts
  # shellcheck disable=SC2317  # called by the trap
  on_usr1() {
    signalled=1
    step_log "SIGUSR1 (time limit near or preemption): asking the job step to checkpoint and stop"
    pending=1
    forward_usr1
  }
  # A request that comes before the step is CAPSTONE_SIGNAL_SETTLE ms old waits for that age (the wait
  # loop forwards it): one that lands before `setsid` or the launcher has exec'd kills that process
  # (138), Open MPI's mpirun drops one in its first moments (the run goes on), and a rank not yet
  # started would die of one (a requeued job can be warned of its time limit as it starts).
  local settle="${CAPSTONE_SIGNAL_SETTLE:-3000}"
  if [[ ! "$settle" =~ ^[0-9]+$ ]]; then
    step_log "warning: CAPSTONE_SIGNAL_SETTLE='$settle' is not a number of milliseconds; using 3000"
    settle=3000
  fi
  refuse_bad_switches
  refuse_another_out "$run_dir" "$@"
  # shellcheck disable=SC2317  # called by the trap and the wait loop
  forward_usr1() {
    if (( pending )) && [[ -n "$step_pid" ]] && (( ($(date +%s%N) - launched) / 1000000 >= settle )); then
      pending=0
      kill -USR1 "$step_pid" 2>/dev/null || true
    fi
  }
  # shellcheck disable=SC2317  # called by the trap
  on_int() {   # scripts/launch: a Ctrl-C reaches only this script (the job runs in its own session)
    interrupts=$((interrupts + 1))
    if [[ $interrupts -eq 1 ]]; then
      step_log "Ctrl-C: asking the job to checkpoint and stop (SIGUSR1 to mpirun, no deadline); a second Ctrl-C ends it without saving"
      on_usr1 >/dev/null
    else
      step_log "second Ctrl-C: ending the job without saving (SIGINT to mpirun)"
      pending=0
      kill -INT "$step_pid" 2>/dev/null || true
    fi
  }
  trap on_usr1 USR1
  local started timed_out="" interrupts=0
  started="$(date +%s)" launched="$(date +%s%N)"
  if [[ -n "${CAPSTONE_PLAIN_MPIRUN:-}" ]]; then
    # Open MPI's mpirun meets a Ctrl-C with its kill sequence (SIGKILL 2 x odls_base_sigkill_timeout
    # later, 2 s by default) but forwards SIGUSR1 with none: so mpirun gets a session of its own,
    # out of the terminal's Ctrl-C, and this script turns a Ctrl-C into SIGUSR1.
    trap on_int INT
    setsid "$@" &
  else
    "$@" &
  fi
  step_pid=$!
  while kill -0 "$step_pid" 2>/dev/null; do
    sleep 1 &
    wait $! || true                # returns early (status > 128) when a trap ran
    forward_usr1
    timed_out="$(timeout_record "$run_dir" "$started")"
    [[ -n "$timed_out" ]] && stop_lingering_step "$step_pid" "$timed_out"
  done
  wait "$step_pid" || rc=$?        # bash keeps the exit status of the finished step
  # The time limit's warning can land as the step ends (a requeued job's fresh limit included): with
  # the default action it would kill this shell (exit 138) and fail a job that has finished.
  trap 'step_log "SIGUSR1 after the job step ended: nothing left to stop"' USR1
  trap - INT
  step_log "job step exited with status $rc"
  timed_out="$(timeout_record "$run_dir" "$started")"
  if [[ $rc -ne 0 && -n "$timed_out" ]]; then
    requeue_after_timeout "$run_dir" "$timed_out"
  fi
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
    elif [[ "${CAPSTONE_REQUEUE:-1}" == 1 ]]; then
      step_log "not requeueing: job $SLURM_JOB_ID has been requeued $restarts times," \
               "CAPSTONE_MAX_REQUEUES=${CAPSTONE_MAX_REQUEUES:-20}"
    fi
    step_log "checkpointed; to resume: $(resume_hint "$run_dir")"
    exit 0
  fi
  if [[ $rc -eq 0 && $signalled -eq 1 && "$status" != completed ]]; then
    step_log "warning: signalled, exit status 0, but summary status is '${status:-none}'"
  fi
  exit "$rc"
}

# A mistyped switch would silently change what happens after a preemption (CAPSTONE_REQUEUE=yes or
# CAPSTONE_MAX_REQUEUES=ten: no requeue, the job just ends): exit 2 before the step starts.
refuse_bad_switches() {
  local var
  if [[ -n "${CAPSTONE_REQUEUE:-}" && ! "$CAPSTONE_REQUEUE" =~ ^[01]$ ]]; then
    step_log "error: CAPSTONE_REQUEUE='$CAPSTONE_REQUEUE': it must be 1 (requeue after a preemption checkpoint," \
             "the default) or 0 (just exit): unset it or set 0 or 1, and submit again"
    exit 2
  fi
  for var in CAPSTONE_MAX_REQUEUES CAPSTONE_ABORT_GRACE; do
    if [[ -n "${!var:-}" && ! "${!var}" =~ ^[0-9]+$ ]]; then
      step_log "error: $var='${!var}': it must be a whole number (of requeues / seconds): unset it for the" \
               "default or set a number, and submit again"
      exit 2
    fi
  done
}

# The run directory this script watches (summary.json, collective-timeout.json) must be the one the
# job writes: a second --out (`sbatch capstone.sbatch --out X`, whose last --out wins) trained in X,
# and a preemption then found no summary.json here and ended the job without requeueing it.
#   refuse_another_out RUN_DIR COMMAND...   -> exit 2 unless COMMAND's --out is RUN_DIR
refuse_another_out() {
  local run_dir="$1"; shift
  local arg out="" expect=0 train=0
  for arg in "$@"; do
    if (( expect )); then out="$arg"; expect=0; fi
    case "$arg" in --out) expect=1 ;; --out=*) out="${arg#--out=}" ;; capstone.train) train=1 ;; esac
  done
  if (( train )) && [[ -z "$out" ]]; then   # scripts/launch DIR mpirun ... (no --out: runs/run-<time>)
    step_log "error: no --out in the command: capstone.train would write to runs/run-<time>, not to the run" \
             "directory $run_dir that this script watches: add --out $run_dir"
    exit 2
  fi
  if [[ -n "$out" && "$(realpath -m -- "$out")" != "$(realpath -m -- "$run_dir")" ]]; then
    step_log "error: the job's --out $out is not the run directory $run_dir that this script watches: give" \
             "the run directory once, as CAPSTONE_RUN_DIR=DIR before sbatch (the batch scripts pass --out" \
             "themselves), or as scripts/launch DIR ... --out DIR"
    exit 2
  fi
}

# The batch scripts' run directory: made (exit 2 naming CAPSTONE_RUN_DIR if it cannot be), and refused
# (exit 2) when it is the default one of a job's first start and already holds a run: an earlier job
# with the same id (another cluster on this filesystem, or job ids started again) wrote it, and
# --resume auto would continue it (or find it finished and do nothing, COMPLETED). Requeues
# (SLURM_RESTART_COUNT >= 1) find their own.   make_run_dir DIR
make_run_dir() {
  local dir="$1" made
  if [[ -z "${CAPSTONE_RUN_DIR:-}" && "${SLURM_RESTART_COUNT:-0}" == 0 && -n "$(ls -A "$dir" 2>/dev/null)" ]]; then
    step_log "error: $dir already holds a run, but this is the first start of job $SLURM_JOB_ID: an earlier job" \
             "with the same id wrote it (another cluster, or job ids started again). Move it away and submit" \
             "again, or continue that run on purpose with CAPSTONE_RUN_DIR=$dir sbatch ..."
    exit 2
  fi
  if ! made="$(mkdir -p -- "$dir" 2>&1)"; then   # a file there, no permission, a missing mount
    step_log "error: cannot create the run directory $dir (${made#mkdir: }): set CAPSTONE_RUN_DIR to a" \
             "directory this job can write, on a filesystem every node sees, and submit again"
    exit 2
  fi
}

# RUN_DIR/collective-timeout.json if a rank wrote it during this step (since STARTED), else nothing.
timeout_record() {
  local record="$1/collective-timeout.json"
  [[ -f "$record" && $(stat -c %Y "$record") -ge $2 ]] && echo "$record"
  return 0
}

# The ranks gave up on a collective and aborted; if the step outlives them by the grace period,
# end it (SIGTERM, then SIGKILL 2 s later): mpirun would wait for the lost node's daemon for many
# minutes, srun for its slurmstepd until Slurm's KillWait (30 s by default) has passed.
stop_lingering_step() {
  local pid="$1" record="$2" age _
  age=$(( $(date +%s) - $(stat -c %Y "$record") ))
  (( age >= ${CAPSTONE_ABORT_GRACE:-3} )) || return 0
  step_log "a rank's collective timed out ${age} s ago and the job step is still running (waiting for an" \
           "unreachable node): ending it. $(cat "$record" 2>/dev/null)"
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
  for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
}

# After a collective timeout: requeue to resume from the last checkpoint (Slurm may pick the same
# node again; exclude it, or have the node drained, if it is faulty).
requeue_after_timeout() {
  local run_dir="$1" record="$2" restarts="${SLURM_RESTART_COUNT:-0}"
  step_log "the job step ended after a collective timeout: $(cat "$record" 2>/dev/null)"
  if [[ ! -e "$run_dir/checkpoints/latest" ]]; then
    step_log "no checkpoint to resume from; not requeueing"
    return 0
  fi
  if [[ -n "${SLURM_JOB_ID:-}" && "${CAPSTONE_REQUEUE:-1}" == 1 && $restarts -lt ${CAPSTONE_MAX_REQUEUES:-20} ]]; then
    step_log "requeueing job $SLURM_JOB_ID (restart $((restarts + 1))) to resume from $run_dir/checkpoints/latest;" \
             "if a node is faulty, drain it (scontrol update nodename=NODE state=drain reason=...)"
    if scontrol requeue "$SLURM_JOB_ID"; then
      exit 0
    fi
    step_log "scontrol requeue failed"
  fi
  step_log "to resume: $(resume_hint "$run_dir")"
}

# How to go on from the run's last checkpoint: a batch script resubmitted, or (scripts/launch, no
# Slurm) the same mpirun command with --resume auto.
resume_hint() {
  if [[ -n "${SLURM_JOB_ID:-}" || -z "${CAPSTONE_PLAIN_MPIRUN:-}" ]]; then
    echo "CAPSTONE_RUN_DIR=$1 sbatch <this script> [same flags]"
  else
    echo "rerun the same mpirun command with --resume auto (run directory $1)"
  fi
}
