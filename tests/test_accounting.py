"""capstone.observe.accounting: nccl-tests byte counts and bandwidths, the ZeRO what-if table (closed form,
the ZeRO paper's own numbers) and a real run's measured memory against it."""

import re
import subprocess
import sys

import pytest

from capstone.observe import accounting as acc
from capstone.observe.accounting import Collective

from conftest import ROOT, mpi_env, mpirun, summary

SIZES = (1, 7536, 1 << 20)  # elements per rank: tiny, the default model's shard on 4 ranks, 4 MiB
WORLDS = (1, 3, 4)


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("per_rank", SIZES)
def test_bytes_follow_the_nccl_tests_definitions(n, per_rank):
    full = per_rank * n
    ar = Collective("allreduce", full, 4, n, 1.0)
    rs = Collective.per_rank("reduce_scatter", per_rank, 4, n, 1.0)
    ag = Collective.per_rank("allgather", per_rank, 4, n, 1.0)
    for c in (ar, rs, ag):
        assert c.size_bytes == 4 * per_rank * n  # S: the whole buffer (recvcount/sendcount * size * n)
    assert ar.ring_bytes_sent_per_rank == pytest.approx(2 * (n - 1) * per_rank * 4)  # 2(n-1) chunks of S/n
    assert rs.ring_bytes_sent_per_rank == pytest.approx((n - 1) * per_rank * 4)       # n-1 chunks of S/n
    assert ag.ring_bytes_sent_per_rank == pytest.approx((n - 1) * per_rank * 4)
    assert rs.count == ag.count == full


@pytest.mark.parametrize("n", WORLDS)
def test_busbw_factors(n):
    t, count = 2e-3, 3 * 4 * 1000  # divisible by every n here
    ar, rs, ag = (Collective(name, count, 4, n, t) for name in ("allreduce", "reduce_scatter", "allgather"))
    algbw = count * 4 / t
    assert ar.algbw == rs.algbw == ag.algbw == pytest.approx(algbw)
    assert ar.busbw == pytest.approx(algbw * 2 * (n - 1) / n)
    assert rs.busbw == pytest.approx(algbw * (n - 1) / n) and ag.busbw == pytest.approx(algbw * (n - 1) / n)
    for c in (ar, rs, ag):
        assert c.busbw * t == pytest.approx(c.ring_bytes_sent_per_rank)
    assert Collective("broadcast", count, 4, n, t).busbw == pytest.approx(algbw)


def test_a_worked_example_and_bad_input():
    c = Collective.per_rank("reduce_scatter", 7536, 4, 4, 1e-3)  # the default model's gradients on 4 ranks
    assert (c.size_bytes, c.algbw, c.busbw) == (120576, pytest.approx(1.20576e8), pytest.approx(9.0432e7))
    assert Collective("allgather", 8, 4, 4, 0.0).algbw != Collective("allgather", 8, 4, 4, 0.0).algbw  # NaN: no time
    with pytest.raises(ValueError, match="equal blocks"):
        Collective("reduce_scatter", 10, 4, 4, 1.0)
    with pytest.raises(ValueError, match="unknown collective"):
        Collective("alltoallw", 8, 4, 4, 1.0)


def test_step_collectives_from_a_metrics_row():
    """A row's "comm" entries (op, S bytes, ranks, ms) become Collectives; a collective that took no
    time (or is absent: a batch the guard skipped has no allgather) is left out."""
    row = {"comm": {"reduce_scatter": {"op": "reduce_scatter", "bytes": 120576, "ranks": 4, "ms": 2.0},
                    "allgather": {"op": "allgather", "bytes": 120576, "ranks": 4, "ms": 0.0}}}
    assert acc.step_collectives(row) == [Collective("reduce_scatter", 120576, 1, 4, 2e-3)]
    row["comm"]["allgather"]["ms"] = 1.0
    both = acc.step_collectives(row)
    assert [(c.name, c.size_bytes, c.seconds) for c in both] == [("reduce_scatter", 120576, 2e-3), ("allgather", 120576, 1e-3)]
    assert "reduce_scatter" in acc.format_collectives(both)


def test_step_comm_entries_follow_the_traffic():
    from capstone.collective.comm import Traffic
    comm = acc.step_comm({"tp_allreduce": Traffic("allreduce", 2, bytes=4096, seconds=2e-3, calls=8)})
    e = comm["tp_allreduce"]
    assert (e["op"], e["bytes"], e["ranks"], e["calls"]) == ("allreduce", 4096, 2, 8) and e["ms"] == 2.0
    assert e["algbw_GBps"] == 4096 / 2e-3 / 1e9 and e["busbw_GBps"] == e["algbw_GBps"] * 2 * (2 - 1) / 2


def test_zero_table_fp32_closed_form():
    P, N = 30144, 4  # the default model (V=64, T=16, C=32, L=2); 30144 = 4 * 7536
    rows = acc.zero_table(P, N)
    got = [(r.stage, r.params_bytes, r.grads_bytes, r.optimizer_bytes, r.total_bytes) for r in rows]
    assert got == [(0, 4 * P, 4 * P, 12 * P, 20 * P),
                   (1, 4 * P, 4 * P, 12 * P // N, 8 * P + 12 * P // N),
                   (2, 4 * P, 4 * P // N, 12 * P // N, 4 * P + 16 * P // N),
                   (3, 4 * P // N, 4 * P // N, 12 * P // N, 20 * P // N)]
    assert acc.zero_row(1, 30145, 4).optimizer_bytes == 12 * 7537  # a rank holds the padded shard
    text = acc.format_zero_table(rows, P, N)
    assert "602880" in text and "150720" in text and "fp32 (4+4+12" in text


def test_zero_table_mixed_precision_matches_the_paper():
    """ZeRO paper, Figure 1: 7.5B parameters, N=64, K=12: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device."""
    totals = [r.total_bytes / 1e9 for r in acc.zero_table(7_500_000_000, 64, acc.MIXED)]
    assert totals == pytest.approx([120.0, 31.4, 16.6, 1.9], abs=0.05)


def test_cli_what_if(capsys):
    assert acc.main(["--params", "30144", "--world", "4", "--precision", "mixed"]) == 0
    out = capsys.readouterr().out
    assert "mixed (2+2+12" in out and f"{16 * 30144:>12}" in out and f"{16 * 30144 // 4:>12}" in out


@pytest.mark.parametrize("argv, flag", [(["--world", "0"], "--world 0"), (["--params", "-5", "--world", "3"], "--params -5")])
def test_cli_bad_params_or_world_is_a_usage_error(argv, flag):
    """A negative --params or a --world below 1: exit 2, one line naming the flag, no traceback."""
    res = subprocess.run([sys.executable, "-m", "capstone.observe.accounting", *argv], capture_output=True, text=True,
                         env=mpi_env(), cwd=ROOT, timeout=60)
    assert res.returncode == 2 and res.stdout == "", res.stderr
    assert res.stderr.startswith(f"error: {flag}:") and res.stderr.count("\n") == 1, res.stderr


def test_a_real_run_measures_what_stage_1_predicts(tmp_path, capsys):
    out = tmp_path / "n2"
    assert mpirun(2, "--out", out, "--steps", 4, "--ckpt-every", 0, "--quiet").returncode == 0
    s = summary(out)
    padded, world = s["padded"], s["world_size"]
    stage1 = acc.zero_row(1, padded, world)
    for m in s["memory"]["per_rank"]:
        assert m["params_bytes"] == stage1.params_bytes and m["optimizer_bytes"] == stage1.optimizer_bytes
        assert m["grads_bytes"] == stage1.grads_bytes and m["reduce_bytes"] == 4 * padded // world  # the receive shard
        assert {k: m["formula"][k] for k in m["formula"]} == {k: m[k] for k in m["formula"]}
    assert acc.main(["--run", str(out)]) == 0
    text = capsys.readouterr().out
    assert "reduce_scatter" in text and "allgather" in text and f"P={padded} parameters on N=2" in text
    assert re.search(r"^allreduce_stats\s+allreduce\s", text, re.M), text   # rows named by kind, then op
