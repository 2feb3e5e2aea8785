"""The composition matrix (docs/composition.md; the rows: tests/composition.py): every pair of
modes in some row, each row against the 1-rank run of the same global batch and injections.

A row the product refuses must be refused at start (exit 2, its reason, nothing written). Every
other row must complete with its invariants and match the 1-rank run at every step: loss,
grad_norm, eval_loss and param_norm (whole-model values) within 1e-5 relative, the same steps
accepted and the same samples. A deterministic row is also bit-identical to the same mode on
another data-parallel layout with the same per-rank micro-batch. A failing row prints the
commands that reproduce it. CI runs the seeded all-pairs rows; `scripts/composition-matrix`
runs every row (CAPSTONE_MATRIX=full).
"""

import os
import shlex
import subprocess
import sys

import pytest

import composition as mx
from conftest import ROOT, made_once, mpi_env, step_rows

ROWS = mx.full() if os.environ.get("CAPSTONE_MATRIX") == "full" else mx.pairs(int(os.environ.get("CAPSTONE_MATRIX_SEED", 25)))
KEYS = ("loss", "grad_norm", "eval_loss", "param_norm")
RTOL = 1e-5


def command(ranks: int, out, flags) -> list[str]:
    return ["mpirun", "-n", str(ranks), "--oversubscribe", sys.executable, "-m", "capstone.train", "--out", str(out),
            *map(str, flags)]


def shown(cmds) -> str:
    return "reproduce with (from the repository, scripts/env.sh sourced):\n" + "\n".join(
        "  " + " ".join(shlex.quote(c) for c in cmd).replace(sys.executable, "python") for cmd in cmds)


def launch(cmds) -> list[subprocess.CompletedProcess]:
    done = []
    for cmd in cmds:
        done.append(subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=mpi_env(), cwd=ROOT))
        if done[-1].returncode != 0:
            break
    return done


def commands(row: mx.Row, out) -> list[list[str]]:
    """The launches of a row: one, or a stop at STOP_AT and a resume on the row's other grid."""
    if not row.resume:
        return [command(row.world, out, row.flags())]
    again = row.resumed()
    return [command(row.world, out, [*row.flags(), "--stop-after", mx.STOP_AT]),
            command(again.world, out, [*again.flags(), "--resume", "latest"])]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The 1-rank run of the global batch in one micro-batch, per injection (made when first needed,
    once for all pytest-xdist workers: conftest.made_once)."""
    made = {}

    def get(inject: str):
        if inject not in made:
            def make(base):
                out = base / inject
                row = mx.Row(1, 1, 1, False, False, inject, False)
                res = launch(commands(row, out))[-1]
                return {"returncode": res.returncode, "output": res.stdout + res.stderr,
                        "rows": step_rows(out) if res.returncode == 0 else None}
            ref = made_once(tmp_path_factory, f"composition-reference-{inject}", make)
            assert ref["returncode"] == 0, ref["output"]
            made[inject] = ref["rows"]
        return made[inject]
    return get


def same_run(got: list, want: list, where: str) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, mx.STEPS + 1)), where
    for g, w in zip(got, want):
        assert (g["accepted"], g["samples"]) == (w["accepted"], w["samples"]), f"step {g['step']}\n{where}"
        for key in KEYS:
            a, b = g[key], w[key]
            if isinstance(a, float) and isinstance(b, float):
                assert abs(a - b) <= RTOL * abs(b), f"step {g['step']} {key}: {a!r} vs the 1-rank {b!r}\n{where}"
            else:
                assert a == b, f"step {g['step']} {key}: {a!r} vs the 1-rank {b!r}\n{where}"


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_row(row, references, tmp_path):
    out = tmp_path / "run"
    cmds = commands(row, out)
    results = launch(cmds)
    text = "".join(r.stdout + r.stderr for r in results)
    where = f"{row.name}\n{shown(cmds)}"
    reason = mx.refusal(row)
    if reason is not None:
        assert results[0].returncode == 2 and reason in results[0].stderr, f"{where}\n{text[-3000:]}"
        assert results[0].stderr.count("error:") == 1 and not out.exists(), f"{where}\n{text[-3000:]}"
        return
    assert results[-1].returncode == 0 and len(results) == len(cmds), f"{where}\n{text[-3000:]}"
    got = step_rows(out)
    same_run(got, references(row.inject), where)
    if row.det:   # bit-identical to another data-parallel layout of the same tp, pp and per-rank micro-batch
        partner = mx.det_partner(row)
        if partner is not None:
            pcmds = commands(partner, tmp_path / "partner")
            res = launch(pcmds)[-1]
            assert res.returncode == 0, res.stdout + res.stderr
            # a resume onto other parts (tp or pp dropped) or another micro-batch is the same to 1e-5 only
            again = row.resumed() if row.resume else row
            upto = mx.STEPS if (again.tp, again.pp, again.blocks) == (row.tp, row.pp, row.blocks) else mx.STOP_AT
            keys = (*KEYS, "fingerprint", "accepted")
            table = [{k: r[k] for k in keys} for r in step_rows(tmp_path / "partner")]
            assert table[:upto] == [{k: r[k] for k in keys} for r in got][:upto], \
                f"not bit-identical to {partner.name}\n{where}\n{shown(pcmds)}"
