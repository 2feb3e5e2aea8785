"""Invariant (a) separates runs that learn from runs that do not: a table of real runs (2 ranks, a few
seconds each), healthy ones exit 0 (overfitting and noise reported plainly), broken ones fail (a) on
the check that names their fault; and the statistics of capstone.observe.invariants.learns in unit form.

`pytest -s tests/test_learning.py` prints each case's magnitudes."""

import os
import random
import subprocess
import sys

import numpy as np
import pytest

from capstone.observe import invariants
from capstone.config import TrainConfig
from capstone.observe import verdict
from capstone.step.state import RunState

from conftest import ROOT, mpi_env, mpirun, step_rows, summary

LICENCES = [f"/usr/share/common-licenses/{n}" for n in ("GPL-3", "Apache-2.0", "LGPL-2.1")]
WORDS = ("the of and to in is that it was for on are as with his they at be this from have or by one had not but "
         "what all were when we there can an your which their said if do will each about how up out them then she "
         "many some so these would other into has more her two like him see time could no make than first been its "
         "who now people my made over did down only way find use may water long little very after words").split()
TINY = ["--d-model", "64", "--n-layers", "2", "--n-heads", "4", "--seq-len", "32", "--global-batch", "8",
        "--lr", "3e-3", "--eval-batches", "2", "--eval-batch-size", "8", "--ckpt-every", "0"]


def prepare(out, *sources):
    res = subprocess.run([sys.executable, "-m", "capstone.prepare", *map(str, sources), "--out", str(out)],
                         capture_output=True, text=True, env=mpi_env(), cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    return out


@pytest.fixture(scope="module")
def words(tmp_path_factory):
    """4 KB of words in random order: spelling generalises, the order can only be memorised."""
    tmp = tmp_path_factory.mktemp("words")
    rng = random.Random(7)
    (tmp / "words.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(900)))
    return prepare(tmp / "data", tmp / "words.txt")


@pytest.fixture(scope="module")
def trained(words, tmp_path_factory):
    """A model trained on the words to its best held-out loss (step 200 is its lowest evaluation)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    res = mpirun(2, "--out", out, "--quiet", "--data", words, *TINY, "--steps", "200", "--eval-every", "10")
    assert res.returncode == 0, res.stdout + res.stderr
    return out


FROM_TRAINED = ["--init-from", "{trained}", "--data", "{words}", "--steps", "40", "--eval-every", "10"]
# name -> (flags, needs, the (a) check that must fail, None for a healthy run, or NOT_JUDGED for a run whose
# learning (a) cannot judge (its status and exit code are the run's: NOT_JUDGED_STATUS), the note expected)
NOT_JUDGED = "not judged"
NOT_JUDGED_STATUS = {"preempted with its evaluations rolled back (the issue's)": "preempted"}
CASES = {
    "overfitting": (["--data", "{words}", *TINY, "--steps", "600", "--eval-every", "25"], "words", None, True),
    "noise (licence texts, the issue's example)": (["--data", "{licences}", "--steps", "60"], "licences", None, True),
    "no learning (lr 1e-6)": (["--lr", "1e-6"], None, "learnt", False),
    "no update applied": (["--inject-no-update", "1"], None, "learnt", False),
    "gradient of the wrong sign from step 8": (["--inject-grad-sign", "8"], None, "trend", False),
    "one step at lr x 10": (["--inject-lr-spike", "12:10"], None, "jump", False),
    "lr warmed up to 0.3: the training loss slowly rises": (
        ["--lr", "0.3", "--warmup-steps", "150", "--steps", "150", "--clip", "1", "--ckpt-every", "0"], None, "trend",
        False),
    "preempted with its evaluations rolled back (the issue's)": (
        ["--steps", "8", "--eval-every", "5", "--inject-nan", "2:2", "--stop-after", "3"], None, NOT_JUDGED, False),
    "one evaluation (lr 1e-6)": (["--lr", "1e-6", "--eval-every", "100", "--ckpt-every", "0"], None, NOT_JUDGED, False),
    "from trained weights at their floor, with their run's settings": (FROM_TRAINED, "trained", NOT_JUDGED, False),
    "from trained weights at lr 1e-2: the guard undoes every evaluated update": (
        [*FROM_TRAINED, "--lr", "1e-2"], "trained", "learnt", False),
}


def magnitudes(a: dict) -> str:
    learnt, jump, trend = a["learnt"], a["jump"], a["trend"]
    rise = f"{trend['rise']:+.3f} (allowed {trend['allowed']:.3f})" if trend["judged"] else "not judged"
    rose = a["rose"] and f"{a['rose']['rise']:+.3f} from step {a['rose']['best_step']} to {a['rose']['last_step']}"
    return (f"{'not judged; ' if a.get('not_judged') else ''}best held-out {learnt['drop'] / learnt['start']:+.1%} below start; jump {jump['sigmas']:.1f} sigmas "
            f"at step {jump['at_step']}; training rise {rise}; held-out rose {rose or '-'}; strict check "
            f"{'ok' if a['strict_ok'] else 'failed'}")


@pytest.mark.parametrize("name", list(CASES))
def test_invariant_a_table(name, tmp_path, request):
    flags, needs, fails, note = CASES[name]
    if needs == "licences":
        if not all(os.path.exists(p) for p in LICENCES):
            pytest.skip("needs /usr/share/common-licenses (base-files on Debian/Ubuntu)")
        data = prepare(tmp_path / "lic", *LICENCES)
    else:
        data = request.getfixturevalue("words") if needs in ("words", "trained") else None
    source = request.getfixturevalue("trained") if needs == "trained" else None
    out = tmp_path / "run"
    res = mpirun(2, "--out", out, *[f.format(words=data, licences=data, trained=source) for f in flags])
    a = summary(out)["invariants"]["a_loss_monotone"]
    print(f"\n{name:<55} rc {res.returncode}: {magnitudes(a)}")
    if fails is None:
        assert res.returncode == 0 and a["ok"] and not a["not_judged"], res.stdout + res.stderr
        assert ("note: the held-out loss rose from its best" in res.stdout) == note, res.stdout
    elif fails == NOT_JUDGED:   # reported in words; the run's own status and exit code
        assert res.returncode == 0 and a["ok"] and not a["learnt"]["ok"], res.stdout + res.stderr
        assert f"(a) not judged: {a['not_judged']}" in res.stdout and "(a) loss not decreasing" not in res.stdout
        assert summary(out)["status"] == NOT_JUDGED_STATUS.get(name, "completed")
    else:
        assert res.returncode == 1 and not a["ok"] and not a[fails]["ok"], res.stdout + res.stderr
        assert res.stdout.count("(a) loss not decreasing") >= 1 and "Traceback" not in res.stderr
        assert summary(out)["status"] == "failed" and not a["not_judged"]
        assert not ("Raise --lr" in res.stdout and "Lower --lr" in res.stdout), "hints that contradict each other"
    if name == "overfitting":   # today's strict check would have failed it; it ends above its start
        assert not a["strict_ok"] and a["last"] > a["first"] and a["rose"]["rise"] > 1.0
    if name == "no update applied":
        assert len(set(step_rows(out, "fingerprint"))) == 1, "the parameters never changed"


def test_learns_on_made_up_curves():
    """Each check on synthetic curves: noise passes, each fault fails its own check only."""
    rng = np.random.default_rng(0)
    steps = np.arange(1, 201)
    base = 1.0 + 3.0 * np.exp(-steps / 30)
    train = [(int(s), float(v)) for s, v in zip(steps, base + rng.normal(0, 0.1, steps.size))]
    evals = [(0, 4.0)] + [(int(s), float(base[s - 1] + rng.normal(0, 0.02))) for s in steps[9::10]]
    ok = invariants.learns(evals, train, 1e-4, 0.05)
    assert ok["ok"] and ok["trend"]["judged"], ok
    flat = invariants.learns([(0, 4.0), (10, 3.99), (20, 3.98)], train, 1e-4, 0.05)
    assert not flat["ok"] and not flat["learnt"]["ok"] and flat["jump"]["ok"]
    jumped = evals[:10] + [(evals[10][0], evals[9][1] + 1.0)] + evals[11:]   # about 9 sigmas of its moves
    j = invariants.learns(jumped, train, 1e-4, 0.05)
    assert not j["ok"] and not j["jump"]["ok"] and j["jump"]["at_step"] == jumped[10][0] and j["trend"]["ok"]
    rising = train[:100] + [(s, v + 0.004 * (s - 100)) for s, v in train[100:]]   # +0.4 over 100 steps
    r = invariants.learns(evals, rising, 1e-4, 0.05)
    assert not r["ok"] and not r["trend"]["ok"] and r["jump"]["ok"] and r["learnt"]["ok"]


def test_what_a_cannot_judge_and_hints_that_agree():
    """Made-up segments: too few evaluations, a preempted one, a trained start at its floor are not judged
    (ok, with the reason); a trained start that did not move its training loss, or whose held-out loss rose
    more than 5%, is; a run wrecked at step 1 (the issue's 3.32 -> 4.47) gets no advice to raise the lr."""
    rng = np.random.default_rng(3)
    falling = [(s, 2.0 - 0.01 * s + float(rng.normal(0, 0.02))) for s in range(1, 41)]
    flat = [(s, 2.0 + float(rng.normal(0, 0.02))) for s in range(1, 41)]
    floor = [(0, 2.0), (10, 2.01), (20, 1.995), (30, 2.02), (40, 2.03)]
    few = invariants.learns(floor[:2], falling, 1e-4, 0.05, planned=1)
    assert few["ok"] and "1 held-out evaluation after the start" in few["not_judged"]
    lost = invariants.learns(floor[:2], falling, 1e-4, 0.05, planned=4)   # 3 evaluated updates rolled back
    assert not lost["ok"] and lost["learnt"]["damaged"] and "rolled back 3 of the 4" in " ".join(
        verdict.learning_failures(lost))
    assert "preempted" in invariants.learns(floor, flat, 1e-4, 0.05, preempted=True)["not_judged"]
    at_floor = invariants.learns(floor, falling, 1e-4, 0.05, trained_start=True)
    assert at_floor["ok"] and "stayed at that model's floor" in at_floor["not_judged"]
    assert "while the training loss fell" in at_floor["not_judged"]
    unmoved = invariants.learns(floor, flat, 1e-4, 0.05, trained_start=True)   # at its floor, or a tiny lr
    assert unmoved["ok"] and "did not fall beyond its noise either" in unmoved["not_judged"]
    for judged in (invariants.learns(floor, falling, 1e-4, 0.05),                         # fresh weights
                   invariants.learns(floor[:2] + [(20, 2.2), (30, 2.1)], falling, 1e-4, 0.05, trained_start=True)):
        assert not judged["ok"] and judged["not_judged"] is None
    wrecked = [(0, 3.32), (1, 4.47)] + [(s, 4.47 - 0.03 * s) for s in range(2, 30)]
    lines = " ".join(verdict.learning_failures(invariants.learns(wrecked, falling[:29], 1e-4, 0.05, settle_until=3)))
    assert "did not learn" in lines and "Lower --lr" in lines and "Raise --lr" not in lines, lines


def test_a_few_equal_moves_do_not_make_every_rise_a_jump():
    """Moves of -0.1, -0.1 then +0.05: their spread is 0, so half a move back up would be infinitely many
    sigmas; the spread is taken as at least a quarter of the typical move (z = 6, under the limit)."""
    j = invariants.jumps([(0, 4.0), (1, 3.9), (2, 3.8), (3, 3.85)], 1e-4, 0.05, 0, 4.0, None)
    assert j["ok"] and j["at_step"] == 3 and j["sigmas"] == pytest.approx(6.0, rel=1e-6)
    bad = invariants.jumps([(0, 4.0), (1, 3.9), (2, 3.8), (3, 4.1)], 1e-4, 0.05, 0, 4.0, None)
    assert not bad["ok"] and bad["sigmas"] == pytest.approx(16.0, rel=1e-6)


def test_trend_compares_with_the_lowest_earlier_block():
    """A slow rise, each block only a little above the one before, is a rise: blocks of 5 steps,
    each 0.02 above the last (noise 0.01 per step allows about 0.03 between two blocks)."""
    rng = np.random.default_rng(1)
    losses = [(s, 1.0 + 0.004 * s + float(rng.normal(0, 0.01))) for s in range(1, 51)]
    t = invariants.trend(losses, 1e-4)
    assert not t["ok"] and t["rise"] > 0.15 and t["from"][0] == 1 and t["to"][1] == 50, t


@pytest.mark.parametrize("seed", range(5))
def test_pure_noise_passes(seed):
    """Held-out and training losses that are flat plus normal noise, after a real decrease: no jump,
    no trend (the thresholds are 8 and 4 sigmas: false alarms are rare, not a coin toss)."""
    rng = np.random.default_rng(seed)
    train = [(s, 2.0 + float(rng.normal(0, 0.2))) for s in range(1, 1001)]
    evals = [(0, 4.0)] + [(s, 2.0 + float(rng.normal(0, 0.05))) for s in range(10, 1001, 10)]
    a = invariants.learns(evals, train, 1e-4, 0.05)
    assert a["ok"], (a["jump"], a["trend"])
    assert a["jump"]["sigmas"] < 4 and a["trend"]["rise"] < a["trend"]["allowed"]


def test_robust_sigma():
    assert invariants.robust_sigma([1.0]) == 0.0
    x = np.random.default_rng(2).normal(0, 2.0, 20001)
    assert invariants.robust_sigma(list(x)) == pytest.approx(2.0, rel=0.03)
    assert invariants.robust_sigma(list(x) + [1e9] * 100) == pytest.approx(2.0, rel=0.05), "outliers do not move it"


def test_a_resumed_launch_judges_the_trend_at_its_whole_runs_scale():
    """A launch that resumed a 3000-step run at step 342 and stopped at 484, its training loss flat at its
    floor but for a bump of 14 steps that recovers (what a helper's run showed): the whole run's blocks
    (300 steps) do not judge a rise in 142 steps; blocks of a tenth of the launch (14) failed it, where an
    uninterrupted run of the same steps passed."""
    rng = np.random.default_rng(4)
    train = [(s, 0.355 + float(rng.normal(0, 0.008)) + (0.03 if 401 <= s <= 414 else 0.0)) for s in range(343, 485)]
    state = RunState(step=484, eval_start=4.18, best_eval=0.347)
    state.losses = [(s, loss, 0.35 + float(rng.normal(0, 0.002))) for s, loss in train]
    a = invariants.of_segment(state, TrainConfig(steps=3000), 342, (0.361, 0.347), preempted=True)
    assert a["ok"] and a["trend"]["block"] == 300 and not a["trend"]["judged"], a["trend"]
    launch_scale = invariants.trend(train, 1e-4, 300)        # blocks of n / 10 = 14 steps
    assert launch_scale["judged"] and not launch_scale["ok"], "the bump must be one a launch's own blocks fail"
