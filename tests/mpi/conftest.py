"""Collective tests, run as `mpirun -n 4 python -m pytest -p no:cacheprovider tests/mpi`.

Like mpi4py's own suite: inputs derived from the rank, answers known by formula, every collective
called unconditionally. A failure on one rank aborts the whole job (pytest would otherwise catch
the exception and leave the other ranks blocked in their next collective).
"""

import os
import sys
import tempfile

import pytest
from mpi4py import MPI

from capstone.collective.comm import Comm
from capstone.parallel.grid import Grid


def pytest_configure(config):
    """Only rank 0 reports; other ranks speak on stderr when they fail (see below)."""
    if MPI.COMM_WORLD.Get_rank() != 0:
        sys.stdout = open(os.devnull, "w")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and MPI.COMM_WORLD.Get_size() > 1:
        print(f"\n[rank {MPI.COMM_WORLD.Get_rank()}] {item.nodeid} FAILED ({rep.when}):\n{rep.longreprtext}\n"
              f"[rank {MPI.COMM_WORLD.Get_rank()}] aborting all ranks", file=sys.stderr, flush=True)
        MPI.COMM_WORLD.Abort(1)


@pytest.fixture
def world():
    """The job's ranks as a capstone Comm (a fresh deadline per test)."""
    return Comm(MPI.COMM_WORLD)


@pytest.fixture
def grid(world):
    """Plain data parallelism over the job's ranks."""
    return Grid.build(world)


@pytest.fixture
def shared_tmp(world):
    """A fresh directory made by rank 0 and broadcast to every rank."""
    path = tempfile.mkdtemp(prefix="capstone-test-") if world.rank == 0 else None
    path = world.bcast_json(path)
    yield path
    world.Barrier()
    if world.rank == 0:
        import shutil
        shutil.rmtree(path, ignore_errors=True)
