"""Pipeline parallelism beyond the composition matrix (which proves its numbers against the 1-rank
run): each schedule's order of forwards and backwards on every rank, the activations each holds
(1F1B at most p micro-batches per stage, AFAB all m), the stage split and its refusals, and a
kill -9 mid-run resumed bit-identically on the same grid and on another.
"""

import pytest

from benchmarks import memory as meter
from benchmarks import pipeline as bench
from capstone.config import ConfigError, ModelConfig, TrainConfig
from capstone.parallel.pipeline import order
from capstone.plan import Plan, stage_layers

from conftest import by_step, kill_a_rank_after_checkpoint, mpirun, summary

MIB = 1 << 20


@pytest.mark.parametrize("K, m", [(2, 1), (2, 4), (4, 8), (3, 2)])
def test_schedule_orders(K, m):
    for p in range(K):
        for schedule in ("1f1b", "afab"):
            seq = order(schedule, p, K, m)
            assert sorted(seq) == sorted([("F", j) for j in range(m)] + [("B", j) for j in range(m)])
            live, peak = set(), 0
            for kind, j in seq:                        # a backward after its forward; activations in flight
                assert (kind == "F") == (j not in live), (schedule, p, seq)
                live ^= {j}
                peak = max(peak, len(live))
            assert peak == (min(K - p, m) if schedule == "1f1b" else m), (schedule, p, peak)
    assert order("1f1b", 0, 2, 3) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    assert order("1f1b", 1, 2, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert order("afab", 1, 2, 3) == [("F", 0), ("F", 1), ("F", 2), ("B", 2), ("B", 1), ("B", 0)]


def test_stage_split():
    assert [list(r) for r in stage_layers(7, 3)] == [[0, 1, 2], [3, 4], [5, 6]]
    plan, _ = Plan.make(model=ModelConfig(n_layers=4), train=TrainConfig(), world=2, given={"pp": 2})
    assert plan.stages == (("embed", "h0", "h1"), ("h2", "h3", "head"))
    assert [list(r) for r in stage_layers(7, 3, (3, 3, 1))] == [[0, 1, 2], [3, 4, 5], [6]]   # a light last stage
    for bad in ((3, 3), (4, 3, 0), (2, 2, 2)):
        with pytest.raises(ConfigError, match="add up to the model's 7 blocks"):
            stage_layers(7, 3, bad)
    with pytest.raises(ConfigError, match=r"Use --pp <= 2 \(or, for a model built here, not --init-from, more "):
        Plan.make(model=ModelConfig(n_layers=2), train=TrainConfig(), world=4, given={"pp": 4})   # a fine-tune's
    # model is given: --n-layers alone is wrong


@pytest.mark.parametrize("schedule", ["1f1b", "afab"])
def test_every_rank_runs_its_schedule_in_a_real_run(schedule):
    """pp 4 x dp 2 on 8 ranks, 6 micro-batches: each rank's recorded events are its stage's order."""
    res = bench.launch(8, ["--n-layers", 4, "--pp", 4, "--pp-schedule", schedule, "--grad-accum", 6, "--steps", 2,
                           "--global-batch", 48], timeout=300)
    for ranks in res["steps"]:
        assert sorted((r["stage"], r["dp"]) for r in ranks) == [(p, d) for p in range(4) for d in range(2)]
        for r in ranks:
            assert [tuple(e[:2]) for e in r["events"]] == order(schedule, r["stage"], 4, 6), (schedule, r["stage"])


@pytest.fixture(scope="module")
def activations():
    """The forward/backward peak of allocated bytes above the step's start on each rank (tracemalloc:
    benchmarks/memory.py's meter), pp 2, in each schedule and number of micro-batches."""
    flags = ["--n-layers", 4, "--d-model", 128, "--seq-len", 64, "--batch-size", 4, "--pp", 2, "--steps", 2]
    return {(schedule, m): [r["activations"] for r in meter.launch(
        2, [*flags, "--pp-schedule", schedule, "--grad-accum", m], trace=True, timeout=300)["per_rank"]]
        for schedule, m in (("1f1b", 1), ("afab", 4), ("afab", 8), ("1f1b", 8))}


def test_1f1b_holds_at_most_p_micro_batches_of_activations_afab_all(activations):
    """A stage's peak is n micro-batches' saved activations s plus one backward's workspace w, for the
    n it holds at once: fitted on 1 and on AFAB's 8, AFAB's 4 lands on 4 s + w (it holds all m), and
    1F1B's 8 on (p - stage) s + w (it holds p of them on stage 0, one fewer on each later stage)."""
    for stage in range(2):
        a = {key: v[stage] for key, v in activations.items()}
        s = (a[("afab", 8)] - a[("1f1b", 1)]) / 7
        w = a[("1f1b", 1)] - s
        print(f"stage {stage}: saved {s / MIB:.2f} MiB per micro-batch, workspace {w / MIB:.2f} MiB; measured "
              + ", ".join(f"{k[0]} x{k[1]} {v / MIB:.2f} MiB" for k, v in a.items()))
        assert s > 0.5 * a[("1f1b", 1)], "a micro-batch's saved activations dominate its peak"
        assert abs(a[("afab", 4)] - (4 * s + w)) <= 0.3 * s, (stage, (a[("afab", 4)] - w) / s)
        assert abs(a[("1f1b", 8)] - ((2 - stage) * s + w)) <= 0.3 * s, (stage, (a[("1f1b", 8)] - w) / s)


def test_kill_9_mid_run_then_resume_auto_is_bit_identical(tmp_path):
    """pp 2 x dp 2: a rank is killed with SIGKILL between checkpoints; --resume auto on the same grid
    ends exactly as the uninterrupted run, and its checkpoint resumes on 1 rank and on pp 2 x tp 2."""
    flags = ["--steps", 12, "--ckpt-every", 4, "--pp", 2, "--grad-accum", 3, "--bucket-mb", 0.01]
    whole, out = tmp_path / "whole", tmp_path / "run"
    assert mpirun(4, "--out", whole, *flags).returncode == 0
    job = kill_a_rank_after_checkpoint(tmp_path, 4, out, flags, victim=3)
    assert job.returncode != 0 and summary_missing(out)
    res = mpirun(4, "--out", out, *flags, "--resume", "auto")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert by_step(out) == by_step(whole)
    assert summary(out)["final_param_fingerprint"] == summary(whole)["final_param_fingerprint"]
    for ranks, grid in ((1, []), (4, ["--tp", 2])):
        again = tmp_path / f"again-{ranks}"
        res = mpirun(ranks, "--out", again, "--resume", out / "checkpoints" / "ckpt-00000008.h5", *grid, *flags[:2],
                     "--grad-accum", 6, "--pp", 2 if grid else 1)   # the same global batch: 1 replica
        assert res.returncode == 0 and "logical digests verified" in res.stdout, res.stdout[-2000:] + res.stderr
        got, want = by_step(again), by_step(whole)
        for step in range(9, 13):
            assert got[step][0] == pytest.approx(want[step][0], rel=1e-5), (ranks, step)


def summary_missing(out) -> bool:
    return not (out / "summary.json").exists()
