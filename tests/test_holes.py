"""Tests that close holes a broken implementation used to slip through (issue 17).

Each test names the bug it catches; scripts/mutants applies those bugs (tests/mutants.py lists
them) to a temporary copy of the repository and checks that they are caught.
"""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from conftest import ROOT, flip_shard_byte, mpi_env, mpirun, summary

from capstone.checkpoint import files, integrity
from capstone.cli import RunOptions, Settings
from capstone.config import ModelConfig, TrainConfig
from capstone.data.synthetic import DataStream, make_corpus
from capstone.parallel.comm import Comm
from capstone.model.gpt import Model
from capstone.run import build, start
from capstone.train import train_step


def metrics(out) -> list[dict]:
    """The step rows of metrics.jsonl; after a resume the last row of a step counts."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = {r["step"]: r for r in map(json.loads, f) if "step" in r}
    return [rows[s] for s in sorted(rows)]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """6 steps on 4 ranks with the defaults (constant lr, no clipping)."""
    out = tmp_path_factory.mktemp("plain") / "run"
    res = mpirun(4, "--out", out, "--steps", "6", "--ckpt-every", "0")
    assert res.returncode == 0, res.stderr
    return out


# ---- 1. clipping -------------------------------------------------------------------------------

def test_clipped_training_steps_match_a_reference(tmp_path):
    """Four steps of the real training loop with --clip 0.5 (clipping every step) against a
    reference written out here: the unclipped gradient of the same batch, scaled by clip/norm,
    then textbook Adam in float64 (catches: the scale not passed to the update, or inverted)."""
    tcfg = TrainConfig(steps=4, clip=0.5, ckpt_every=0)
    run = build(Comm(MPI.COMM_SELF), Settings(ModelConfig(), tcfg, RunOptions(out=str(tmp_path / "run"), quiet=True), {}),
                str(tmp_path / "run"))
    start(run)
    reference = Model(run.mcfg, run.model.layout, run.model.params.copy())
    master = run.model.params.astype(np.float64)
    p0, m, v = master.copy(), np.zeros_like(master), np.zeros_like(master)
    g_batch, b1, b2 = run.global_batch, tcfg.beta1, tcfg.beta2
    for s in range(1, 5):
        r = train_step(run, s)
        reference.params[...] = master.astype(np.float32)
        batches = [run.data.micro_batch((s - 1) * g_batch, j, 0, 1) for j in range(tcfg.grad_accum)]
        reference.forward_backward(batches, 1.0 / (g_batch * run.mcfg.seq_len))
        g = reference.grads.astype(np.float64)
        norm = float(np.linalg.norm(g))
        assert norm > tcfg.clip and r.grad_norm == pytest.approx(norm, rel=1e-5) and r.rollback is None
        assert r.grad_norm_clipped == pytest.approx(tcfg.clip)
        g *= tcfg.clip / norm
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        master -= tcfg.lr * (m / (1 - b1 ** s)) / (np.sqrt(v / (1 - b2 ** s)) + tcfg.eps)
        # Relative to the distance travelled: float32 noise is about 1e-5 after 4 steps (a few
        # near-zero gradients may flip sign), a missing or inverted clip scale 7e-3 or more.
        off = np.linalg.norm(run.model.params - master) / np.linalg.norm(master - p0)
        assert off < 1e-4, f"step {s}: the update is {off:.2e} (relative) away from the reference"


def test_clip_end_to_end(tmp_path, plain):
    """--clip 0.5 on 4 ranks: every step's gradient norm (about 1-2) is clipped, the parameters
    differ from the unclipped run's, and equal (to float tolerance) a 1-rank run with the same
    global batch (catches: clipping not applied, or clipped by a per-rank norm)."""
    runs = {}
    for n, accum in ((4, 1), (1, 4)):
        out = tmp_path / f"n{n}"
        res = mpirun(n, "--out", out, "--steps", "6", "--ckpt-every", "0", "--clip", "0.5", "--grad-accum", accum)
        assert res.returncode == 0, res.stderr
        runs[n] = (summary(out), metrics(out))
    (clipped, rows), (_, one_rows), unclipped = runs[4], runs[1], summary(plain)
    assert all(r["grad_norm"] > 0.5 and r["grad_norm_clipped"] == pytest.approx(0.5) for r in rows)
    assert clipped["final_param_fingerprint"][1] != unclipped["final_param_fingerprint"][1]
    assert [r["fingerprint"] for r in rows][1:] != [r["fingerprint"] for r in metrics(plain)][1:]
    for a, b in zip(rows, one_rows):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4) and a["param_norm"] == pytest.approx(b["param_norm"], rel=1e-5)
    assert abs(clipped["final_param_fingerprint"][0] - unclipped["final_param_fingerprint"][0]) > 1e-3


# ---- 2. invariant (b) end to end ---------------------------------------------------------------

@pytest.mark.parametrize("eval_every", [1, 3])
def test_a_bit_flipped_on_one_rank_fails_the_run(tmp_path, eval_every):
    """CAPSTONE_FAULT=flip_param_bit:2:2 flips one bit of rank 2's parameters after the update of
    step 2: invariant (b) reports that step and the job exits 1, whether step 2 compares sha256
    digests (an evaluation step) or word sums (--eval-every 3) (catches: a replica check that
    cannot see a real disagreement)."""
    out = tmp_path / "run"
    res = mpirun(3, "--out", out, "--steps", "4", "--ckpt-every", "0", "--eval-every", str(eval_every),
                 env_extra={"CAPSTONE_FAULT": "flip_param_bit:2:2"}, timeout=90)
    assert (metrics(out)[1]["eval_loss"] is None) == (eval_every == 3)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "INVARIANT VIOLATED" in res.stdout and "(b) parameters differ across ranks at 1 of 4 steps" in res.stdout
    s = summary(out)
    b = s["invariants"]["b_params_identical"]
    assert s["status"] == "failed" and b["mismatches"][0]["step"] == 2
    assert all(s["invariants"][k]["ok"] for k in ("a_loss_monotone", "c_optimizer_memory", "d_resume_bytes"))


# ---- 4. wall-clock checkpoints: an upper bound too ----------------------------------------------

def test_wall_clock_checkpoints_are_spaced_by_the_interval(tmp_path):
    """--ckpt-every-minutes 0.01 (0.6 s) with steps of about 0.25 s: at least two saves before the
    last step, and consecutive ones at least 0.6 s apart by their files' times (catches: minutes
    taken as seconds, a clock never reset, a save every step)."""
    out = tmp_path / "run"
    res = mpirun(2, "--out", out, "--steps", "10", "--ckpt-every", "0", "--ckpt-every-minutes", "0.01",
                 "--sleep-per-step", "0.25")
    assert res.returncode == 0, res.stderr
    saved = [c["step"] for c in summary(out)["checkpoints"]]
    clock = [s for s in saved if s != 10]
    assert saved[-1] == 10 and len(clock) >= 2, saved
    times = [os.stat(out / "checkpoints" / files.final_name(s)).st_mtime for s in clock]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert min(gaps) >= 0.55, (saved, gaps)


# ---- 6. the Slurm suite's own skip obeys CAPSTONE_REQUIRE_SLURM ---------------------------------

@pytest.mark.parametrize("require", [False, True])
def test_slurm_suite_under_mpi_fails_when_slurm_is_required(require):
    """tests/test_slurm.py refuses to run under mpirun with a module-level skip; with
    CAPSTONE_REQUIRE_SLURM=1 (CI) that must be a failure, not 'no tests ran'."""
    env = {k: v for k, v in mpi_env().items() if k != "CAPSTONE_REQUIRE_SLURM"}
    env["OMPI_COMM_WORLD_SIZE"] = "2"  # what mpirun sets: the module is never run for real here
    if require:
        env["CAPSTONE_REQUIRE_SLURM"] = "1"
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--color=no",
                          os.path.join(ROOT, "tests", "test_slurm.py")], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=120)
    if require:
        assert res.returncode not in (0, 5) and "CAPSTONE_REQUIRE_SLURM=1" in res.stdout, res.stdout
    else:
        assert res.returncode in (0, 5) and "1 skipped" in res.stdout, res.stdout  # 5: pytest's 'no tests ran'


# ---- 7. resharding to another global batch: the sample ranges ------------------------------------

def test_resharding_to_another_global_batch_neither_repeats_nor_skips_samples(tmp_path):
    """4 ranks (16 sequences a step) stop after step 3; 3 ranks (12 a step) resume: the sample
    ranges of metrics.jsonl continue exactly at 48 (catches: the cursor recomputed as step x new
    global batch, which repeats samples 36..47 and differs in the final loss by only 0.3%)."""
    out = tmp_path / "run"
    res = mpirun(4, "--out", out, "--steps", "6", "--ckpt-every", "3", "--stop-after", "3")
    assert res.returncode == 0, res.stderr
    res = mpirun(3, "--out", out, "--steps", "6", "--resume", "latest")
    assert res.returncode == 0, res.stderr
    ranges = [r["samples"] for r in metrics(out)]
    assert ranges == [[0, 16], [16, 32], [32, 48], [48, 60], [60, 72], [72, 84]], ranges
    assert "sample cursor 48" in res.stdout
    assert summary(out)["status"] == "completed"


def test_datastream_micro_batches_of_a_step_are_its_global_batch():
    """Every (micro-batch, rank) of a step takes its own B samples of [cursor, cursor + G), in
    order (catches: a rank/micro-batch index mix-up, which overlaps or skips samples)."""
    B, world, accum, cursor = 3, 3, 2, 40
    stream = DataStream(make_corpus(0, 4000), 8, B, 5)
    parts = {j * world + r: stream.micro_batch(cursor, j, r, world)[0] for j in range(accum) for r in range(world)}
    step = np.concatenate([parts[i] for i in range(accum * world)])
    assert np.array_equal(step, stream.samples(cursor, B * accum * world)[0])


# ---- 8. paths that had no test -----------------------------------------------------------------

def test_h5py_without_mpi_refuses_more_than_one_rank_at_startup(tmp_path):
    """The start-up refusal end to end (h5py reporting no MPI support): exit 2 on every rank with
    one message, before anything is written (catches: the refusal skipped; training would run and
    fail at the first save)."""
    out = tmp_path / "run"
    code = ("import sys, capstone.checkpoint as c; c.mpi_io_available = lambda: False; "
            "from capstone.train import main; main(sys.argv[1:])")
    cmd = ["mpirun", "-n", "2", "--oversubscribe", sys.executable, "-c", code, "--out", str(out), "--steps", "2"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=mpi_env(), cwd=ROOT)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.count("h5py has no MPI support") == 1 and "MPI_ABORT" not in res.stderr
    assert not out.exists()


def find_rank_pid(tag: str, rank: int, timeout: float = 30) -> int:
    """pid of the rank process whose environment holds CAPSTONE_TEST_TAG=tag (set for this job only)."""
    want = {f"CAPSTONE_TEST_TAG={tag}".encode(), f"OMPI_COMM_WORLD_RANK={rank}".encode()}
    deadline = time.time() + timeout
    while time.time() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if want <= set(f.read().split(b"\0")):
                        return int(pid)
            except OSError:
                continue
        time.sleep(0.1)
    raise AssertionError(f"no rank {rank} process with tag {tag}")


@pytest.mark.parametrize("sig, rank", [(signal.SIGUSR1, 2), (signal.SIGTERM, 1)])
def test_a_signal_to_one_rank_stops_every_rank_at_a_step_boundary(tmp_path, sig, rank):
    """SIGUSR1 or SIGTERM delivered to ONE rank (not rank 0, not through mpirun): all ranks agree to
    checkpoint at the next step, the run ends 'preempted' with exit 0 (catches: a stop request
    honoured on rank 0 only, or SIGTERM not handled)."""
    out, tag = tmp_path / "run", uuid.uuid4().hex
    cmd = ["mpirun", "-n", "3", "--oversubscribe", sys.executable, "-m", "capstone.train", "--out", str(out),
           "--steps", "40", "--ckpt-every", "0", "--sleep-per-step", "0.2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**mpi_env(), "CAPSTONE_TEST_TAG": tag}, cwd=ROOT)
    try:
        pid = find_rank_pid(tag, rank)
        deadline = time.time() + 60
        while time.time() < deadline and (not (out / "metrics.jsonl").exists()
                                          or (out / "metrics.jsonl").read_text().count('"step"') < 2):
            time.sleep(0.05)
        os.kill(pid, sig)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    s = summary(out)
    assert s["status"] == "preempted" and 2 <= s["final_step"] < 40, s["final_step"]
    assert [c["step"] for c in s["checkpoints"]] == [s["final_step"]]
    assert files.read_pointer(str(out / "checkpoints")).endswith(files.final_name(s["final_step"]))
    assert f"stopped at step {s['final_step']}" in stdout


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    """2 ranks, 6 steps, a checkpoint every step, --keep-last 2."""
    out = tmp_path_factory.mktemp("kept") / "run"
    res = mpirun(2, "--out", out, "--steps", "6", "--ckpt-every", "1", "--keep-last", "2")
    assert res.returncode == 0, res.stderr
    return out


def test_keep_last_keeps_the_newest_and_the_one_to_verify(kept):
    """--keep-last 2 end to end: the newest two remain, and the run's first checkpoint survives
    until invariant (d) has reloaded it at the end (catches: the first checkpoint not protected,
    retention deleting the newest)."""
    names = sorted(n for n in os.listdir(kept / "checkpoints") if not n.endswith(".sha256"))
    assert names == [files.final_name(1), files.final_name(5), files.final_name(6), "latest"], names
    s = summary(kept)
    assert s["invariants"]["d_resume_bytes"]["ok"] and s["invariants"]["d_resume_bytes"]["path"].endswith(files.final_name(1))
    removed = [r for c in s["checkpoints"] for r in c["removed"]]
    assert sorted(removed) == [files.final_name(s) for s in (2, 3, 4)]


def checkpoint_tool(*args):
    return subprocess.run([sys.executable, "-m", "capstone.checkpoint", *map(str, args)],
                          capture_output=True, text=True, env=mpi_env(), cwd=ROOT, timeout=60)


def test_checkpoint_inspect(kept, tmp_path):
    """`python -m capstone.checkpoint inspect`: the manifest and exit 0; --json the metadata; a
    damaged shard prints only the failed check and exits 1; not a checkpoint exits 1 (catches:
    inspect that prints but does not verify)."""
    path = kept / "checkpoints" / files.final_name(6)
    res = checkpoint_tool("inspect", path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "step 6, 2 ranks" in res.stdout and "data cursor 48" in res.stdout and "Adam step 6" in res.stdout
    assert "/shards/rank00000" in res.stdout and "/shards/rank00001" in res.stdout
    assert all(f"logical {row}" in res.stdout for row in ("master", "m", "v"))
    assert res.stdout.rstrip().endswith("verified") and "BAD" not in res.stdout
    meta, _ = json.JSONDecoder().raw_decode(checkpoint_tool("inspect", path, "--json").stdout)
    assert meta["step"] == 6 and meta["run"]["data_cursor"] == 48 and meta["world_size"] == 2
    damaged = tmp_path / "damaged.h5"
    shutil.copy(path, damaged)
    flip_shard_byte(damaged, 1, 40, 0x10)
    res = checkpoint_tool("inspect", damaged)  # no digest file beside the copy: refused before parsing
    assert res.returncode == 1 and "not a valid checkpoint" in res.stderr and "BAD" not in res.stdout
    integrity.write_digest(str(damaged))  # as if damaged before it was hashed: the shard's digest catches it
    res = checkpoint_tool("inspect", damaged)
    assert res.returncode == 1 and "BAD /shards/rank00001" in res.stdout and "FAILED verification" in res.stdout
    assert "ok  /shards/rank00000" not in res.stdout, "inspect prints only the failed checks"
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = np.arange(3)
    res = checkpoint_tool("inspect", other)
    assert res.returncode == 1 and "not a valid checkpoint" in res.stderr


def test_cosine_schedule_end_to_end(tmp_path, plain):
    """--lr-schedule cosine --warmup-steps 2 --min-lr 1e-3 over 6 steps: every step's lr is the
    closed form (linear warmup, then min + (lr - min)(1 + cos(pi (s - w) / (S - w))) / 2), and the
    update uses it (the parameters differ from the constant-lr run's from step 1) (catches: the
    cosine progress counted from step 0, warmup and min_lr swapped, the update ignoring the
    schedule)."""
    out = tmp_path / "run"
    res = mpirun(4, "--out", out, "--steps", "6", "--ckpt-every", "0", "--lr-schedule", "cosine",
                 "--warmup-steps", "2", "--min-lr", "1e-3")
    assert res.returncode == 0, res.stderr
    lr, low, w, n = 1e-2, 1e-3, 2, 6
    want = [lr * s / w if s <= w else low + 0.5 * (lr - low) * (1 + math.cos(math.pi * (s - w - 1) / (n - w)))
            for s in range(1, n + 1)]
    rows = metrics(out)
    assert [r["lr"] for r in rows] == pytest.approx(want, rel=1e-12, abs=0)
    assert low < rows[-1]["lr"] < lr, "the last step still updates; min_lr comes one step after it"
    constant = metrics(plain)
    assert all(a["fingerprint"] != b["fingerprint"] for a, b in zip(rows, constant))
    assert rows[0]["loss"] == constant[0]["loss"]  # same batch, same start: only the update differs


NO_PICKLE = [
    (r"^\s*(import|from)\s+(c?pickle|_pickle|dill|cloudpickle|joblib)\b", "imports pickle"),
    (r"allow_pickle\s*=\s*True", "np.load(allow_pickle=True)"),
    (r"\bnp\.load\(|\bnumpy\.load\(", "np.load (reads pickles when told to; use h5py or np.fromfile/memmap)"),
    (r"dtype\s*=\s*(object|\"O\"|'O')|special_dtype|vlen_dtype|h5py\.string_dtype|\bdtype=\"?object", "an object/vlen dtype"),
    (r"\bcomm\w*\.(bcast|gather|allgather|scatter|alltoall|reduce|allreduce|scan|exscan|send|recv|isend|irecv|"
     r"sendrecv|ibcast|igather|iallgather|iallreduce|ireduce)\(", "a lowercase mpi4py collective (pickles its argument)"),
]


def test_no_pickle_in_capstone():
    """README: 'No pickle: HDF5 datasets and JSON only'. No module imports pickle, loads .npy/.npz
    (np.load can unpickle), uses object/vlen dtypes, or calls a pickling (lowercase) mpi4py method.
    The runtime counterpart with pickle made to raise is tests/mpi/test_holes.py."""
    found = []
    for folder, _, names in os.walk(os.path.join(ROOT, "capstone")):
        for name in sorted(n for n in names if n.endswith(".py")):
            path = os.path.join(folder, name)
            with open(path) as f:
                for number, line in enumerate(f, 1):
                    code = line.split("#", 1)[0]
                    found += [f"{os.path.relpath(path, ROOT)}:{number}: {why}: {line.strip()}"
                              for pattern, why in NO_PICKLE if re.search(pattern, code)]
    assert not found, "\n".join(found)


# ---- 9. scripts/readme-figures --compare (what --check runs after regenerating) ----------------

FIGURES = """# x
<!-- figure:run -->
```
capstone: 4 ranks, 30144 parameters (padded 30144, shard 7536), global batch 16 x 16 tokens, run dir runs/readme
 step      loss eval_loss  grad_norm        lr      ms   param_norm fingerprint       event
    1   4.17814   4.03084     1.1398  1.00e-02    9.01    13.084928 253fe1becdb93c59  
    2   4.05105   3.86156     0.9009  1.00e-02    5.57    13.258013 e13e6d44a80090f0  checkpoint

memory per rank (bytes):
  rank     params      grads  optimizer      guard  peak_rss_MiB
     0     120576     150720      90432      90432          69.6
   max     120576     150720      90432      90432          69.6
  mean     120576     150720      90432      90432          69.3
  meta_sha256 c2f7b7f22e507aab1431b2a60b0e0aaef39b28ba3adcb6cb13f2e31c52a2f7a5
  /shards/rank00000  offset 0  length 7536  sha256 3a8592c3f789ab830614659cc810f7ea02645692b28d09373ef2259369b8d1af
completed step 20 in 0.17 s; summary runs/readme/summary.json
```
<!-- /figure:run -->
text
<!-- figure:h5ls -->
```
/meta_json               Dataset {3244}
/shards/rank00000        Dataset {3, 7536}
```
<!-- /figure:h5ls -->
<!-- figure:bench -->
```
  fwd_bwd               5.123    5.456
```
<!-- /figure:bench -->
"""


@pytest.mark.parametrize("old, new, drift", [
    ("    9.01", "   19.77", False),                             # a step's milliseconds
    ("69.6\n   max", "71.2\n   max", False),                     # peak RSS
    ("in 0.17 s", "in 3.02 s", False),                           # wall time
    ("5.123", "9.999", False),                                   # the bench figure is all timings
    ("4.05105", "4.05106", True),                                # a loss
    ("e13e6d44a80090f0", "e13e6d44a80090f1", True),              # a fingerprint
    ("3a8592c3f7", "4a8592c3f7", True),                          # a shard's digest
    ("c2f7b7f22e", "d2f7b7f22e", False),                         # the metadata's: it holds the provenance
    ("{3, 7536}", "{3, 7537}", True),                            # h5ls
    ("{3244}", "{3265}", False),                                 # ... but the metadata's length varies
    ("<!-- figure:h5ls -->", "<!-- figure:h5 -->", True),        # a figure block lost
])
def test_readme_figures_compare(tmp_path, old, new, drift):
    """`scripts/readme-figures --compare A B` (the comparison --check makes between README.md and
    its regenerated copy): timings, memory and the bench figure may differ, numbers that a run
    reproduces exactly may not; exit 1 on drift, naming the figure."""
    a, b = tmp_path / "a.md", tmp_path / "b.md"
    a.write_text(FIGURES)
    assert old in FIGURES
    b.write_text(FIGURES.replace(old, new, 1))
    res = subprocess.run(["bash", os.path.join(ROOT, "scripts", "readme-figures"), "--compare", a, b],
                         capture_output=True, text=True, env=mpi_env(), timeout=60)
    assert res.returncode == (1 if drift else 0), res.stdout + res.stderr
    if drift:
        assert "figure:" in res.stdout and "drift" in res.stdout
