"""capstone.collective.agree.agreed on the job's ranks: outcomes derived from the rank, answers by
formula, every call made on every rank (each either returns or raises the same error everywhere)."""

import pytest

from capstone.collective.agree import agreed


class Refused(Exception):
    pass


class Broken(Exception):
    pass


def test_rank_0_decides_and_every_rank_gets_its_value(world):
    assert agreed(world, lambda: {"from": world.rank, "n": 7}, errors=(Refused,)) == {"from": 0, "n": 7}


def test_rank_0s_error_is_raised_on_every_rank_with_its_class(world):
    def decide():
        raise Broken(f"rank {world.rank} says no")
    with pytest.raises(Broken, match="^rank 0 says no$"):
        agreed(world, decide, errors=(Refused, Broken))


def test_every_rank_keeps_its_own_value_when_none_failed(world):
    assert agreed(world, lambda: world.rank * 10, errors=(Refused,), every=True) == world.rank * 10


def test_a_failure_on_any_rank_is_raised_on_every_rank(world):
    def attempt():
        if world.rank % 2 == 1:
            raise Refused(f"rank {world.rank} failed")
        return world.rank
    failing = range(1, world.size, 2)
    if not failing:   # one rank: nothing fails
        assert agreed(world, attempt, errors=(Refused,), every=True) == 0
        return
    with pytest.raises(Refused) as raised:
        agreed(world, attempt, errors=(Refused,), every=True)
    assert str(raised.value) == "\n".join(f"rank {r} failed" for r in failing)


def test_explain_makes_the_error_from_every_failing_rank(world):
    def attempt():
        if world.rank >= world.size - 2:
            raise OSError(f"disk of rank {world.rank}")
    with pytest.raises(Broken) as raised:
        agreed(world, attempt, errors=(OSError,), every=True,
               explain=lambda failed: Broken(";".join(f"{r}:{text}" for r, text in failed)))
    assert str(raised.value) == ";".join(f"{r}:disk of rank {r}" for r in range(max(0, world.size - 2), world.size))
