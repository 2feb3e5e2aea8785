"""Fine-tuning (--init-from a checkpoint or an export, on any grid; prepare --vocab-from) and the best
checkpoint (--keep-best), end to end on tiny models and texts (a few seconds each)."""

import json
import random
import signal
import subprocess
import sys

import pytest

from conftest import ROOT, mpi_env, mpirun, step_rows, summary, wait_for_steps

WORDS_A = "the of and to in is that it was for on are as with his they at be this from have or by one".split()
WORDS_B = "then she so these other into has her two time mother either heart hand boat worth bread stream".split()
MODEL = ["--d-model", "32", "--n-layers", "2", "--n-heads", "4", "--seq-len", "32"]
TRAIN = ["--global-batch", "12", "--eval-batches", "2", "--eval-batch-size", "8", "--quiet"]


def run_module(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", *map(str, args)], capture_output=True, text=True, env=mpi_env(),
                          cwd=ROOT, timeout=timeout)


def text(path, words, seed, n=900):
    rng = random.Random(seed)
    path.write_text(" ".join(rng.choice(words) for _ in range(n)))
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A model trained on text A (200 steps, cosine from 3e-3 after 20 steps of warmup), its dataset, its export,
    and text B prepared with A's vocabulary."""
    tmp = tmp_path_factory.mktemp("finetune")
    a = text(tmp / "a.txt", WORDS_A, 1)
    b = text(tmp / "b.txt", WORDS_A[:12] + WORDS_B, 2)   # half of A's words, and new ones
    assert set("".join(WORDS_B)) <= set("".join(WORDS_A)), "B is written in A's letters"
    assert run_module("capstone.prepare", a, "--out", tmp / "a").returncode == 0
    res = run_module("capstone.prepare", b, "--out", tmp / "b", "--vocab-from", tmp / "a")
    assert res.returncode == 0, res.stderr
    res = mpirun(2, "--out", tmp / "run", "--data", tmp / "a", *MODEL, *TRAIN, "--steps", 200, "--eval-every", 50,
                 "--lr", "3e-3", "--lr-schedule", "cosine", "--warmup-steps", 20, "--min-lr", "3e-4", "--clip", 1)
    assert res.returncode == 0, res.stdout + res.stderr
    assert run_module("capstone.export", tmp / "run", "--out", tmp / "run.safetensors").returncode == 0
    return tmp


def held_out_loss(ckpt, data_dir, batches=2, size=8) -> float:
    """The held-out loss of a checkpoint's weights on a dataset's evaluation batches, computed here in one
    process (the sampler's reader, the model's loss): not through --init-from."""
    from capstone.data.tokens import TokenData
    from capstone.model.gpt import loss_sum
    from capstone.model.params import Layout
    from capstone.sample import load_checkpoint
    _, cfg, params = load_checkpoint(str(ckpt))
    data, groups = TokenData(str(data_dir), cfg.seq_len, 1, 0), Layout.for_model(cfg, 1).groups(params)
    total = sum(float(loss_sum(groups, *data.val_batch(k, size), cfg)) for k in range(batches))
    return total / (batches * size * cfg.seq_len)


@pytest.mark.parametrize("source, ranks, tp", [("run", 3, 1), ("run.safetensors", 2, 1), ("run", 4, 2)],
                         ids=["checkpoint-on-3-ranks", "export", "checkpoint-on-tp-2"])
def test_init_from_starts_from_the_weights_with_a_fresh_optimizer(base, tmp_path, source, ranks, tp):
    """The new run's starting held-out loss on text B is the source weights' (computed here apart), whatever
    the source (checkpoint or export) and the grid; the model is the source's; the steps and Adam start at 0."""
    out = tmp_path / "ft"
    res = mpirun(ranks, "--out", out, "--init-from", base / source, "--data", base / "b", *TRAIN, "--steps", 6,
                 "--tp", tp, "--ckpt-every", 2, "--lr", "1e-3")
    assert res.returncode == 0, res.stdout + res.stderr
    s, trained = summary(out), summary(base / "run")
    want = held_out_loss(base / "run" / "checkpoints" / "ckpt-00000200.h5", base / "b")
    assert s["held_out"]["start"] == pytest.approx(want, rel=1e-5), (s["held_out"], want)
    assert s["model_config"] == trained["model_config"] and s["start_step"] == 0 and s["final_step"] == 6
    assert s["provenance"]["init_from"]["step"] == 200
    assert s["provenance"]["init_from"]["kind"] == ("export" if source.endswith("safetensors") else "checkpoint")
    info = json.loads(run_module("capstone.checkpoint", "inspect", "--json", out / "checkpoints" / "ckpt-00000002.h5").stdout)
    assert info["adam_t"] == 2 and info["run"]["step"] == 2, "Adam and the step count restarted at 0"


@pytest.mark.parametrize("source", ["run", "run.safetensors"], ids=["checkpoint", "export"])
def test_init_from_takes_the_source_runs_training_settings(base, tmp_path, source):
    """No training flags: a checkpoint's run gives the lr, schedule, clip, cadence and evaluation, its warmup
    (20 of 200 steps) shortened to 1 of 6; an export, which holds none, the documented fine-tuning defaults
    (warmup 30 of 300 -> 1); a flag wins over both; the start says what is in effect."""
    out = tmp_path / "ft"
    res = mpirun(2, "--out", out, "--init-from", base / source, "--data", base / "b", "--steps", 6, "--eval-every", 3,
                 "--global-batch", 12, "--quiet")
    assert res.returncode == 0, res.stdout + res.stderr
    t = summary(out)["train_config"]
    want = {"lr": 3e-3, "lr_schedule": "cosine", "min_lr": 3e-4, "clip": 1.0, "eval_batches": 2,
            "eval_batch_size": 8} if source == "run" else \
        {"lr": 3e-4, "lr_schedule": "cosine", "min_lr": 3e-5, "clip": 1.0, "weight_decay": 0.1, "eval_batches": 4,
         "eval_batch_size": 8}
    assert {k: t[k] for k in want} == want and t["warmup_steps"] == 1 and t["eval_every"] == 3, t
    origin = f"--init-from {base / 'run' / 'checkpoints' / 'ckpt-00000200.h5'} (20 of its 200 steps)" \
        if source == "run" else "the fine-tuning defaults (30 of its 300 steps)"
    assert f"the warmup of {origin} is shortened to 1 for --steps 6" in res.stdout, res.stdout
    assert f"lr {want['lr']!r}, lr_schedule 'cosine'" in res.stdout and "eval_every 3 (flag)" in res.stdout


def test_fine_tune_on_another_text_with_keep_best(base, tmp_path):
    """Text B (half of A's words) with A's vocabulary: the fine-tuned model ends below a fresh model trained
    as long on B, and --keep-best keeps the best evaluation's state, which verifies and samples."""
    fresh, ft = tmp_path / "fresh", tmp_path / "ft"
    steps = ["--steps", 60, "--eval-every", 10, "--lr", "1e-3"]
    assert mpirun(2, "--out", fresh, "--data", base / "b", *MODEL, *TRAIN, *steps).returncode == 0
    res = mpirun(2, "--out", ft, "--init-from", base / "run", "--data", base / "b", *TRAIN, *steps, "--keep-best")
    assert res.returncode == 0, res.stdout + res.stderr
    s, f = summary(ft)["held_out"], summary(fresh)["held_out"]
    print(f"\nheld-out on text B after 60 steps: fresh model {f['start']:.4f} -> best {f['best']:.4f}; fine-tuned "
          f"from A: {s['start']:.4f} -> best {s['best']:.4f} at step {s['best_step']}")
    assert s["best"] < f["best"] - 0.1 and s["best"] < s["start"]
    assert summary(ft)["invariants"]["a_loss_monotone"]["ok"]
    s = summary(ft)
    evals = {r["step"]: r["eval_loss"] for r in step_rows(ft) if r["eval_loss"] is not None}
    best_step = min(evals, key=evals.get)
    kept = ft / "checkpoints" / "best" / f"ckpt-{best_step:08d}.h5"
    assert s["held_out"]["best_step"] == best_step and s["held_out"]["best_checkpoint"] == str(kept)
    assert sorted(p.name for p in (ft / "checkpoints" / "best").iterdir()) == [kept.name, kept.name + ".sha256", "latest"]
    assert run_module("capstone.checkpoint", "verify", ft / "checkpoints" / "best").returncode == 0
    sample = run_module("capstone.sample", ft / "checkpoints" / "best", "--tokens", 40)
    assert sample.returncode == 0 and len(sample.stdout) >= 40, sample.stderr


def test_keep_best_keeps_the_best_not_the_last(base, tmp_path):
    """A wider model overfits text A: the best checkpoint is the lowest held-out evaluation, not the last
    one; the --keep-last 1 rotation and a resume leave it alone."""
    out = tmp_path / "run"
    res = mpirun(2, "--out", out, "--data", base / "a", "--d-model", 64, "--n-heads", 4, "--seq-len", 32, *TRAIN,
                 "--steps", 300, "--eval-every", 25, "--lr", "3e-3", "--keep-best", "--keep-last", 1)
    assert res.returncode == 0, res.stdout + res.stderr
    evals = {r["step"]: r["eval_loss"] for r in step_rows(out) if r["eval_loss"] is not None}
    best_step = min(evals, key=evals.get)
    assert best_step != 300, f"choose a run whose last evaluation is not its best: {evals}"
    best_dir = out / "checkpoints" / "best"
    assert (best_dir / "latest").read_text().strip() == f"ckpt-{best_step:08d}.h5"
    assert len(list(best_dir.glob("ckpt-*.h5"))) == 1
    info = json.loads(run_module("capstone.checkpoint", "inspect", "--json", best_dir).stdout)
    assert info["best"] == {"held_out": evals[best_step], "step": best_step}
    events = [e["event"] for r in step_rows(out) for e in r["events"]]
    assert events.count("best") == sum(1 for s, v in evals.items() if v == min(u for t, u in evals.items() if t <= s))
    res = mpirun(2, "--out", out, "--resume", "latest", "--steps", 302)
    assert res.returncode == 0 and "resumed from " + str(out / "checkpoints" / "ckpt-00000300.h5") in res.stdout
    after = {r["step"]: r["eval_loss"] for r in step_rows(out) if r["eval_loss"] is not None}
    assert after[302] > evals[best_step], "the first evaluation after the resume must not be a new best"
    assert (best_dir / "latest").read_text().strip() == f"ckpt-{best_step:08d}.h5", \
        "judged against the best before the stop, not replaced by the first evaluation after the resume"
    assert summary(out)["held_out"]["best"] == evals[best_step]


@pytest.mark.parametrize("case", ["other vocabulary", "same size, other characters", "synthetic to text",
                                  "model flag", "preset of another model", "no such file", "corrupt checkpoint"])
def test_init_from_refusals(base, tmp_path, case):
    """Each refusal: one paragraph naming the fix, exit 2 (1 for a corrupt checkpoint), no run directory."""
    out = tmp_path / "ft"
    args = {"other vocabulary": ["--init-from", base / "run", "--data", tmp_path / "own"],
            "same size, other characters": ["--init-from", base / "run", "--data", tmp_path / "own"],
            "synthetic to text": ["--init-from", tmp_path / "synthetic", "--data", base / "a"],
            "model flag": ["--init-from", base / "run", "--data", base / "a", "--d-model", "64"],
            "preset of another model": ["--init-from", base / "run", "--data", base / "a", "--preset", "medium"],
            "no such file": ["--init-from", tmp_path / "nothing.safetensors"],
            "corrupt checkpoint": ["--init-from", tmp_path / "bad.h5"]}[case]
    if case == "other vocabulary":
        assert run_module("capstone.prepare", base / "b.txt", "--out", tmp_path / "own").returncode == 0
    if case == "same size, other characters":   # A's text with its one 'v' (in "have") spelled 'z': a char
        # vocabulary of A's kind and size, prepared without --vocab-from; id of 'z' here is the id of 'v' there
        (tmp_path / "z.txt").write_text((base / "a.txt").read_text().replace("v", "z"))
        assert run_module("capstone.prepare", tmp_path / "z.txt", "--out", tmp_path / "own").returncode == 0
        mine, theirs = (json.loads((d / "meta.json").read_text()) for d in (base / "a", tmp_path / "own"))
        assert mine["vocab_size"] == theirs["vocab_size"] and mine["tokenizer"]["kind"] == theirs["tokenizer"]["kind"]
    if case == "synthetic to text":
        assert mpirun(2, "--out", tmp_path / "synthetic", "--steps", 2).returncode == 0
    if case == "corrupt checkpoint":
        data = bytearray((base / "run" / "checkpoints" / "ckpt-00000200.h5").read_bytes())
        data[len(data) // 2] ^= 1
        (tmp_path / "bad.h5").write_bytes(bytes(data))
        (tmp_path / "bad.h5.sha256").write_text(
            (base / "run" / "checkpoints" / "ckpt-00000200.h5.sha256").read_text())
    res = mpirun(2, "--out", out, *args, *TRAIN)
    want = {"other vocabulary": "the vocabularies differ", "synthetic to text": "trained on the synthetic corpus",
            "same size, other characters": "only --data's has 'z'",
            "model flag": "--d-model 64 (it has 32)", "no such file": "no such file",
            "preset of another model": "--d-model 256 (it has 32)",
            "corrupt checkpoint": "not a valid checkpoint"}[case]
    assert res.returncode == (1 if case == "corrupt checkpoint" else 2), res.stdout + res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and want in errors[0] and "Traceback" not in res.stderr, res.stderr
    assert not out.exists(), "a refused start leaves nothing behind"


def test_prepare_vocab_from_refuses_characters_the_vocabulary_lacks(base, tmp_path):
    (tmp_path / "c.txt").write_text("the cat sat on the mat; 100% sure\n" * 20)
    res = run_module("capstone.prepare", tmp_path / "c.txt", "--out", tmp_path / "c", "--vocab-from", base / "a")
    assert res.returncode == 2 and "'%' x20" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "c").exists()


def test_an_export_takes_the_training_settings_of_the_preset_given():
    """An export holds no training settings: `--preset gpt2 --init-from DIR` (GPT-2's weights) trains with
    the gpt2 preset's (lr 3e-5, constant, no weight decay), not the fine-tuning defaults (lr 3e-4, cosine),
    which an export without a --preset gets; a flag still wins; the note names the preset."""
    import numpy as np

    from capstone import cli

    from capstone.gpt2 import finetune
    for argv, want in [(["--preset", "gpt2"], {"lr": 3e-5, "lr_schedule": "constant", "weight_decay": 0.0}),
                       (["--preset", "gpt2", "--lr", "1e-5"], {"lr": 1e-5, "lr_schedule": "constant"}),
                       ([], {"lr": 3e-4, "lr_schedule": "cosine", "weight_decay": 0.1})]:
        settings = cli.parse([*argv, "--init-from", "gpt2-dir"])
        model = cli.parse(["--preset", "gpt2"]).model
        source = finetune.Source("gpt2-dir/model.safetensors", "export", 0, model, {}, np.empty(0, np.float32))
        got = finetune.settings_for(settings, source)
        assert {k: getattr(got.train, k) for k in want} == want, (argv, got.train)
        assert ("--preset gpt2 (an export holds none)" in got.notes[0]) == bool(argv), got.notes


def test_init_from_an_hf_export_keeps_its_vocabulary(base, tmp_path):
    """`export --format hf` of a model trained on text keeps its tokenizer in model.safetensors' metadata
    (no vocab.json + merges.txt: a character vocabulary); --init-from that directory reads it there, as
    from a .safetensors export: text of the same vocabulary trains, the synthetic corpus is refused (it
    was read as ids only: the same-vocabulary text refused as "trained on the synthetic corpus", and
    no --data accepted)."""
    run, hf_dir = tmp_path / "run", tmp_path / "hf"
    res = mpirun(2, "--out", run, "--data", base / "a", *MODEL, *TRAIN, "--no-head-bias", "--steps", 4)
    assert res.returncode == 0, res.stdout + res.stderr
    assert run_module("capstone.export", run, "--out", hf_dir, "--format", "hf").returncode == 0
    res = mpirun(2, "--out", tmp_path / "ft", "--init-from", hf_dir, "--data", base / "b", *TRAIN, "--steps", 2)
    assert res.returncode == 0, res.stdout + res.stderr
    res = mpirun(2, "--out", tmp_path / "ids", "--init-from", hf_dir, *TRAIN, "--steps", 2)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1 and "the synthetic corpus (no --data)" in errors[0], res.stderr
    assert not (tmp_path / "ids").exists()


def test_an_unjudged_checkpoint_is_refused_directly_and_through_its_exports(base, tmp_path):
    """A stop between evaluations saves a state the guard never judged: --init-from refuses the checkpoint,
    and (it did not) its .safetensors and --format hf exports too, which say so in their metadata; the
    export itself still writes, with a note."""
    run = tmp_path / "run"
    cmd = ["mpirun", "-n", "2", sys.executable, "-m", "capstone.train", "--out", str(run), "--data", str(base / "a"),
           *MODEL, *TRAIN, "--no-head-bias", "--steps", "40", "--eval-every", "20", "--sleep-per-step", "0.3"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env(), cwd=ROOT)
    wait_for_steps(run, 3)
    proc.send_signal(signal.SIGUSR1)   # a stop between evaluations: saved without one
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0 and summary(run)["status"] == "preempted", stdout + stderr
    sources = [run]
    for out, fmt in ((tmp_path / "x.safetensors", []), (tmp_path / "hf", ["--format", "hf"])):
        res = run_module("capstone.export", run, "--out", out, *fmt)
        assert res.returncode == 0 and "the divergence guard judged it" in res.stdout, res.stdout + res.stderr
        sources.append(out)
    for k, source in enumerate(sources):
        res = mpirun(2, "--out", tmp_path / f"ft{k}", "--init-from", source, "--data", base / "b", *TRAIN)
        errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
        assert res.returncode == 2 and len(errors) == 1 and "before the divergence guard judged it" in errors[0], \
            f"{source}: {res.stdout + res.stderr}"
