# Sourced by the batch scripts and scripts/launch: start the job around the training step. What the
# job decides (its switches, the run directory and its one-run rule, the --out check, forwarding a
# stop request, ending a step that lingers after a collective timeout, reading how the step ended,
# requeueing) is capstone/runtime/job.py, tested Python; here only how it is started.
#   run_step RUN_DIR PYTHON COMMAND...   -> the job becomes this shell (exec): it gets the batch
#                                           shell's signals (Slurm's --signal=B:USR1) and its exit
#                                           status is the step's
#   make_run_dir DIR                     -> exits 2 (with the reason) if the job must not use DIR
# Environment: CAPSTONE_REQUEUE, CAPSTONE_MAX_REQUEUES, CAPSTONE_ABORT_GRACE, CAPSTONE_SIGNAL_SETTLE
# (capstone/runtime/job.py says each; a bad value: exit 2 before the step starts).
# Sourcing it puts the repository (two levels above this file) first on PYTHONPATH, for the job and the ranks.

export PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"

run_step() {
  local run_dir="$1" python="$2"; shift 2
  # ignored until Python's handler is in place (an ignored signal stays so across exec; a default
  # one would kill the job as it starts)
  trap '' USR1
  [[ -n "${CAPSTONE_PLAIN_MPIRUN:-}" ]] && trap '' INT   # scripts/launch: Python catches it from then on
  exec "$python" -m capstone.runtime.job "$run_dir" "$@"
}

make_run_dir() {
  "${PYTHON:-python3}" -m capstone.runtime.job make-run-dir "$1" || exit $?
}
