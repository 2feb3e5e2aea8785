# Sourced by the scripts: the venv and the per-rank environment of capstone runs.
CAPSTONE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CAPSTONE_VENV="${CAPSTONE_VENV:-$CAPSTONE_ROOT/.venv}"
# shellcheck disable=SC1091
source "$CAPSTONE_VENV/bin/activate"
export PYTHONPATH="$CAPSTONE_ROOT${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
if [[ $(id -u) -eq 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# Ctrl-C or `kill <mpirun pid>`: mpirun sends the ranks SIGCONT at once, SIGTERM after this many
# seconds and SIGKILL after as many again (Open MPI's default is 1). The ranks take the SIGCONT as
# a stop request (capstone/stop.py), so 3 gives a run ~6 s to finish its step and save a
# checkpoint. The price: mpirun sleeps through that sequence whenever a job ends abnormally, so a
# failed or interrupted job returns later (measured: a refused start 1.9 s -> 6.0 s). Raise it for
# steps longer than a few seconds, or stop such runs with `kill -USR1 <mpirun pid>` (no deadline).
export OMPI_MCA_odls_base_sigkill_timeout="${OMPI_MCA_odls_base_sigkill_timeout:-3}"
# More ranks than cores is fine for this small model (e.g. 4 ranks on a 2-core laptop).
MPIRUN=(mpirun --oversubscribe)
