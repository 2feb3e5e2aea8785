"""`python -m capstone.plot RUN_DIR [RUN_DIR ...] --out DIR`: PNG figures of one or more runs.

The curves come from capstone.observe.runlog (plain reading, tested exactly); matplotlib (Agg backend) is
imported only here, when figures are made, so training never needs it. Works on finished, running
(partial last line, no summary.json) and resumed runs (a repeated step: the latest row wins).
"""

import argparse
import itertools
import os
import sys

from capstone.observe.runlog import (Run, clip_level, event_steps, memory_rows, number, phase_order, read_run, resume_steps,
                     run_labels, series, timing_parts, x_of_step)
from capstone.flags.pipe import fail, run_tool
from capstone.observe.memory import FIELDS

INSTALL = "pip install matplotlib   (or: pip install -e '.[plot]')"
MIB, KIB = 1024 * 1024, 1024
NAMES = {"fwd_bwd": "compute (fwd+bwd)", "ckpt": "checkpoint"}  # legend names of step-time phases
# the model states as held (capstone.observe.memory); runs from before ZeRO-2/3 have no gathered/reduce
MEMORY = tuple(f + "_bytes" for f in FIELDS)
COLORS = tuple(f"C{i}" for i in range(10))  # one colour per run: the default cycle


class MissingMatplotlib(RuntimeError):
    """matplotlib is not installed (it is only needed to draw)."""


# ---- figures (matplotlib, Agg) -----------------------------------------------------------------
def _figure(rows: int = 1, cols: int = 1, size=(9, 4.8), **kw):
    try:
        import matplotlib
    except ImportError:
        raise MissingMatplotlib(f"matplotlib is needed to plot: {INSTALL}") from None
    if "matplotlib.pyplot" not in sys.modules:  # no display needed; leave a caller's pyplot backend alone
        matplotlib.use("Agg")
    from matplotlib.figure import Figure
    fig = Figure(figsize=size, dpi=110, layout="constrained")
    return fig, fig.subplots(rows, cols, squeeze=False, **kw)


def _finish(ax, xlabel: str, ylabel: str, title: str, legend: bool = True) -> None:
    """Labels, grid, whole-number step ticks and the legend (outside, on the right)."""
    from matplotlib.ticker import MaxNLocator
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    if xlabel == "step":
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
    fig, [[ax]] = _figure()
    for c, run in zip(itertools.cycle(COLORS), runs):
        ax.plot(*series(run.rows, "loss", x, accepted_only=True), color=c, lw=1.5, label=f"{run.label} train")
        ax.plot(*series(run.rows, "eval_loss", x, accepted_only=True), color=c, ls="--", marker="o", ms=3, label=f"{run.label} held-out")
        _marks(ax, run, c, x)
    name = "tokens" if x == "tokens_total" else "step"
    _finish(ax, name, "loss (nats/token)", f"loss against {name}: train (accepted steps) and held-out")
    return fig


def _per_step(runs: list[Run], key: str, span: float, ylabel: str, title: str, label: str = "", size=(9, 4.8), **style):
    """`key` of each step of each run, log scale when it spans more than `span` times; for grad_norm also
    the clip level where clipping is on."""
    fig, axes = _figure(size=size)
    ax, values = axes[0][0], []
    for c, run in zip(itertools.cycle(COLORS), runs):
        xs, ys = series(run.rows, key)
        ax.plot(xs, ys, color=c, lw=1.5, label=run.label + label, **style)
        values += ys
        clip = clip_level(run) if key == "grad_norm" else None
        if clip is not None:
            ax.axhline(clip, color=c, ls="-.", lw=1, label=f"{run.label} clip {clip:g}")
        _marks(ax, run, c)
    if values and min(values) > 0 and max(values) > span * min(values):   # a spike: log y scale, else linear
        ax.set_yscale("log")
    _finish(ax, "step", ylabel, title)
    return fig


def fig_grad_norm(runs: list[Run]):
    """Global gradient norm before clipping and the clip level where clipping is on (log scale
    when the norms span more than 10x)."""
    return _per_step(runs, "grad_norm", 10, "L2 norm", "global gradient norm before clipping", " grad norm")


def fig_lr(runs: list[Run]):
    """Learning rate of each step (log scale when it spans more than 50x, e.g. an injected spike)."""
    return _per_step(runs, "lr", 50, "learning rate", "learning rate", size=(9, 3.6), marker=".")


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
        ranks, bottom, top = list(range(len(mem))), [0.0] * len(mem), axes[0][col]
        for key in (k for k in MEMORY if any(k in m for m in mem)):   # (a summary of before a field: none of it)
            vals = [(number(m.get(key)) or 0.0) / KIB for m in mem]
            top.bar(ranks, vals, bottom=bottom, width=0.6, label=key[:-6])
            bottom = [b + v for b, v in zip(bottom, vals)]
        _finish(top, "rank", "KiB", f"{run.label}: state per rank", legend=col == len(have) - 1)
        low = axes[1][col]
        low.bar(ranks, [(number(m.get("peak_rss_bytes")) or 0.0) / MIB for m in mem], width=0.6, color="0.5")
        _finish(low, "rank", "MiB", f"{run.label}: peak RSS", legend=False)
        for ax in (top, low):
            ax.set_xticks(ranks, [str(m.get("rank", i)) for i, m in enumerate(mem)])
            ax.set_xlim(-0.75, len(mem) - 0.25)
    return fig


FIGURES = {"loss_step": lambda runs: fig_loss(runs, "step"), "loss_tokens": lambda runs: fig_loss(runs, "tokens_total"),
           "grad_norm": fig_grad_norm, "lr": fig_lr, "step_time": fig_step_time, "memory": fig_memory}


def make_figures(runs: list[Run]) -> dict:
    """name -> matplotlib Figure (not yet saved); figures with nothing to show are left out."""
    return {name: fig for name, make in FIGURES.items() if (fig := make(runs)) is not None}


def save_figures(figs: dict, out: str) -> list[str]:
    """Write each figure as OUT/<name>.png; returns the paths."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, f"{name}.png") for name in figs]
    for path, fig in zip(paths, figs.values()):
        fig.savefig(path)
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
        out = args.out or os.path.join(args.runs[0], "plots")
        if os.path.exists(out) and not os.path.isdir(out):   # a clean error before anything is drawn
            raise FileNotFoundError(f"--out {out} exists and is not a directory; pass a directory for the PNGs "
                                    f"(it is created if missing), e.g. --out {out}-plots.")
        runs = [read_run(p, label) for p, label in zip(args.runs, run_labels(args.runs))]
        if not any(run.rows for run in runs):
            raise FileNotFoundError(f"no step rows in {', '.join(args.runs)} yet: nothing to plot")
        paths = save_figures(make_figures(runs), out)
    except (FileNotFoundError, MissingMatplotlib) as exc:
        return fail(exc)
    except OSError as exc:
        return fail(f"cannot write the figures to {args.out or 'RUN_DIR/plots'} ({exc}); pass a writable directory as "
                    f"--out.")
    lines = []                        # printed after the work: a reader that leaves early loses only lines
    for run in runs:
        state = f"status {run.summary.get('status')}" if run.summary else "running or stopped (no summary.json yet)"
        skipped = f", {run.skipped_lines} unparsable line(s) skipped" if run.skipped_lines else ""
        lines.append(f"{run.path}: {len(run.rows)} steps, {state}{skipped}")
    lines += [f"wrote {path}" for path in paths]
    print("\n".join(lines))          # a reader gone early (`plot RUN | head -1`): capstone.flags.pipe
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
