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
# More ranks than cores is fine for this small model (e.g. 4 ranks on a 2-core laptop).
MPIRUN=(mpirun --oversubscribe)
