"""`python -m capstone.plot RUN_DIR [RUN_DIR ...] --out DIR`: PNG figures of one or more runs.

Reading metrics.jsonl (parse, dedupe by step, series) is plain Python that tests check exactly;
matplotlib (Agg backend) is imported only when figures are made, so training never needs it.
Works on finished, running (partial last line, no summary.json) and resumed runs (latest row wins).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from dataclasses import dataclass

INSTALL = "pip install matplotlib   (or: pip install -e '.[plot]')"
MIB, KIB = 1024 * 1024, 1024
# Step-time components in stacking order; any other *_ms field (or "comm" entry) follows them.
PHASES = ("fwd_bwd", "reduce_scatter", "allgather", "optimizer", "eval", "checks", "ckpt")
NAMES = {"fwd_bwd": "compute (fwd+bwd)", "ckpt": "checkpoint"}
NOT_PHASES = {"step", "comm"}  # step_ms is the total; comm_ms is the sum of the collectives
MEMORY = ("params_bytes", "grads_bytes", "optimizer_bytes", "guard_bytes")
COLORS = tuple(f"C{i}" for i in range(10))  # one colour per run: the default cycle


class MissingMatplotlib(RuntimeError):
    """matplotlib is not installed (it is only needed to draw)."""


# ---- reading (no matplotlib) -------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    """One run directory as read: step rows (one per step, latest wins), start rows, summary."""

    path: str
    label: str
    rows: tuple[dict, ...]
    starts: tuple[dict, ...]
    summary: dict | None
    skipped_lines: int  # unparsable lines: a running run's partial last line, or one cut by a crash


def parse_lines(text: str) -> tuple[list[dict], int]:
    """The JSON objects of a metrics.jsonl text and the number of lines that were not one."""
    records, bad = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(obj, dict):
            records.append(obj)
        else:
            bad += 1
    return records, bad


def step_rows(records: list[dict]) -> list[dict]:
    """One row per step in step order; a step written again (after a resume) keeps the latest row.
    Adds "tokens_total" (cumulative tokens) where the row lacks it, summing "tokens"."""
    latest = {}
    for r in records:
        if "event" not in r and isinstance(r.get("step"), int):
            latest[r["step"]] = r
    rows, total = [], 0
    for s in sorted(latest):
        row = dict(latest[s])
        total = row["tokens_total"] if number(row.get("tokens_total")) is not None else total + (number(row.get("tokens")) or 0)
        row["tokens_total"] = total
        rows.append(row)
    return rows


def number(value) -> float | None:
    """A finite float from a metrics value, else None (null, missing, "nan"/"inf" strings, booleans)."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def series(rows: list[dict], key: str, x: str = "step", accepted_only: bool = False) -> tuple[list, list]:
    """(xs, ys) of the rows where both `x` and `key` are finite numbers."""
    xs, ys = [], []
    for r in rows:
        if accepted_only and r.get("accepted") is False:
            continue
        xv, yv = number(r.get(x)), number(r.get(key))
        if xv is not None and yv is not None:
            xs.append(xv)
            ys.append(yv)
    return xs, ys


def event_steps(rows: list[dict], name: str) -> list[int]:
    """Steps whose row lists an event called `name` (e.g. "rollback", "checkpoint")."""
    return [r["step"] for r in rows if any(isinstance(e, dict) and e.get("event") == name for e in r.get("events") or ())]


def resume_steps(starts: list[dict]) -> list[int]:
    """The step each resume started after (start rows that name a checkpoint)."""
    return [int(s.get("start_step", 0)) for s in starts if s.get("resumed_from")]


def timing_parts(row: dict) -> dict[str, float]:
    """Milliseconds of each phase of a step row: every "<phase>_ms" field except step_ms and comm_ms,
    with the entries of a per-collective "comm" dict (ms numbers or {"ms": ...}) replacing same-named fields."""
    parts = {k[:-3]: number(v) for k, v in row.items() if k.endswith("_ms") and k[:-3] not in NOT_PHASES}
    comm = row.get("comm")
    if isinstance(comm, dict):
        for name, v in comm.items():
            parts[name] = number(v.get("ms") if isinstance(v, dict) else v)
    return {k: v for k, v in parts.items() if v is not None}


def phase_order(rows: list[dict]) -> list[str]:
    """The phases present in any row: known ones in PHASES order, then the rest alphabetically."""
    present = set().union(*(timing_parts(r) for r in rows))
    return [p for p in PHASES if p in present] + sorted(present - set(PHASES))


def clip_level(run: Run) -> float | None:
    """train_config.clip from summary.json or the latest start row that carries it; None if off/unknown."""
    configs = [s.get("train_config") for s in run.starts] + [(run.summary or {}).get("train_config")]
    for cfg in reversed(configs):
        clip = number(cfg.get("clip")) if isinstance(cfg, dict) else None
        if clip is not None:
            return clip if clip > 0 else None
    return None


def memory_rows(run: Run) -> list[dict]:
    """summary.json's memory per rank (empty while the run has not finished)."""
    rows = ((run.summary or {}).get("memory") or {}).get("per_rank") or []
    return sorted((r for r in rows if isinstance(r, dict)), key=lambda r: r.get("rank", 0))


def read_run(path: str, label: str | None = None) -> Run:
    """Read OUT/metrics.jsonl and, if present, OUT/summary.json."""
    metrics = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(metrics):
        raise FileNotFoundError(f"{metrics} not found: pass the --out directory of a capstone.train run")
    with open(metrics) as f:
        records, bad = parse_lines(f.read())
    summary = None
    try:
        with open(os.path.join(path, "summary.json")) as f:
            summary = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        pass
    starts = tuple(r for r in records if r.get("event") == "start")
    label = label or os.path.basename(os.path.normpath(path))
    return Run(path, label, tuple(step_rows(records)), starts, summary, bad)


def run_labels(paths: list[str]) -> list[str]:
    """Run dir names; the path as given where two runs share a name."""
    names = [os.path.basename(os.path.normpath(p)) for p in paths]
    return [n if names.count(n) == 1 else os.path.normpath(p) for n, p in zip(names, paths)]


def x_of_step(rows: list[dict], step: int, x: str) -> float | None:
    """Where `step` sits on the x axis `x` ("step" or "tokens_total"): the last row at or before it."""
    if x == "step":
        return float(step)
    before = [number(r.get(x)) for r in rows if r["step"] <= step]
    return before[-1] if before else 0.0


# ---- figures (matplotlib, Agg) -----------------------------------------------------------------
def _figure(rows: int = 1, cols: int = 1, size=(9, 4.8), **kw):
    try:
        import matplotlib
    except ImportError:
        raise MissingMatplotlib(f"matplotlib is needed to plot: {INSTALL}") from None
    matplotlib.use("Agg")  # before pyplot could be imported anywhere; no display needed
    from matplotlib.figure import Figure
    fig = Figure(figsize=size, dpi=110, layout="constrained")
    return fig, fig.subplots(rows, cols, squeeze=False, **kw)


def _finish(ax, xlabel: str, ylabel: str, title: str, legend: bool = True) -> None:
    """Labels, grid, whole-number step ticks and the legend (outside on the right if it is long)."""
    from matplotlib.ticker import MaxNLocator
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3, which="both")
    if legend:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _marks(ax, run: Run, color: str, x: str = "step") -> None:
    """Vertical lines: dashed at each resume, dotted at each rollback (labelled once per run)."""
    for kind, steps, style in (("resume", resume_steps(run.starts), "--"), ("rollback", event_steps(run.rows, "rollback"), ":")):
        for i, s in enumerate(steps):
            ax.axvline(x_of_step(run.rows, s, x), color=color, ls=style, lw=1.2, alpha=0.8,
                       label=f"{run.label} {kind}" if i == 0 else "_nolegend_")


def fig_loss(runs: list[Run], x: str = "step"):
    """Train loss (accepted steps) and held-out loss against `x` ("step" or "tokens_total")."""
    fig, axes = _figure()
    ax = axes[0][0]
    for c, run in zip(itertools.cycle(COLORS), runs):
        ax.plot(*series(run.rows, "loss", x, accepted_only=True), color=c, lw=1.5, label=f"{run.label} train")
        ax.plot(*series(run.rows, "eval_loss", x, accepted_only=True), color=c, ls="--", marker="o", ms=3, label=f"{run.label} held-out")
        _marks(ax, run, c, x)
    name = "tokens" if x == "tokens_total" else "step"
    _finish(ax, name, "loss (nats/token)", f"loss against {name}: train (accepted steps) and held-out")
    return fig


def fig_grad_norm(runs: list[Run]):
    """Global gradient norm before clipping (log scale) and the clip level where clipping is on."""
    fig, axes = _figure()
    ax = axes[0][0]
    for c, run in zip(itertools.cycle(COLORS), runs):
        ax.plot(*series(run.rows, "grad_norm"), color=c, lw=1.5, label=f"{run.label} grad norm")
        clip = clip_level(run)
        if clip is not None:
            ax.axhline(clip, color=c, ls="-.", lw=1, label=f"{run.label} clip {clip:g}")
        _marks(ax, run, c)
    ax.set_yscale("log")
    _finish(ax, "step", "L2 norm (log scale)", "global gradient norm before clipping")
    return fig


def fig_lr(runs: list[Run]):
    """Learning rate of each step (log scale when it spans more than 50x, e.g. an injected spike)."""
    fig, axes = _figure(size=(9, 3.6))
    ax, values = axes[0][0], []
    for c, run in zip(itertools.cycle(COLORS), runs):
        xs, ys = series(run.rows, "lr")
        ax.plot(xs, ys, color=c, lw=1.5, marker=".", label=run.label)
        values += ys
        _marks(ax, run, c)
    if values and min(values) > 0 and max(values) > 50 * min(values):
        ax.set_yscale("log")
    _finish(ax, "step", "learning rate", "learning rate")
    return fig


def fig_step_time(runs: list[Run]):
    """Per run: the phases of each step stacked (rank 0's clock), then what step_ms has beyond
    them (small allreduce, held-out loss, guard), and the measured step_ms as a line."""
    fig, axes = _figure(len(runs), 1, size=(9, 2.2 + 2.4 * len(runs)), sharex=True)
    for ax, run in zip((a[0] for a in axes), runs):
        phases, steps = phase_order(run.rows), [r["step"] for r in run.rows]
        stacks = [[timing_parts(r).get(ph, 0.0) for r in run.rows] for ph in phases]
        rest = [max(0.0, (number(r.get("step_ms")) or 0.0) - sum(col)) for r, col in zip(run.rows, zip(*stacks))]
        if phases:
            ax.stackplot(steps, *stacks, rest, alpha=0.85, colors=[f"C{i}" for i in range(len(phases))] + ["0.85"],
                         labels=[NAMES.get(ph, ph.replace("_", " ")) for ph in phases] + ["rest of step_ms"])
        ax.plot(*series(run.rows, "step_ms"), color="k", lw=1, label="step_ms (measured total)")
        _marks(ax, run, "0.3")
        _finish(ax, "step", "ms", f"step time split (rank 0): {run.label}")
    return fig


def fig_memory(runs: list[Run]):
    """Per run with a summary.json: state bytes per rank stacked (KiB) and peak RSS (MiB); None if none."""
    have = [r for r in runs if memory_rows(r)]
    if not have:
        return None
    fig, axes = _figure(2, len(have), size=(4.5 + 2.6 * len(have), 6.4), sharey="row")
    for col, run in enumerate(have):
        mem = memory_rows(run)
        ranks, bottom, top = [str(m.get("rank", i)) for i, m in enumerate(mem)], [0.0] * len(mem), axes[0][col]
        for key in MEMORY:
            vals = [(number(m.get(key)) or 0.0) / KIB for m in mem]
            top.bar(ranks, vals, bottom=bottom, width=0.6, label=key[:-6])
            bottom = [b + v for b, v in zip(bottom, vals)]
        _finish(top, "rank", "KiB", f"{run.label}: state per rank", legend=col == len(have) - 1)
        low = axes[1][col]
        low.bar(ranks, [(number(m.get("peak_rss_bytes")) or 0.0) / MIB for m in mem], width=0.6, color="0.5")
        _finish(low, "rank", "MiB", f"{run.label}: peak RSS", legend=False)
        for ax in (top, low):
            ax.set_xlim(-0.75, len(mem) - 0.25)
    return fig


FIGURES = {"loss_step": lambda runs: fig_loss(runs, "step"), "loss_tokens": lambda runs: fig_loss(runs, "tokens_total"),
           "grad_norm": fig_grad_norm, "lr": fig_lr, "step_time": fig_step_time, "memory": fig_memory}


def make_figures(runs: list[Run]) -> dict:
    """name -> matplotlib Figure (not yet saved); figures with nothing to show are left out."""
    figs = {name: make(runs) for name, make in FIGURES.items()}
    return {name: f for name, f in figs.items() if f is not None}


def save_figures(figs: dict, out: str) -> list[str]:
    """Write each figure as OUT/<name>.png; returns the paths."""
    os.makedirs(out, exist_ok=True)
    paths = []
    for name, fig in figs.items():
        paths.append(os.path.join(out, f"{name}.png"))
        fig.savefig(paths[-1])
    return paths


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m capstone.plot", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description="Plot loss, gradient norm, learning rate, step-time split and memory of "
                                            "one or more capstone.train runs (several runs share each figure).")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="--out directory of a run (finished, running or resumed)")
    p.add_argument("--out", default=None, help="directory for the PNGs (default: RUN_DIR/plots of the first run)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        runs = [read_run(p, label) for p, label in zip(args.runs, run_labels(args.runs))]
        if not any(run.rows for run in runs):
            raise FileNotFoundError(f"no step rows in {', '.join(args.runs)} yet: nothing to plot")
        figs = make_figures(runs)
    except (FileNotFoundError, MissingMatplotlib) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for run in runs:
        state = f"status {run.summary.get('status')}" if run.summary else "running or stopped (no summary.json yet)"
        skipped = f", {run.skipped_lines} unparsable line(s) skipped" if run.skipped_lines else ""
        print(f"{run.path}: {len(run.rows)} steps, {state}{skipped}")
    for path in save_figures(figs, args.out or os.path.join(args.runs[0], "plots")):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
