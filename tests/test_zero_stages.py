"""ZeRO-0/2/3 and --recompute beyond the composition matrix (which proves their numbers against the
1-rank run): the memory they save, measured (tracemalloc, which NumPy reports to) against the
formulas of capstone.observe.memory; checkpoints across stages and world sizes; a kill -9 during
a stage-3 save; gradients of --recompute bit-identical to the plain blocks'.
"""

import numpy as np
import pytest

from benchmarks.memory import POLICIES, launch, setting_flags
from capstone.checkpoint import files
from capstone.config import ModelConfig, TrainConfig
from capstone.runtime.preflight import activation_bytes

from conftest import by_step, mpirun, step_rows, summary

# several blocks and buckets, few activations: the model states dominate a step's peak
SMALL = dict(n_layers=6, d_model=192, n_heads=4, seq_len=32, vocab_size=256)
SMALL_FLAGS = [f for k, v in SMALL.items() for f in (f"--{k.replace('_', '-')}", v)] + ["--batch-size", 4]
SETTINGS = [(1, False), (2, False), (3, False), (1, True), (3, True)]
MIB = 1 << 20


@pytest.fixture(scope="module")
def traced():
    """Each setting on 4 ranks, 3 steps under tracemalloc (benchmarks/memory.py's worker)."""
    return {st: launch(4, [*SMALL_FLAGS, "--steps", 3, *setting_flags(*st)], trace=True, timeout=300)
            for st in SETTINGS}


def test_measured_model_states_equal_the_formula_of_each_stage(traced):
    for st, r in traced.items():
        assert r["states"] == r["formula"] and r["rows"] == r["formula_rows"], (st, r)
    one, two, three = (traced[(s, False)]["rows"] for s in (1, 2, 3))
    assert two["grads_bytes"] * 4 == one["grads_bytes"] and three["params_bytes"] * 4 == one["params_bytes"]
    assert three["gathered_bytes"] > 0 and one["gathered_bytes"] == two["gathered_bytes"] == 0


def test_the_peak_of_allocated_bytes_falls_by_the_formula_difference(traced):
    """Not bookkeeping only: the step's traced peak falls from stage 1 by what the formula says, and
    the forward and backward passes hold just the stage's buffers in flight on top of stage 1's
    activations (a gathered block kept alive by autograd's graph would show here)."""
    base = traced[(1, False)]
    tolerance = 0.02 * base["formula"]
    for stage in (2, 3):
        r = traced[(stage, False)]
        fall, want = base["traced_peak"] - r["traced_peak"], base["formula"] - r["formula"]
        assert abs(fall - want) <= tolerance, (stage, fall / MIB, want / MIB)
        in_flight = r["formula_rows"]["reduce_bytes"] + r["formula_rows"]["gathered_bytes"]
        extra = r["activations"] - base["activations"]
        assert abs(extra - in_flight) <= tolerance, (stage, extra / MIB, in_flight / MIB)


def test_the_policies_under_a_pipeline_hold_what_their_formulas_say():
    """dp 2 x pp 2, 4 micro-batches. Per micro-batch: what is kept across the step (parameters and
    gradient) falls with the stage, and so does the step's traced peak (the groups and buckets in
    flight are transient). Per step: stage 2 holds exactly stage 1's buffers (the whole gradient
    accumulates), stage 3 its stage's parameters gathered through the step, and the traced peak
    rises over stage 1 by what the formula says (a group freed or a gradient kept by mistake shows)."""
    got = {n: launch(4, [*SMALL_FLAGS, "--steps", 3, "--pp", 2, "--grad-accum", 4, *flags], trace=True, timeout=300)
           for n, flags in POLICIES}
    for n, r in got.items():
        assert r["states"] == r["formula"] and r["rows"] == r["formula_rows"], (n, r)
    one, row = got["stage 1"], {n: r["rows"] for n, r in got.items()}
    lean = [row["stage 1"], row["stage 2, per micro-batch"], row["stage 3, per micro-batch"]]
    kept = [r["params_bytes"] + r["grads_bytes"] for r in lean]
    assert kept[0] > kept[1] > kept[2], kept
    assert max(got[f"stage {s}, per micro-batch"]["traced_peak"] for s in (2, 3)) < one["traced_peak"]
    assert row["stage 2, per step"] == row["stage 1"]
    assert row["stage 3, per step"]["grads_bytes"] == row["stage 1"]["grads_bytes"]
    whole = row["stage 1"]["params_bytes"]   # the stage's flat buffer, padded to a multiple of dp 2
    assert whole - 4 * 2 < row["stage 3, per step"]["gathered_bytes"] <= whole   # every group, gathered
    tolerance = 0.02 * one["formula"]
    for n in ("stage 2, per step", "stage 3, per step"):
        rise, want = got[n]["traced_peak"] - one["traced_peak"], got[n]["formula"] - one["formula"]
        assert abs(rise - want) <= tolerance, (n, rise / MIB, want / MIB)


def test_recompute_keeps_a_fraction_of_the_activations(traced):
    cfg, tcfg = ModelConfig(**SMALL), TrainConfig(batch_size=4)
    plain, again = traced[(1, False)]["activations"], traced[(1, True)]["activations"]
    assert plain <= activation_bytes(cfg, tcfg) and again <= activation_bytes(cfg, tcfg, recompute=True)
    assert again < 0.35 * plain, (again / MIB, plain / MIB)
    assert traced[(3, True)]["traced_peak"] < traced[(3, False)]["traced_peak"] - 0.5 * (plain - again)


def test_recompute_gradients_are_bit_identical():
    from capstone.model.gpt import Model
    from capstone.model.params import Layout, init_params
    cfg = ModelConfig(**SMALL)
    layout = Layout.for_model(cfg, 1)
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, cfg.vocab_size, (3, cfg.seq_len)) for _ in range(2))
    grads = []
    for recompute in (False, True):
        model = Model.over(cfg, layout, init_params(layout, cfg, 1), recompute=recompute)
        loss = model.forward_backward([(x, y), (y, x)], 0.01)
        grads.append((loss, model.grads.copy()))
    assert grads[0][0] == grads[1][0] and np.array_equal(grads[0][1], grads[1][1])


@pytest.fixture(scope="module")
def stage3(tmp_path_factory):
    """12 steps of stage 3 on 4 ranks with several buckets, uninterrupted (checkpoints every 4)."""
    out = tmp_path_factory.mktemp("stage3") / "run"
    res = mpirun(4, "--out", out, "--steps", 12, "--ckpt-every", 4, "--zero-stage", 3, "--bucket-mb", 0.01)
    assert res.returncode == 0, res.stdout + res.stderr
    return out


def test_stage3_stop_and_resume_is_bit_identical(tmp_path, stage3):
    out = tmp_path / "run"
    flags = ["--steps", 12, "--ckpt-every", 4, "--zero-stage", 3, "--bucket-mb", 0.01]
    assert mpirun(4, "--out", out, *flags, "--stop-after", 8).returncode == 0
    res = mpirun(4, "--out", out, *flags, "--resume", "latest")
    assert res.returncode == 0, res.stderr
    assert by_step(out) == by_step(stage3)
    assert summary(out)["final_param_fingerprint"] == summary(stage3)["final_param_fingerprint"]


def close_to(got, want, rtol=1e-5):
    for g, w in zip(step_rows(got), step_rows(want)):
        for key in ("loss", "grad_norm", "param_norm"):
            assert g[key] == pytest.approx(w[key], rel=rtol), (g["step"], key)


def test_kill_during_a_stage3_save_then_resume_at_stage_1_on_2_ranks(tmp_path, stage3):
    """kill -9 of rank 2 after it wrote its data of checkpoint 8: checkpoint 4 stays the latest and
    verifies; it resumes at stage 1 on 2 ranks (the same global batch) and continues the stage-3 run."""
    out = tmp_path / "run"
    flags = ["--steps", 12, "--ckpt-every", 4, "--bucket-mb", 0.01]
    res = mpirun(4, "--out", out, *flags, "--zero-stage", 3, env_extra={"CAPSTONE_FAULT": "after_data:2:8"})
    assert res.returncode != 0 and "killing this rank at save.after_data of step 8" in res.stderr
    assert files.read_pointer(str(out / "checkpoints")).endswith(files.final_name(4))
    res = mpirun(1, "-m", "capstone.checkpoint", "verify", out / "checkpoints" / files.final_name(4))
    assert res.returncode == 0, res.stdout + res.stderr
    res = mpirun(2, "--out", out, *flags, "--grad-accum", 2, "--zero-stage", 1, "--resume", "latest")
    assert res.returncode == 0 and "written by 4 ranks, now 2" in res.stdout, res.stdout + res.stderr
    assert summary(out)["start_step"] == 4 and all(v["ok"] for v in summary(out)["invariants"].values())
    assert {r["stage"] for r in summary(out)["memory"]["per_rank"]} == {1}   # the flag, not the checkpoint's 3
    close_to(out, stage3)


def test_a_stage_1_checkpoint_resumes_at_stage_3_on_3_ranks(tmp_path):
    out, whole = tmp_path / "run", tmp_path / "whole"
    flags = ["--steps", 8, "--ckpt-every", 4, "--global-batch", 12, "--bucket-mb", 0.01]
    assert mpirun(3, "--out", whole, *flags).returncode == 0
    assert mpirun(2, "--out", out, *flags, "--stop-after", 4).returncode == 0
    res = mpirun(3, "--out", out, *flags, "--zero-stage", 3, "--recompute", "--resume", "latest")
    assert res.returncode == 0 and "logical digests verified" in res.stdout, res.stdout + res.stderr
    close_to(out, whole)


def test_stage_2_with_merged_buckets_and_accumulation_matches_stage_1(tmp_path):
    """At the default --bucket-mb every group of the reference model shares one bucket (staged);
    at 0.01 each goes alone: both, with accumulation 2, train as stage 1 does."""
    runs = {}
    for name, flags in {"one": ["--zero-stage", 1], "merged": ["--zero-stage", 2],
                        "alone": ["--zero-stage", 2, "--bucket-mb", 0.01]}.items():
        runs[name] = tmp_path / name
        res = mpirun(2, "--out", runs[name], "--steps", 6, "--grad-accum", 2, *flags)
        assert res.returncode == 0, res.stdout + res.stderr
    close_to(runs["merged"], runs["one"])
    close_to(runs["alone"], runs["one"])


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The matrix's model (4 blocks, several buckets at --bucket-mb 0.02) on 1 rank, 8 steps."""
    out = tmp_path_factory.mktemp("one") / "run"
    assert mpirun(1, "--out", out, *STAGE0).returncode == 0
    return out


STAGE0 = ["--steps", 8, "--ckpt-every", 4, "--global-batch", 96, "--n-layers", 4, "--bucket-mb", 0.02]


@pytest.mark.parametrize("ranks, flags", [(4, ["--grad-accum", 2]), (3, ["--no-overlap"])])
def test_stage_0_allreduces_in_buckets_like_the_1_rank_run(tmp_path, one_rank, ranks, flags):
    """Plain data parallelism (the gradient allreduced bucket by bucket during the backward pass, a
    power-of-2 and another data-parallel size, one bucket): the 1-rank run within 1e-5, every rank
    holding the whole optimizer state (invariant (c)), the replicas identical (b)."""
    out = tmp_path / "run"
    res = mpirun(ranks, "--out", out, *STAGE0, "--zero-stage", 0, *flags)
    assert res.returncode == 0, res.stdout + res.stderr
    s = summary(out)
    assert all(v["ok"] for v in s["invariants"].values())
    padded = s["memory"]["per_rank"][0]["padded"]
    assert [r["optimizer_bytes"] for r in s["memory"]["per_rank"]] == [12 * padded] * ranks
    assert "allreduce" in s["comm"] and "reduce_scatter" not in s["comm"] and "allgather" not in s["comm"]
    close_to(out, one_rank)


def test_stage_0_checkpoints_resume_at_other_stages_and_sizes(tmp_path, one_rank):
    """A stage-0 checkpoint is stage 1's file: it resumes at stage 3 on 2 ranks; a stage-1
    checkpoint resumes at stage 0 on 4 ranks; both continue the 1-rank run."""
    for name, (n, first), (m, then) in (("zero0", (3, 0), (2, 3)), ("zero1", (2, 1), (4, 0))):
        out = tmp_path / name
        assert mpirun(n, "--out", out, *STAGE0, "--zero-stage", first, "--stop-after", 4).returncode == 0
        res = mpirun(m, "--out", out, *STAGE0, "--zero-stage", then, "--resume", "latest")
        assert res.returncode == 0 and f"now {m}" in res.stdout, res.stdout + res.stderr
        assert all(v["ok"] for v in summary(out)["invariants"].values())
        close_to(out, one_rank)


def memory_cgroup(tmp_name: str, limit: int):
    """A child of this process's cgroup-v1 memory group limited to `limit` bytes (skip where the
    machine gives none: a container without a writable memory controller)."""
    import os
    with open("/proc/self/cgroup") as f:
        path = next((line.strip().split(":", 2)[2] for line in f if ":memory:" in line), None)
    group = f"/sys/fs/cgroup/memory{path}/{tmp_name}" if path is not None else None
    try:
        os.mkdir(group)
        with open(f"{group}/memory.limit_in_bytes", "w") as f:
            f.write(str(limit))
    except (OSError, TypeError) as exc:
        pytest.skip(f"no writable cgroup-v1 memory controller here ({exc})")
    return group


def test_preflight_counts_the_stage_and_recompute_under_a_real_memory_limit(tmp_path):
    """Under a real 1.2 GiB cgroup limit for 2 ranks, a model whose activations need about 1 GiB a
    rank is refused at stage 1 with the estimate, and trains at stage 3 with --recompute (the
    start-up check uses both formulas; a check that ignored them would refuse a run that fits)."""
    import os
    import subprocess
    import sys

    from conftest import ROOT, mpi_env
    group = memory_cgroup(f"capstone-test-{os.getpid()}", 1200 * MIB)
    model = ["--d-model", 256, "--n-layers", 8, "--n-heads", 8, "--seq-len", 256, "--batch-size", 8,
             "--vocab-size", 256, "--steps", 2, "--ckpt-every", 0, "--eval-every", 2]
    try:
        def run(out, *flags):
            cmd = " ".join(["mpirun", "-n", "2", "--oversubscribe", sys.executable, "-m", "capstone.train", "--out",
                            str(out), *map(str, model), *map(str, flags)])
            return subprocess.run(["sh", "-c", f"echo $$ > {group}/cgroup.procs && exec {cmd}"], capture_output=True,
                                  text=True, env=mpi_env(), cwd=ROOT, timeout=300)
        refused = run(tmp_path / "one")
        assert refused.returncode == 2 and "the memory limit of this job's cgroup" in refused.stderr, refused.stderr
        assert refused.stderr.count("of model states at --zero-stage 1") == 1 and not (tmp_path / "one").exists()
        fits = run(tmp_path / "three", "--zero-stage", 3, "--recompute")
        assert fits.returncode == 0, fits.stdout[-2000:] + fits.stderr[-2000:]
    finally:
        os.rmdir(group)


def test_stage3_evaluates_fewer_held_out_rows_than_ranks(tmp_path):
    """At ZeRO-3 each forward gathers over the data-parallel group: with 2 held-out rows per batch
    on 4 ranks, the two ranks without rows still run (uncounted) forwards, so nothing waits for a
    timeout and the held-out loss is the 1-rank run's (it hung until the collective deadline)."""
    runs = {}
    for ranks, flags in ((1, []), (4, ["--zero-stage", 3])):
        runs[ranks] = tmp_path / f"n{ranks}"
        res = mpirun(ranks, "--out", runs[ranks], "--steps", 3, "--global-batch", 8, "--eval-every", 1, "--eval-batch-size", 2,
                     "--eval-batches", 2, "--collective-timeout", 20, *flags, timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
    want, got = step_rows(runs[1], "eval_loss"), step_rows(runs[4], "eval_loss")
    assert len(got) == 3 and None not in got
    np.testing.assert_allclose(got, want, rtol=1e-5)
