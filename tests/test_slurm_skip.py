"""The Slurm suite's own skip obeys CAPSTONE_REQUIRE_SLURM (CI requires the Slurm tests to run)."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT, mpi_env


@pytest.mark.parametrize("module", ["test_slurm.py", "test_slurm_nodes.py"])
@pytest.mark.parametrize("require", [False, True])
def test_slurm_suite_under_mpi_fails_when_slurm_is_required(require, module):
    """tests/test_slurm.py and test_slurm_nodes.py refuse to run under mpirun with a module-level skip; with
    CAPSTONE_REQUIRE_SLURM=1 (CI) that must be a failure, not 'no tests ran'."""
    env = {k: v for k, v in mpi_env().items() if k != "CAPSTONE_REQUIRE_SLURM"}
    env["OMPI_COMM_WORLD_SIZE"] = "2"  # what mpirun sets: the module is never run for real here
    if require:
        env["CAPSTONE_REQUIRE_SLURM"] = "1"
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--color=no",
                          os.path.join(ROOT, "tests", module)], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=120)
    if require:
        assert res.returncode not in (0, 5) and "CAPSTONE_REQUIRE_SLURM=1" in res.stdout, res.stdout
    else:
        assert res.returncode in (0, 5) and "1 skipped" in res.stdout, res.stdout  # 5: pytest's 'no tests ran'
