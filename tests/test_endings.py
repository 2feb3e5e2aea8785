"""How runs end and what they say (issue 28, 3, 4 and 7): every evaluation on the console with the lr,
the final and best held-out loss in summary.json, summary.json after the guard's abort and a collective
timeout, no appending to an earlier run's log, and the settings a resume used to drop or change
silently (--preset, the global batch, a warmup longer than --steps, --resume auto on a finished run)."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from capstone.checkpoint import files
from conftest import ROOT, mpi_env, mpirun, step_rows, summary
from test_deadlines import stalled_run
from test_observe import printed_steps


def digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def clean_error(res, *words):
    """Exit 2, one paragraph printed once, no traceback, and the words that say what to do."""
    assert res.returncode == 2, res.stdout + res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr
    assert all(w in errors[0] for w in words), errors[0]
    return errors[0]


def test_log_every_prints_every_evaluation_with_the_lr(tmp_path):
    """--log-every 10 with --eval-every 7: steps 7, 14, 21, 28, 35 used to be missing from the console
    (issue 28, 3); each line has the lr; summary.json has the final and the best held-out loss."""
    out = tmp_path / "run"
    res = mpirun(2, "--out", out, "--steps", 40, "--log-every", 10, "--eval-every", 7, "--ckpt-every", 0,
                 "--lr-schedule", "cosine", "--min-lr", "1e-3")
    assert res.returncode == 0, res.stdout + res.stderr
    lines = {s: line.split() for s, line in printed_steps(res.stdout).items()}
    assert set(lines) == {1, 7, 10, 14, 20, 21, 28, 30, 35, 40}, sorted(lines)
    assert all(lines[s][2] != "-" for s in (7, 14, 21, 28, 35, 40)) and lines[10][2] == "-"
    rows = {r["step"]: r for r in step_rows(out)}
    assert all(float(lines[s][3]) == float(f"{rows[s]['lr']:.2e}") for s in lines), "the lr column"
    assert float(lines[40][3]) < float(lines[1][3]), "the cosine decays"
    held = summary(out)["held_out"]
    evals = {s: r["eval_loss"] for s, r in rows.items() if r["eval_loss"] is not None}
    best = min(evals, key=evals.get)
    assert held["final"] == evals[40] and held["final_step"] == 40
    assert (held["best"], held["best_step"]) == (evals[best], best) and held["start"] > held["best"]


def test_the_guards_abort_writes_summary_json(tmp_path):
    """lr 1e4: every update diverges, the guard stops the run (exit 1); summary.json says so (the plot
    used to say "running or stopped")."""
    out = tmp_path / "run"
    res = mpirun(2, "--out", out, "--lr", "1e4", "--max-rollbacks", "3", timeout=60)
    assert res.returncode == 1 and res.stderr.count("fired 4 times without progress") == 1
    s = summary(out)
    assert s["status"] == "diverged" and "fired 4 times without progress" in s["reason"]
    assert s["final_step"] == 4 and [r["step"] for r in s["rollbacks"]] == [1, 2, 3] and s["invariants"] is None
    assert s["held_out"]["best_step"] is None and s["last_step"]["step"] == 3
    plot = subprocess.run([sys.executable, "-m", "capstone.plot", str(out), "--out", str(tmp_path / "p.png")],
                          capture_output=True, text=True, env=mpi_env(), cwd=ROOT, timeout=120)
    assert "status diverged" in plot.stdout + plot.stderr, plot.stdout + plot.stderr


def test_a_collective_timeout_writes_summary_json(tmp_path):
    """Rank 1 stalls at step 3: a rank whose wait expires writes summary.json "timeout" with the record."""
    out = tmp_path / "stall"
    rc, text, _ = stalled_run(out, "stall:1:3")
    assert rc != 0 and "collective timeout" in text
    s = summary(out)
    assert s["status"] == "timeout" and s["reason"] == "reduce-scatter of the gradient"
    assert s["timeout"]["at"] == "step 3" and s["timeout"]["rank"] != 1 and s["final_step"] == 3
    assert [x[0] for x in s["losses"]] == [1, 2] and s["checkpoints"][-1]["step"] == 2


def test_a_fresh_run_does_not_append_to_an_earlier_runs_log(tmp_path):
    """An earlier run left metrics.jsonl and no checkpoint (here: the guard stopped it): a fresh run there
    is refused and changes nothing; --resume auto starts that run over in the same log."""
    out = tmp_path / "run"
    assert mpirun(2, "--out", out, "--lr", "1e4", timeout=60).returncode == 1
    before = digest(out / "metrics.jsonl")
    clean_error(mpirun(2, "--out", out), "metrics.jsonl of an earlier run", "new --out", "Nothing was changed")
    assert digest(out / "metrics.jsonl") == before and not os.listdir(out / "checkpoints")
    res = mpirun(2, "--out", out, "--resume", "auto")
    assert res.returncode == 0, res.stdout + res.stderr
    starts = [r for r in map(json.loads, open(out / "metrics.jsonl")) if r.get("event") == "start"]
    assert len(starts) == 2 and summary(out)["status"] == "completed"


def test_resume_auto_on_a_finished_run_is_done(tmp_path):
    """Exit 0 with one line, summary.json and metrics.jsonl untouched; --resume latest keeps its exit 2;
    the Slurm step (scripts/slurm/step.sh) then ends the batch job with 0, status completed, also when
    the time limit's SIGUSR1 reaches the batch shell after the step has ended (it used to kill the
    shell: exit 138, a FAILED job that had finished)."""
    out = tmp_path / "run"
    assert mpirun(2, "--out", out, "--steps", 4).returncode == 0
    kept = {name: digest(out / name) for name in ("summary.json", "metrics.jsonl")}
    res = mpirun(2, "--out", out, "--steps", 4, "--resume", "auto")
    assert res.returncode == 0 and res.stdout.count("the run is finished, nothing to do") == 1, res.stdout + res.stderr
    assert {name: digest(out / name) for name in kept} == kept
    clean_error(mpirun(2, "--out", out, "--steps", 4, "--resume", "latest"), "nothing left to do", "--steps larger")
    # the job around the step (capstone.runtime.job) gets a real SIGUSR1 once the step has ended
    script = ('source scripts/slurm/step.sh && run_step "$0" "$1" mpirun -n 2 --oversubscribe '
              '"$1" -m capstone.train --out "$0" --resume auto --steps 4')
    step = subprocess.run(["bash", "-c", script, str(out), sys.executable], capture_output=True, text=True,
                          env={**mpi_env(), "CAPSTONE_JOB_FAULT": "usr1-after-step"}, cwd=ROOT, timeout=120)
    assert step.returncode == 0 and "summary status: completed" in step.stdout, step.stdout + step.stderr
    assert "SIGUSR1 after the job step ended" in step.stdout, step.stdout
    assert {name: digest(out / name) for name in kept} == kept


def test_a_stop_after_the_checkpoint_already_passed_is_refused_on_resume(tmp_path):
    """`--resume latest --stop-after 2` from step 3 never stopped and trained on to --steps; it is a usage
    error now (exit 2, nothing written), and the stop's hint says so; `--resume auto` (a requeued batch
    job after that planned stop) trains on to the end."""
    out = tmp_path / "run"
    first = mpirun(2, "--out", out, "--steps", 6, "--stop-after", 3)
    assert first.returncode == 0 and "--resume latest and --stop-after above 3 or none" in first.stdout, first.stdout
    kept = {name: digest(out / name) for name in ("summary.json", "metrics.jsonl")}
    clean_error(mpirun(2, "--out", out, "--steps", 6, "--resume", "latest", "--stop-after", 2),
                "--stop-after 2 is not after", "step 3", "--stop-after larger than 3")
    assert {name: digest(out / name) for name in kept} == kept
    res = mpirun(2, "--out", out, "--steps", 6, "--resume", "auto", "--stop-after", 3)
    assert res.returncode == 0 and summary(out)["status"] == "completed", res.stdout + res.stderr


def test_a_changed_global_batch_is_listed_on_resume(tmp_path):
    """2 ranks x 4 sequences, resumed on 4 ranks: the global batch doubles; it is listed with the other
    changed settings (it used to change without a word)."""
    out = tmp_path / "run"
    assert mpirun(2, "--out", out, "--stop-after", 5).returncode == 0
    res = mpirun(4, "--out", out, "--resume", "latest", "--steps", 8)
    assert res.returncode == 0, res.stdout + res.stderr
    note = [ln for ln in res.stdout.splitlines() if ln.startswith("note: resuming with changed settings")]
    assert note and "global batch (sequences per step): 8 -> 16" in note[0] and "steps: 20 -> 8" in note[0], note


def test_a_preset_on_resume_is_refused_when_it_contradicts_the_checkpoint(tmp_path):
    """--preset used to be dropped without a word on --resume. The same command line again (a requeued
    job) resumes; a preset that sets other values is refused, naming them."""
    out = tmp_path / "run"
    same = ["--preset", "reference", "--lr", "5e-3", "--steps", 6]
    assert mpirun(2, "--out", out, *same, "--stop-after", 3).returncode == 0
    res = mpirun(2, "--out", out, *same, "--resume", "latest")
    assert res.returncode == 0 and summary(out)["train_config"]["lr"] == 5e-3, res.stdout + res.stderr
    clean_error(mpirun(2, "--out", out, "--preset", "medium", "--steps", 200, "--resume", "latest"),
                "--preset medium contradicts", "d_model 32 there, 256 in the preset", "drop --preset")


@pytest.mark.parametrize("first, then", [(8, 12), (12, 8)], ids=["longer", "shorter"])
def test_the_same_preset_resumes_with_another_steps(tmp_path, first, then):
    """A preset's warmup is fitted to the run's --steps (medium's 40 of 400 -> 1); resuming the same preset
    with another --steps compares the preset as fitted to the run's own steps, not to the new --steps
    (it was refused: "warmup_steps 1 there, 2 in the preset"); without --steps the preset's own steps
    contradict the run's. A tiny medium: its model flags given."""
    out, tiny = tmp_path / "run", ["--preset", "medium", "--d-model", 32, "--n-heads", 2, "--n-layers", 1,
                                   "--seq-len", 16, "--batch-size", 2, "--eval-batches", 1, "--eval-batch-size", 2]
    assert mpirun(2, "--out", out, *tiny, "--steps", first, "--stop-after", 4).returncode == 0
    clean_error(mpirun(2, "--out", out, *tiny, "--resume", "latest"),   # without --steps: the preset's 400 is not the run's
                "--preset medium contradicts", f"steps {first} there, 400 in the preset")
    res = mpirun(2, "--out", out, *tiny, "--steps", then, "--resume", "latest")
    assert res.returncode == 0 and summary(out)["final_step"] == then, res.stdout + res.stderr


def test_a_warmup_longer_than_the_run_is_refused(tmp_path):
    """It left the lr below its peak for the whole run; refused before anything is written. On resume the
    warmup is judged against the checkpoint's --steps, not the default 20."""
    out = tmp_path / "run"
    clean_error(mpirun(2, "--out", out, "--warmup-steps", 30), "--warmup-steps 30 is longer than steps 20",
                "--warmup-steps 20 or fewer")
    assert not out.exists()
    assert mpirun(2, "--out", out, "--steps", 40, "--stop-after", 2).returncode == 0
    res = mpirun(2, "--out", out, "--resume", "latest", "--warmup-steps", 30, "--stop-after", 3)
    assert res.returncode == 0 and "warmup_steps: 0 -> 30" in res.stdout, res.stdout + res.stderr


LATE_SIGNAL = r'''
import atexit, os, signal, sys, time
from mpi4py import MPI
from capstone import train
pids = MPI.COMM_WORLD.allgather(os.getpid())
sig = getattr(signal, sys.argv.pop(1))
if MPI.COMM_WORLD.Get_rank() == 1:   # after main's exit, before this rank's MPI_Finalize: rank 0 waits in its own
    atexit.register(lambda: (time.sleep(1.0), os.kill(pids[0], sig), time.sleep(0.5)))
train.main(sys.argv[1:])
'''


def late_signal(tmp_path, name, *flags):
    return subprocess.run(["mpirun", "-n", "2", "--oversubscribe", sys.executable, "-c", LATE_SIGNAL, name, "--out",
                           str(tmp_path / "run"), *map(str, flags)], capture_output=True, text=True, timeout=120,
                          env=mpi_env(), cwd=ROOT)


def test_a_refused_start_exits_2_on_every_rank_when_the_launcher_terminates_a_slow_one(tmp_path):
    """A refused start (exit 2 agreed by every rank) where one rank is still finalizing MPI when the
    launcher sends it SIGTERM, as srun --kill-on-bad-exit and mpirun do once the first rank has exited
    non-zero: a real SIGTERM to rank 0 while it waits in MPI_Finalize. Python has restored SIGTERM's
    default action by then, so the rank used to end "Terminated" and the job with 143 (the multi-node
    Slurm test of a cyclic placement saw it); the status stays 2, the error printed once."""
    res = late_signal(tmp_path, "SIGTERM", "--steps", 0)
    clean_error(res, "--steps")
    assert "signal 15" not in res.stdout + res.stderr, res.stdout + res.stderr


def test_a_time_limit_warning_as_a_run_completes_leaves_it_completed(tmp_path):
    """Slurm's time-limit warning (--signal=B:USR1@60, which the batch script forwards) landing while a
    completed run finalizes MPI: a real SIGUSR1 to rank 0 in MPI_Finalize. Python has restored the
    default action (terminate) by then, so the rank used to die of it and a finished job to end FAILED
    with 138 (CI's two-node time-limit test saw it on a requeued job, warned early); it exits 0."""
    res = late_signal(tmp_path, "SIGUSR1", "--steps", 2)
    assert res.returncode == 0, res.stdout + res.stderr
    assert summary(tmp_path / "run")["status"] == "completed"


def test_a_sigterm_at_any_instant_leaves_a_record_that_names_the_newest_checkpoint(tmp_path):
    """Issue 53, item 1: `timeout 60 mpirun ... python -m capstone.train` (SIGTERM to mpirun, Open MPI's default
    kill sequence: SIGKILL 2 s later) once left its stop's checkpoint and no summary.json: the ranks were
    killed during their end-of-run checks. A stop's record is now written as soon as its checkpoint is
    published. 20 SIGTERMs spread over start-up, the steps, the saves and the end of a run: afterwards, every
    run that began training has a summary.json whose newest checkpoint is the one `latest` names."""
    from test_ctrl_c import plain_env
    flags = ["--steps", "30", "--sleep-per-step", "0.03", "--ckpt-every", "5"]

    def launch(out):
        return subprocess.Popen(["mpirun", "-n", "2", "python", "-m", "capstone.train", *flags, "--out", str(out)],
                                env=plain_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.monotonic()
    assert launch(tmp_path / "timed").wait(timeout=120) == 0
    whole = time.monotonic() - t0
    started = 0
    for i in range(20):
        out = tmp_path / f"run{i}"
        proc = launch(out)
        time.sleep(i * whole / 19)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        if not (out / "metrics.jsonl").exists():
            continue    # stopped before it began training: nothing to account for
        started += 1
        s = summary(out)
        latest = files.read_pointer(str(out / "checkpoints"))
        named = s.get("newest_checkpoint") or (s["checkpoints"][-1]["path"] if s.get("checkpoints") else None)
        assert s["status"] in ("preempted", "completed", "stopping"), (i, s)
        assert (named and latest and os.path.samefile(named, latest)) or (named is None and latest is None), (i, s)
    assert started >= 15, started


def test_a_kill_sequence_during_the_end_of_run_checks_keeps_the_stops_record(tmp_path):
    """The case the issue saw under load, made certain: a stop (--stop-after 4) saves its checkpoint, then the
    end-of-run checks are slow (rank 0 stalls in invariant (d)'s reload: CAPSTONE_FAULT=stall:0:4:load) and a
    SIGTERM to mpirun brings Open MPI's kill sequence (SIGKILL 2 s later) before the run's summary: the stop's
    own record is there, naming its checkpoint. The code before left no summary.json at all."""
    from test_ctrl_c import plain_env
    out = tmp_path / "run"
    proc = subprocess.Popen(["mpirun", "-n", "2", "python", "-m", "capstone.train", "--steps", "10", "--stop-after",
                             "4", "--ckpt-every", "2", "--out", str(out)], env={**plain_env(),
                            "CAPSTONE_FAULT": "stall:0:4:load"}, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (out / "checkpoints" / "ckpt-00000004.h5").exists():
        time.sleep(0.1)
    time.sleep(1.5)                     # the stop's record, then the stalled reload
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "stalling this rank" in stdout, stdout
    s = summary(out)
    assert s["status"] == "stopping" and s["final_step"] == 4, s
    assert os.path.samefile(s["newest_checkpoint"], out / "checkpoints" / "ckpt-00000004.h5")


def test_a_ctrl_c_during_the_first_save_is_on_record_at_the_next_start(tmp_path):
    """Issue 53: a Ctrl-C (SIGINT to mpirun's process group, Open MPI's default kill sequence) while the first
    checkpoint is being written (rank 0 stalled in it: CAPSTONE_FAULT=stall:0:2:save.after_data) kills the ranks
    before any record: nobody outlives them under plain mpirun, so the next start in the directory writes it
    first (its newest checkpoint: none, the partial file set aside) and says so, then trains."""
    from test_ctrl_c import plain_env
    out = tmp_path / "run"
    cmd = ["mpirun", "-n", "2", "python", "-m", "capstone.train", "--steps", "4", "--ckpt-every", "2", "--out", str(out)]
    proc = subprocess.Popen(cmd, env={**plain_env(), "CAPSTONE_FAULT": "stall:0:2:save.after_data"}, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(".partial" in p.name for p in (out / "checkpoints").glob("*")):
        time.sleep(0.05)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "stalling this rank" in stdout, stdout
    assert not (out / "summary.json").exists() and files.read_pointer(str(out / "checkpoints")) is None
    again = subprocess.run([*cmd, "--resume", "auto"], env=plain_env(), cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    said = [ln for ln in again.stdout.splitlines() if "the launch ended without the ranks' record" in ln]
    assert len(said) == 1 and said[0].endswith("its newest checkpoint is none"), again.stdout
    assert summary(out)["status"] == "completed"
