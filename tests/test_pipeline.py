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

from conftest import by_step, kill_a_rank_after_checkpoint, mpirun, step_rows, summary

MIB = 1 << 20


@pytest.mark.parametrize("K, m", [(2, 1), (2, 4), (4, 8), (3, 2)])
def test_schedule_orders(K, m):
    for p in range(K):
        for schedule in ("1f1b", "afab", "zb-h1"):
            seq, split = order(schedule, p, K, m), schedule == "zb-h1"
            kinds = "FBW" if split else "FB"
            assert sorted(seq) == sorted((k, j) for k in kinds for j in range(m)), (schedule, p, seq)
            live, peak, held, most = set(), 0, set(), 0
            for kind, j in seq:                        # a backward after its forward; activations in flight
                if kind == "W":                        # zb-h1: W after its B, held back at most p micro-batches
                    assert j in held and min(held) == j, (p, seq)
                    held.remove(j)
                    continue
                assert (kind == "F") == (j not in live), (schedule, p, seq)
                live ^= {j}
                held |= {j} if kind == "B" and split else set()
                peak, most = max(peak, len(live)), max(most, len(held))
            assert peak == (m if schedule == "afab" else min(K - p, m)), (schedule, p, peak)
            assert most <= p + 1 and not held, (p, seq)
    assert order("1f1b", 0, 2, 3) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    assert order("1f1b", 1, 2, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert order("afab", 1, 2, 3) == [("F", 0), ("F", 1), ("F", 2), ("B", 2), ("B", 1), ("B", 0)]
    # ZB-H1 (Qi et al.): 1F1B's forwards and backwards, stage p's weight passes held back p micro-batches
    assert order("zb-h1", 0, 2, 3) == [("F", 0), ("F", 1), ("B", 0), ("W", 0), ("F", 2), ("B", 1), ("W", 1),
                                       ("B", 2), ("W", 2)]
    assert order("zb-h1", 1, 2, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("W", 0), ("F", 2), ("B", 2),
                                       ("W", 1), ("W", 2)]


def test_zb_h1_fills_the_bubble_of_equal_stages():
    """Simulated with F = B = W (one unit each, free messages): 1F1B's bubble (p-1)/(m+p-1) with B + W joined,
    ZB-H1's (p-1)(F+B-W) / (m(F+B+W) + (p-1)(F+B-W)), a third of it; and no stage waits forever."""
    for K, m in ((2, 8), (4, 8), (4, 16), (3, 5)):
        joined = bench.simulate({p: [("B" if k == "B" else k, j) for k, j in order("1f1b", p, K, m)]
                                 for p in range(K)}, {"F": 1, "B": 2})
        split = bench.simulate({p: order("zb-h1", p, K, m) for p in range(K)}, {"F": 1, "B": 1, "W": 1})
        assert joined == pytest.approx((K - 1) / (m + K - 1)), (K, m)
        assert split == pytest.approx((K - 1) / (3 * m + K - 1)), (K, m)


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


@pytest.mark.parametrize("schedule", ["1f1b", "afab", "zb-h1"])
def test_every_rank_runs_its_schedule_in_a_real_run(schedule):
    """pp 4 x dp 2 on 8 ranks, 6 micro-batches: each rank's recorded events are its stage's order."""
    res = bench.launch(8, ["--n-layers", 4, "--pp", 4, "--pp-schedule", schedule, "--grad-accum", 6, "--steps", 2,
                           "--global-batch", 48], timeout=300)
    for ranks in res["steps"]:
        assert sorted((r["stage"], r["dp"]) for r in ranks) == [(p, d) for p in range(4) for d in range(2)]
        for r in ranks:
            assert [tuple(e[:2]) for e in r["events"]] == order(schedule, r["stage"], 4, 6), (schedule, r["stage"])


@pytest.mark.parametrize("ranks, flags", [
    (4, ["--deterministic", "--zero-stage", 3, "--recompute", "--tp", 2, "--clip", 0.5]),
    (2, ["--clip", 0.5, "--tie-embeddings", "--dropout", 0.1, "--no-bias"])],
    ids=["det-zero3-recompute-tp2", "tie-dropout-clip"])
def test_zb_h1_is_1f1b_bit_for_bit_through_a_nan_a_spike_and_the_clip(tmp_path, ranks, flags):
    """Split backwards and post-validation change when things are computed, not what: every step's numbers, the
    fingerprints and the checkpoint's digests are 1f1b's, also where the guard rolls back (a NaN gradient at step 3,
    an lr spike at step 6 undone by its held-out loss) and where the clip scales (the update taken ahead redone)."""
    common = ["--pp", 2, "--grad-accum", 4, "--steps", 8, "--n-layers", 4, "--inject-nan", 3,
              "--inject-lr-spike", "6:1000", "--quiet", *flags]
    for schedule in ("1f1b", "zb-h1"):
        res = mpirun(ranks, "--out", tmp_path / schedule, "--pp-schedule", schedule, *common)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    got, want = (summary(tmp_path / s) for s in ("zb-h1", "1f1b"))
    numbers = ("loss", "grad_norm", "grad_norm_clipped", "eval_loss", "param_norm", "fingerprint", "accepted", "samples")
    rows = {s: [{k: r[k] for k in numbers} for r in step_rows(tmp_path / s)] for s in ("zb-h1", "1f1b")}
    assert rows["zb-h1"] == rows["1f1b"]
    assert [r["accepted"] for r in rows["1f1b"]] == [True] * 2 + [False] + [True] * 2 + [False] + [True] * 2
    assert got["final_param_fingerprint"] == want["final_param_fingerprint"]
    counts = got["post_validation"]
    assert counts["redone"] >= 1 and counts["dropped"] == 1 and sum(counts.values()) == 8, counts  # step 3's dropped
    assert "post_validation" not in want


def test_a_run_stopped_under_one_schedule_resumes_under_another_with_the_same_bits(tmp_path):
    """zb-h1 stopped at step 3 and resumed under 1f1b (and the reverse) ends as the uninterrupted zb-h1 run."""
    flags = ["--pp", 2, "--grad-accum", 4, "--steps", 6, "--n-layers", 4, "--clip", 0.5, "--ckpt-every", 3, "--quiet"]
    assert mpirun(2, "--out", tmp_path / "whole", "--pp-schedule", "zb-h1", *flags).returncode == 0
    for first, then in (("zb-h1", "1f1b"), ("1f1b", "zb-h1")):
        out = tmp_path / f"{first}-then-{then}"
        assert mpirun(2, "--out", out, "--pp-schedule", first, *flags, "--stop-after", 3).returncode == 0
        res = mpirun(2, "--out", out, "--resume", "latest", "--pp-schedule", then, "--quiet")
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr
        assert by_step(out) == by_step(tmp_path / "whole")
        assert summary(out)["final_param_fingerprint"] == summary(tmp_path / "whole")["final_param_fingerprint"]
        assert ("post_validation" in summary(out)) == (then == "zb-h1")   # the resumed segment's schedule


@pytest.fixture(scope="module")
def activations():
    """The forward/backward peak of allocated bytes above the step's start on each rank (tracemalloc:
    benchmarks/memory.py's meter), pp 2, in each schedule and number of micro-batches."""
    flags = ["--n-layers", 4, "--d-model", 128, "--seq-len", 64, "--batch-size", 4, "--pp", 2, "--steps", 2]
    return {(schedule, m): [r["activations"] for r in meter.launch(
        2, [*flags, "--pp-schedule", schedule, "--grad-accum", m], trace=True, timeout=300)["per_rank"]]
        for schedule, m in (("1f1b", 1), ("afab", 4), ("afab", 8), ("1f1b", 8), ("zb-h1", 8))}


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


def test_zb_h1_holds_1f1bs_activations_and_p_weight_passes(activations):
    """ZB-H1 runs 1F1B's forwards: stage p holds K - p micro-batches' activations, and what p held-back W passes
    keep (each linear layer's input and output gradient, LayerNorm's normalised input and output gradient: here
    about one micro-batch's activations, of which the attention's temporaries are B's and freed there). Stage 0
    holds back none: 1f1b's peak. The last holds 1 micro-batch and K - 1 W passes, no more than stage 0's K
    micro-batches, so the heaviest stage (the preflight's estimate: K micro-batches) keeps 1f1b's peak: the
    issue's goal, at most 1f1b's + 10%."""
    zb, one = activations[("zb-h1", 8)], activations[("1f1b", 8)]
    print(f"zb-h1 {[round(a / MIB, 2) for a in zb]} MiB against 1f1b {[round(a / MIB, 2) for a in one]} MiB per stage")
    assert abs(zb[0] - one[0]) <= 0.1 * one[0], (zb, one)
    assert zb[1] - one[1] > 0.5 * (one[0] - one[1]), (zb, one)   # the held W pass: most of a micro-batch's
    assert max(zb) <= 1.1 * max(one), (zb, one)


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
