"""Every serial tool piped into a reader that leaves early (`tool ... | head -0`): no BrokenPipeError
traceback, exit 141 (128 + SIGPIPE, as a shell reports for `yes | head`), the work done (capstone.flags.pipe)."""

import os
import subprocess
import sys

import pytest

from capstone.data.tokens import load_meta
from conftest import ROOT, mpi_env, mpirun


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipes") / "run"
    res = mpirun(2, "--out", out, "--steps", 3, "--quiet")
    assert res.returncode == 0, res.stdout + res.stderr
    return str(out)


def closed_stdout(*argv) -> subprocess.CompletedProcess:
    """`python -m ARGV` whose stdout is a pipe nobody reads any more: every write to it fails with EPIPE."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-m", *map(str, argv)], stdout=write, stderr=subprocess.PIPE,
                              text=True, env=mpi_env(), cwd=ROOT, timeout=120)
    finally:
        os.close(write)


@pytest.mark.parametrize("tool", [["capstone.checkpoint", "inspect", "RUN"], ["capstone.checkpoint", "verify", "RUN"],
                                  ["capstone.observe.accounting", "--run", "RUN"], ["capstone.observe.accounting"],
                                  ["capstone.sample", "RUN", "--tokens", "5"]])
def test_a_reader_that_leaves_early_ends_a_tool_quietly(run, tool):
    res = closed_stdout(*[run if a == "RUN" else a for a in tool])
    assert res.returncode == 141 and "Traceback" not in res.stderr and "BrokenPipe" not in res.stderr, res.stderr


def test_export_and_prepare_keep_their_work_when_the_reader_leaves(run, tmp_path):
    model = tmp_path / "m.safetensors"
    res = closed_stdout("capstone.export", run, "--out", model)
    assert res.returncode == 141 and res.stderr == "" and model.stat().st_size > 0, res.stderr
    text = tmp_path / "story.txt"
    text.write_text("a small story about a cat and a dog\n" * 30)
    res = closed_stdout("capstone.prepare", text, "--out", tmp_path / "ds")
    assert res.returncode == 141 and res.stderr == "" and load_meta(str(tmp_path / "ds")).vocab_size > 0, res.stderr
