"""Usage mistakes (issue 34, item 7): every bad flag named at once, each by its own flag; other trainers' flag
names mapped; advice that does no harm (no `prepare --force` into a run directory, a shorter --seq-len, the
directory `prepare` was given, a file that is no checkpoint); a usage mistake exits 2 wherever it is made."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, mpi_env

from capstone import cli
from capstone.checkpoint.__main__ import main as checkpoint_main
from capstone.config import ConfigError
from capstone.data.dataset import DatasetError, load_meta
from capstone.prepare import main as prepare_main


def problems(*argv) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        cli.parse([str(a) for a in argv])
    return exc.value.problems


@pytest.mark.parametrize("flag,value", [("--bucket-mb", 0), ("--collective-timeout", -1), ("--log-every", -1),
                                        ("--stop-after", -1), ("--sleep-per-step", -1)])
def test_each_run_option_is_named_alone(flag, value):
    said = problems(flag, value)
    others = {"--bucket-mb", "--collective-timeout", "--log-every", "--stop-after", "--sleep-per-step"} - {flag}
    assert len(said) == 1 and said[0].startswith(f"{flag} must be") and not any(o in said[0] for o in others), said


@pytest.mark.parametrize("how", ["latest", "auto"])
def test_resume_latest_or_auto_without_out_names_the_missing_flag(how):
    """latest used to look for checkpoints in the new runs/run-<time> directory it had just named, and
    say none; auto started afresh there at every launch, never resuming."""
    said = problems("--resume", how)
    assert len(said) == 1 and f"--resume {how} continues" in said[0] and "pass --out RUN_DIR" in said[0], said
    assert cli.parse(["--resume", how, "--out", "runs/x"]).opts.resume == how


def test_an_empty_out_is_refused():
    """`--out "$RUN_DIR"` with RUN_DIR unset trained into a new runs/run-<time> of the checkout without a word."""
    said = problems("--out", "", "--steps", 3)
    assert len(said) == 1 and said[0].startswith("--out is empty") and "leave --out out" in said[0], said
    assert len(problems("--out", "", "--resume", "latest")) == 1   # the empty --out, said once


def test_a_flag_is_one_problem_however_many_checks_it_fails():
    """--lr nan was "2 problems" (not finite; not > 0)."""
    said = problems("--lr", "nan", "--beta1", 2)
    assert len(said) == 2 and said[0] == "--lr must be a finite number, got nan." and "--beta1" in said[1], said


def test_every_bad_flag_is_reported_at_once():
    said = problems("--bucket-mb", 0, "--log-every", -1, "--steps", 0, "--lr", -1, "--d-model", 30,
                    "--zero-stage", 5, "--eval-every", "x", "--max-iters", 3)
    flags = ["--bucket-mb", "--log-every", "--steps", "--lr", "--d-model", "--zero-stage", "--eval-every", "--max-iters"]
    assert len(said) == len(flags), said
    assert all(any(f in p for p in said) for f in flags), said
    with pytest.raises(ConfigError, match=r"^8 problems: \(1\) .* \(8\) .*--help"):
        cli.parse(["--bucket-mb", "0", "--log-every", "-1", "--steps", "0", "--lr", "-1", "--d-model", "30",
                   "--zero-stage", "5", "--eval-every", "x", "--max-iters", "3"])


def test_a_combination_is_still_judged_once_each_flag_is_valid():
    said = problems("--warmup-steps", 50)
    assert len(said) == 1 and said[0].startswith("--warmup-steps 50 is longer than steps 20")
    assert cli.parse(["--warmup-steps", "50", "--steps", "100"]).train.warmup_steps == 50


@pytest.mark.parametrize("given,want", [
    (["--max-iters", "5"], "did you mean --steps?"), (["--max_iters=5"], "did you mean --steps?"),
    (["--learning_rate", "1e-3"], "did you mean --lr?"), (["--eval_interval", "5"], "did you mean --eval-every?"),
    (["--block_size", "64"], "did you mean --seq-len?"), (["--n_embd", "64"], "did you mean --d-model?"),
    (["--gradient_accumulation_steps", "4"], "did you mean --grad-accum?"),
    (["--n_layers", "3"], "spelled with dashes: --n-layers 3"), (["--init_from=resume"], "--resume latest"),
    (["--dtype", "bfloat16"], "float32"), (["--stpes", "5"], "did you mean --steps?"),
    (["config/train_shakespeare_char.py"], "--preset NAME"),
    (["--ntasks=2"], "sbatch --ntasks=2 scripts/slurm/capstone.sbatch"),   # after the batch script's name
    (["--time", "10"], "sbatch --time 10 scripts/slurm/capstone.sbatch"),
])
def test_other_trainers_flag_names_get_a_suggestion(given, want):
    said = problems(*given)
    assert len(said) == 1 and want in said[0] and given[0].split("=")[0] in said[0], said


def test_data_that_is_a_run_directory_is_not_told_to_prepare_into_it(tmp_path):
    run = tmp_path / "runs" / "shk"
    (run / "checkpoints").mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"train_config": {"data": "data/shakespeare"}}))
    with pytest.raises(DatasetError) as exc:
        load_meta(str(run))
    said = str(exc.value)
    assert "--force" not in said and "training run's directory" in said and "--data data/shakespeare" in said
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("x")
    with pytest.raises(DatasetError) as exc:
        load_meta(str(other))
    assert "--force" not in str(exc.value) and "todo.txt" in str(exc.value)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "train.bin").write_bytes(b"\0\0")   # an interrupted prepare: re-creating it is right
    with pytest.raises(DatasetError, match="--force"):
        load_meta(str(tmp_path / "half"))


def test_prepare_of_a_directory_says_it_is_one(tmp_path, capsys):
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("hello\n")
    assert prepare_main([str(tmp_path / "texts"), str(tmp_path / "nope.txt"), "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'texts'} is a directory: pass the text files in it" in err and "*.txt" in err
    assert "nope.txt: no such file" in err and "texts: no such file" not in err and not (tmp_path / "d").exists()


def test_verify_of_a_file_that_is_no_checkpoint_does_not_talk_of_sealing(capsys):
    assert checkpoint_main(["verify", os.path.join(ROOT, "README.md")]) == 1
    err = capsys.readouterr().err
    assert "is not an HDF5 file" in err and "seal" not in err


def test_a_checkpoint_named_wrongly_exits_2_like_every_usage_mistake(tmp_path):
    """--resume of a missing file or of a file that is no checkpoint, like --init-from of one: exit 2 (an
    incompatible --resume is 2 as well: tests/test_resume.py::test_incompatible_config_is_refused)."""
    for flag, target in (("--resume", tmp_path / "nope.h5"), ("--init-from", tmp_path / "nope.h5"),
                         ("--resume", os.path.join(ROOT, "README.md"))):
        res = subprocess.run([sys.executable, "-m", "capstone.train", flag, str(target), "--out", str(tmp_path / "r")],
                             capture_output=True, text=True, env=mpi_env(), cwd=ROOT, timeout=120)
        assert res.returncode == 2 and res.stderr.count("error:") == 1 and "Traceback" not in res.stderr, res.stderr


@pytest.mark.parametrize("command", [["capstone.train"], ["capstone.sample", "runs/x"], ["capstone.checkpoint", "verify", "x"]])
def test_a_python_without_the_venv_gets_one_line_saying_how_to_set_up(command, tmp_path):
    """Item 8: no ModuleNotFoundError traceback. A Python without site-packages (-S: none of the venv's
    libraries), and the venv's Python with only h5py hidden (sitecustomize), as in a shell without the venv."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['h5py'] = None\n")
    env = {**mpi_env(), "PYTHONPATH": ROOT}
    for python, extra in (([sys.executable, "-S"], {}), ([sys.executable], {"PYTHONPATH": f"{tmp_path}:{ROOT}"})):
        res = subprocess.run([*python, "-m", *command], capture_output=True, text=True, env={**env, **extra},
                             cwd=tmp_path, timeout=120)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert res.stderr.count("\n") == 1 and "h5py" in res.stderr and ".venv/bin/activate" in res.stderr, res.stderr


def test_a_batch_job_without_the_venv_says_so_once_and_names_capstone_venv(tmp_path):
    """Under srun every task is its own Python without MPI to agree on who speaks: rank 0 (SLURM_PROCID, PMIX_RANK)
    says it, the others exit 2 silently; in a batch job the advice is CAPSTONE_VENV, not `source activate`."""
    env = {k: v for k, v in mpi_env().items() if k not in ("OMPI_COMM_WORLD_RANK", "PMI_RANK")}
    env.update(PYTHONPATH=ROOT, SLURM_JOB_ID="7")
    said = []
    for rank in ("0", "1"):
        res = subprocess.run([sys.executable, "-S", "-m", "capstone.train"], capture_output=True, text=True,
                             env={**env, "SLURM_PROCID": rank, "PMIX_RANK": rank}, cwd=tmp_path, timeout=120)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        said.append(res.stderr)
    assert said[1] == "" and said[0].count("\n") == 1 and "CAPSTONE_VENV=" in said[0], said


def test_the_readme_names_export_and_bpe():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert "python -m capstone.export" in readme and "--format hf" in readme and "--tokenizer bpe" in readme


def test_a_negative_seed_is_not_told_that_0_disables_it():
    """Issue 53, item 7: `--seed -1` said "(0 disables it where that applies)", a template shared with
    --ckpt-every and --keep-last, false for a seed; those still say what 0 means."""
    from capstone import cli
    from capstone.config import ConfigError
    with pytest.raises(ConfigError) as seed:
        cli.parse(["--seed", "-1"])
    assert "--seed must be an integer >= 0, got -1." in str(seed.value) and "0" not in str(seed.value).split("-1")[1]
    with pytest.raises(ConfigError) as every:
        cli.parse(["--ckpt-every", "-1"])
    assert "--ckpt-every must be an integer >= 0, got -1 (0: off)." in str(every.value)
