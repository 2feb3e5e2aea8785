"""Ctrl-C on the README's plain route, with Open MPI's defaults (no scripts/env.sh MCA settings: the
kill sequence SIGKILLs the ranks 2 s after a Ctrl-C): every stop saves a checkpoint that verifies
and resumes; a stop's checkpoint the guard had not judged is judged on resume and, rejected, falls
back; the start-up warning when a stop cannot fit; scripts/launch's Ctrl-C as SIGUSR1."""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from capstone.checkpoint import files

from conftest import ROOT, mpirun, summary

WARNING = "warning: a Ctrl-C may not save this run"
WORDS = ("to be or not that is the question whether tis nobler in the mind to suffer the slings and arrows of "
         "outrageous fortune or take arms against a sea of troubles").split()


def plain_env() -> dict:
    """A shell as the README sets it up: the venv on PATH, the thread variables, and as root the two
    permissions; no OMPI_MCA_* (Open MPI's defaults: odls_base_sigkill_timeout 1)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_MCA_")}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1", PATH=os.path.dirname(sys.executable) + os.pathsep
               + env.get("PATH", ""), PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def readme_command(preset: str) -> list[str]:
    """The README's commands, as written."""
    if preset == "shakespeare-char":
        return ["mpirun", "-n", "2", "python", "-m", "capstone.train", "--preset", "shakespeare-char", "--out", "runs/shk"]
    return ["mpirun", "-n", "4", "--oversubscribe", "python", "-m", "capstone.train", "--steps", "5000", "--out", "runs/ref"]


def launched_rows(out, launch: int = 1) -> list:
    """metrics.jsonl's rows of its `launch`th launch (from its "start" row on; [] before it starts)."""
    try:
        rows = [json.loads(ln) for ln in open(os.path.join(out, "metrics.jsonl")) if ln.strip()]
    except (OSError, ValueError):
        return []
    starts = [i for i, r in enumerate(rows) if r.get("event") == "start"] + [len(rows)]
    return rows[starts[launch - 1]:starts[launch]] if len(starts) > launch else []


def interrupted(cwd, cmd, out, rng, launch: int) -> tuple[subprocess.CompletedProcess, float]:
    """Run `cmd`; once this launch has trained a step, wait a random moment, then Ctrl-C: SIGINT to the
    process group of mpirun, as a terminal sends it. (the result, the delay)"""
    proc = subprocess.Popen(cmd, cwd=cwd, env=plain_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 90
    while time.time() < deadline and proc.poll() is None and not any("step" in r for r in launched_rows(out, launch)):
        time.sleep(0.05)
    delay = rng.uniform(0.0, 1.0)
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=90)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), delay


def trials(cwd, preset: str, n: int, seed: int) -> list[str]:
    """n Ctrl-Cs in a row in `cwd`: the README's command, then the same with --resume latest, each
    interrupted; then a resume that trains a step. The problems found (empty: none)."""
    rng, cmd, problems, final, verifying = random.Random(seed), readme_command(preset), [], None, []
    out = os.path.join(cwd, cmd[cmd.index("--out") + 1])
    ckpts = os.path.join(out, "checkpoints")
    for k in range(n):
        if os.path.exists(os.path.join(out, "summary.json")):
            os.remove(os.path.join(out, "summary.json"))   # so that the one read is this launch's
        res, delay = interrupted(cwd, cmd + (["--resume", "latest"] if k else []), out, rng, k + 1)
        where = f"{preset} trial {k + 1} (Ctrl-C {delay:.2f} s after its first step)"
        s = summary(out) if os.path.exists(os.path.join(out, "summary.json")) else {}
        pointed = files.read_pointer(ckpts)
        ok = s.get("status") == "preempted" and s.get("start_step") == (final or 0) and pointed is not None \
            and os.path.basename(pointed) == files.final_name(s.get("final_step", -1))
        if not ok:
            problems.append(f"{where}: status {s.get('status')}, steps {s.get('start_step')}-{s.get('final_step')} "
                            f"(after {final}), latest {pointed}\n{res.stdout[-1500:]}{res.stderr[-1500:]}")
            return problems
        verifying.append((where, subprocess.Popen([sys.executable, "-m", "capstone.checkpoint", "verify", pointed],
                                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                                  env=plain_env(), cwd=cwd)))   # beside the next launch
        final = s["final_step"]
    res = subprocess.run(cmd + ["--resume", "latest", "--stop-after", str(final + 1)], cwd=cwd, env=plain_env(),
                         capture_output=True, text=True, timeout=120)
    s = summary(out)
    if res.returncode != 0 or (s["start_step"], s["final_step"], s["status"]) != (final, final + 1, "preempted"):
        problems.append(f"{preset}: the resume of step {final}: rc {res.returncode}\n{res.stdout[-1500:]}{res.stderr}")
    for where, proc in verifying:
        text = proc.communicate(timeout=120)[0]
        if proc.returncode != 0:
            problems.append(f"{where}: capstone.checkpoint verify: rc {proc.returncode}\n{text}")
    return problems


def text_data(base) -> str:
    """A small character-level dataset made here (no network), where the README's command looks for it."""
    rng = random.Random(7)
    text = base / "text.txt"
    text.write_text("".join(" ".join(rng.choice(WORDS) for _ in range(9)).capitalize() + ".\n" for _ in range(3000)))
    subprocess.run([sys.executable, "-m", "capstone.prepare", str(text), "--out", str(base / "data" / "shakespeare")],
                   check=True, capture_output=True, env=plain_env())
    return str(base / "data")


@pytest.fixture(scope="module")
def slow_steps(tmp_path_factory):
    """Two runs of 1.6 s steps, started first and left to run beside the trials (they mostly sleep):
    plain mpirun, whose stop cannot fit the 2 s kill sequence; and scripts/launch, to be Ctrl-C'd."""
    base = tmp_path_factory.mktemp("slow")
    flags = ["--sleep-per-step", "1.6", "--ckpt-every", "0"]
    plain = subprocess.Popen(["mpirun", "-n", "2", "python", "-m", "capstone.train", "--steps", "5", *flags, "--out",
                              str(base / "plain")], env=plain_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    launch = subprocess.Popen([os.path.join(ROOT, "scripts", "launch"), str(base / "launch"), "mpirun", "-n", "2",
                               "python", "-m", "capstone.train", "--steps", "60", *flags, "--out", str(base / "launch")],
                              env={**plain_env(), "CAPSTONE_PYTHON": sys.executable}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    yield {"plain": (plain, base / "plain"), "launch": (launch, base / "launch")}
    for proc in (plain, launch):   # mpirun under scripts/launch has a session of its own: SIGUSR1 stops it
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGUSR1 if proc is launch else signal.SIGKILL)
            proc.communicate(timeout=60)


def test_ctrl_c_on_the_readme_route_saves_a_checkpoint_that_resumes(tmp_path, slow_steps):
    """10 Ctrl-Cs of `mpirun -n 2 python -m capstone.train --preset shakespeare-char` (two series of
    5 side by side) and 3 of the reference run on 4 ranks beside them, at random moments after the launch's first
    step, each launch after the first resuming the last one's checkpoint: each ends "preempted", with
    `latest` naming a complete checkpoint of its last step that `capstone.checkpoint verify` accepts,
    and the next launch resumes from it; a last resume trains a step (fails before the fast stop under
    load: the stop's held-out evaluation outlasted the kill sequence)."""
    data = text_data(tmp_path)
    series = [("shakespeare-char", 5, 1), ("shakespeare-char", 5, 2), ("reference", 3, 3)]   # more at once: overload
    found: list = []

    def one(i, preset, n, seed):
        cwd = tmp_path / f"series{i}"
        cwd.mkdir()
        os.symlink(data, cwd / "data")
        try:
            found.extend(trials(str(cwd), preset, n, seed))
        except Exception as exc:   # a thread's exception would otherwise be lost
            found.append(f"{preset} series {i}: {exc!r}")
    threads = [threading.Thread(target=one, args=(i, *s)) for i, s in enumerate(series)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not found, "\n\n".join(found)


def test_a_stop_checkpoint_the_guard_rejects_is_set_aside_and_the_run_falls_back(tmp_path):
    """A signal at step 6 (CAPSTONE_FAULT=usr1, a real SIGUSR1) after a spiked update 5 that no
    evaluation saw (--eval-every 100): the stop saves step 5 without judging it, marked so; the
    resume judges it (held-out spike), sets it aside, falls back to step 3's checkpoint and finishes
    as a clean run does (catches: an unjudged state trained from)."""
    out, flags = tmp_path / "run", ["--steps", "12", "--eval-every", "100", "--ckpt-every", "3"]
    res = mpirun(2, "--out", out, *flags, "--inject-lr-spike", "5:1000", env_extra={"CAPSTONE_FAULT": "usr1:1:6"})
    assert res.returncode == 0 and summary(out)["status"] == "preempted", res.stdout + res.stderr
    assert "saved without its held-out evaluation: a resume judges it first" in res.stdout
    stop = [r for r in map(json.loads, open(out / "metrics.jsonl")) if r.get("event") == "stop"]
    assert [(r["abandoned_step"], r["saved_step"], r["judged"]) for r in stop] == [(6, 5, False)]
    res = mpirun(2, "--out", out, "--resume", "latest")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("fails that judgement now: eval_spike") == 1, res.stdout
    left = sorted(os.listdir(out / "checkpoints"))
    assert any(n.startswith("ckpt-00000005.h5.rejected-") for n in left), left
    s = summary(out)
    assert (s["start_step"], s["final_step"], s["status"]) == (3, 12, "completed")
    clean = mpirun(2, "--out", tmp_path / "clean", *flags)
    assert summary(tmp_path / "clean")["losses"][-1] == s["losses"][-1], clean.stdout


def test_the_start_warns_once_when_a_stop_cannot_fit_the_kill_sequence(slow_steps, reference):
    """1.6 s steps under plain mpirun (a 2 s kill sequence): one warning after the measured steps,
    naming scripts/launch and kill -USR1; the reference run, whose stop fits, measured and silent."""
    proc, out = slow_steps["plain"]
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stdout + stderr
    assert stdout.count(WARNING) == 1 and "scripts/launch" in stdout and "kill -USR1" in stdout, stdout
    margin = [r for r in map(json.loads, open(out / "metrics.jsonl")) if r.get("event") == "stop_margin"]
    assert len(margin) == 1 and not margin[0]["fits"] and margin[0]["step_s"] >= 1.6
    ref_out, ref, _ = reference
    assert WARNING not in ref.stdout + ref.stderr
    assert [r["fits"] for r in map(json.loads, open(ref_out / "metrics.jsonl")) if r.get("event") == "stop_margin"] \
        == [True]


def test_a_save_that_cannot_fit_is_said_before_the_first_step(tmp_path):
    """Issue 53, item 2: a run whose save alone does not fit the kill sequence says so before its first
    step (a Ctrl-C in the first steps would lose the stop's checkpoint), from the checkpoint's size and
    the disk's measured speed; no hidden checkpoint is written for it. A kill sequence of 0 s
    (OMPI_MCA_odls_base_sigkill_timeout=0) leaves no save the time. The code before measured after
    step 4 only, so a 3-step run was never warned."""
    out = tmp_path / "run"
    res = subprocess.run(["mpirun", "-n", "2", "--oversubscribe", "python", "-m", "capstone.train", "--steps", "3",
                          "--out", str(out)], env={**plain_env(), "OMPI_MCA_odls_base_sigkill_timeout": "0"},
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    said = [i for i, ln in enumerate(lines) if ln.startswith(WARNING)]
    first_step = next(i for i, ln in enumerate(lines) if ln.split()[:1] == ["1"])
    assert len(said) == 1 and said[0] < first_step and "before any step's time" in lines[said[0]], res.stdout
    margin = [r for r in map(json.loads, open(out / "metrics.jsonl")) if r.get("event") == "stop_margin"]
    assert [(r["at_step"], r["step_s"], r["fits"]) for r in margin] == [(0, None, False)], margin
    assert margin[0]["checkpoint_bytes"] > 0 and margin[0]["save_s"] > 0
    assert sorted(os.listdir(out / "checkpoints")) == ["ckpt-00000003.h5", "ckpt-00000003.h5.sha256", "latest"]


def test_scripts_launch_turns_ctrl_c_into_sigusr1(slow_steps):
    """Ctrl-C (SIGINT to the process group) of scripts/launch with 1.6 s steps: mpirun gets SIGUSR1, no
    kill sequence, so the run saves and exits 0, "preempted"."""
    proc, out = slow_steps["launch"]
    deadline = time.time() + 90
    while time.time() < deadline and len([r for r in launched_rows(out) if "step" in r]) < 2:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0 and "Ctrl-C: asking the job to checkpoint and stop" in stdout, stdout
    s = summary(out)
    assert s["status"] == "preempted" and files.read_pointer(str(out / "checkpoints")).endswith(
        files.final_name(s["final_step"])), stdout


def launch_slow(out, steps: int, **popen) -> subprocess.Popen:
    """scripts/launch RUN_DIR mpirun -n 2 ... of 0.5 s steps and no checkpoint cadence, in a session of its own."""
    return subprocess.Popen([os.path.join(ROOT, "scripts", "launch"), str(out), "mpirun", "-n", "2", "python", "-m",
                             "capstone.train", "--steps", str(steps), "--sleep-per-step", "0.5", "--ckpt-every", "0",
                             "--out", str(out)], env={**plain_env(), "CAPSTONE_PYTHON": sys.executable},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, **popen)


def test_scripts_launch_started_with_ctrl_c_ignored_still_stops_on_it(tmp_path):
    """Issue 53, item 6: a `&` job of a non-interactive shell starts with SIGINT ignored, which bash cannot
    trap; the job around the step (capstone.runtime.job, Python) catches it all the same: Ctrl-C to the
    process group saves and stops (it used to do nothing: the run trained to its end)."""
    out = tmp_path / "bg"
    proc = launch_slow(out, 60, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    deadline = time.time() + 90
    while time.time() < deadline and proc.poll() is None and len([r for r in launched_rows(out) if "step" in r]) < 2:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "Ctrl-C: asking the job to checkpoint and stop" in stdout, stdout
    s = summary(out)
    assert s["status"] == "preempted" and s["final_step"] < 60, stdout


def test_a_ctrl_c_as_scripts_launch_starts_is_kept_until_the_ranks_can_act_on_it(tmp_path):
    """Ctrl-C as scripts/launch starts mpirun (a requeued Slurm job warned of its time limit as it starts is
    the same case): the request is held until the step is CAPSTONE_SIGNAL_SETTLE old, then forwarded. It
    used to be lost (mpirun's first moments drop a SIGUSR1) and the run trained to its end, or to kill
    setsid before it became mpirun (exit 138); now the run stops at a step boundary, saved, exit 0."""
    out = tmp_path / "early"
    proc = launch_slow(out, 40)
    def comm(pid: str) -> str:   # a child may end between the listing and the read
        try:
            return open(f"/proc/{pid}/comm").read().strip()
        except OSError:
            return ""

    def launched():   # mpirun is a child of the job (capstone.runtime.job, which the script execs)
        children = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
        return any(comm(c) in ("setsid", "mpirun") for c in children)
    deadline = time.time() + 30
    while time.time() < deadline and proc.poll() is None and not launched():
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "Ctrl-C: asking the job to checkpoint and stop" in stdout, stdout
    s = summary(out)
    assert s["status"] == "preempted" and s["final_step"] < 40, stdout
    assert files.read_pointer(str(out / "checkpoints")).endswith(files.final_name(s["final_step"])), stdout
