"""Rank placement over hosts (capstone.parallel.placement; refused by capstone.plan.Plan.check_placement), without MPI: the verdict every rank
reaches from the same list of host names. On a real multi-node Slurm: tests/test_slurm_nodes.py."""

import pytest

from capstone.config import ConfigError
from capstone.parallel import placement
from capstone.plan import Plan


def check(hosts: list[str], pp: int, tp: int) -> None:
    Plan(world=len(hosts), pp=pp, tp=tp).check_placement(hosts)


def test_block_placement_keeps_each_tp_group_on_one_host():
    hosts = ["h1", "h1", "h2", "h2", "h3", "h3", "h4", "h4"]
    check(hosts, pp=2, tp=2)
    assert placement.describe(hosts, pp=2, tp=2) == (
        "h1: ranks 0-1 = [dp0 pp0 tp0-1]; h2: ranks 2-3 = [dp0 pp1 tp0-1]; "
        "h3: ranks 4-5 = [dp1 pp0 tp0-1]; h4: ranks 6-7 = [dp1 pp1 tp0-1]")
    assert placement.describe(["a"] * 4, pp=2, tp=2) == "a: ranks 0-3 = [dp0 pp0 tp0-1] [dp0 pp1 tp0-1]"


def test_a_cyclic_placement_that_splits_a_tp_group_is_refused_with_the_reason():
    with pytest.raises(ConfigError) as err:
        check(["h1", "h2", "h1", "h2"], pp=1, tp=2)
    text = str(err.value)
    assert ("--tp 2: the tensor-parallel group of ranks 0-1 (dp 0, pp 0) is split over 2 hosts "
            "(rank 0 on h1, rank 1 on h2)") in text
    assert "srun --distribution=block" in text and "multiple of 2 tasks per node" in text
    with pytest.raises(ConfigError, match="ranks 4-7 .dp 1, pp 0. is split"):
        check(["a"] * 4 + ["b", "b", "c", "c"], pp=1, tp=4)


def test_without_tensor_parallelism_any_placement_runs():
    check(["h1", "h2", "h1", "h2"], pp=2, tp=1)
    assert placement.describe(["h1", "h2", "h1", "h2"], pp=2, tp=1) == \
        "h1: ranks 0,2 = [dp0 pp0 tp0] [dp1 pp0 tp0]; h2: ranks 1,3 = [dp0 pp1 tp0] [dp1 pp1 tp0]"
