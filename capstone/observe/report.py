"""What a run shows and leaves behind: the console lines and tables, metrics.jsonl and summary.json."""

import dataclasses
import json
import math
import os
import sys
import time

from capstone.observe import accounting, outcome
from capstone.observe.jsonout import jsonable, write_json  # noqa: F401  (report.jsonable, report.write_json)
from capstone.observe.memory import FIELDS
from capstone.observe.runlog import logged_rows, number

MIB = 1024 * 1024
EMA_BETA = 0.9     # the console's smoothed loss on long runs
AUTO_ROWS = 50     # about this many console lines for a run of more than AUTO_TABLE_STEPS steps
AUTO_TABLE_STEPS = 100


def say(text: str = "", rank: int = 0) -> None:
    if rank == 0:
        print(text, flush=True)


def dash(value, spec: str) -> str:
    """`value` formatted by `spec`, or "-" for None."""
    return "-" if value is None else format(value, spec)


def step_header() -> str:
    return f"{'step':>5} {'loss':>9} {'eval_loss':>9} {'grad_norm':>10} {'lr':>9} {'ms':>7}  {'param_norm':>11} {'fingerprint':<16}  event"


def banner(run, header: str) -> None:
    """The run's first lines: ranks (and the grid), whole-model parameters, global batch, run dir, then
    the console's `header` (none with --quiet)."""
    if run.opts.quiet:
        return
    layout, (dp, pp, tp), cp = run.model.layout, run.grid.shape, run.grid.cp_size
    grid = f" (dp {dp // cp} x pp {pp}{f' x cp {cp}' if cp > 1 else ''} x tp {tp})" if pp * tp * cp > 1 else ""
    # several hosts: which holds which grid position (capstone.parallel.placement)
    placement = f"\nplacement: {run.grid.placement()}" if run.grid.placement() else ""
    say(f"capstone: {run.grid.world.size} ranks{grid}, {run.n_params} parameters (padded {layout.padded}, shard "
        f"{layout.shard}{' per model-parallel rank' if grid else ''}), global batch {run.global_batch} x "
        f"{run.mcfg.seq_len} tokens, run dir {run.out}{placement}\n{header}", run.grid.world.rank)


def metrics_row(r, tokens: int, tokens_total: int, repeat: bool = False) -> dict:
    """The metrics.jsonl row of a StepResult (`tokens` per step, `tokens_total` seen by the run so far
    including this step, `repeat`: the step was logged before a resume). Phases as "<phase>_ms"
    (disjoint wall-clock parts of step_ms); "comm": each kind of collective of the step, its bytes
    and the time spent waiting for it (inside the phases)."""
    return {"step": r.step, "loss": r.loss, "eval_loss": r.eval_loss, "accepted": r.rollback is None, "lr": r.lr,
            "grad_norm": r.grad_norm, "grad_norm_clipped": r.grad_norm if r.grad_norm_clipped is None else r.grad_norm_clipped,
            "tokens": tokens, "tokens_total": tokens_total, "time": time.time(), "repeat": repeat, "events": r.events,
            "samples": list(r.samples), **{f"{k}_ms": v for k, v in r.ms.items()}, "param_norm": r.param_norm,
            "tokens_per_s": tokens / max(r.ms["step"] / 1e3, 1e-9), "comm": accounting.step_comm(r.traffic),
            "fingerprint": r.fingerprint}


class StepLog:
    """Where each step goes: metrics.jsonl, the console (rank 0, unless --quiet) and, with
    --tensorboard, TensorBoard scalars. Prints the banner when made."""

    def __init__(self, run, start_step: int):
        self.run, self.rank = run, run.grid.world.rank
        self.console = Console(log_every(run.opts.log_every, run.tcfg.steps), run.tcfg.steps, start_step)
        self.board = None
        if run.opts.tensorboard and self.rank == 0:
            from capstone.observe.tensorboard import Board
            self.board = Board(run.opts.tensorboard)
        banner(run, self.console.header())

    def step(self, r) -> dict:
        """Log step result `r`; returns its metrics row."""
        run = self.run
        if r.updated and r.lr != (scheduled := run.tcfg.lr_at(r.step)):   # --inject-lr-spike
            r.events.insert(0, {"event": "lr_spike_injected", "mult": r.lr / scheduled})
        row = metrics_row(r, run.global_batch * run.mcfg.seq_len, run.state.cursor * run.mcfg.seq_len,
                          repeat=r.step <= run.metrics.last_step)
        run.metrics.write(row)
        if self.board is not None:
            self.board.write(row)
        if (line := self.console.line(row)) is not None and not run.opts.quiet:
            say(line, self.rank)
        return row

    def close(self) -> None:
        if self.board is not None:
            self.board.close()


def log_every(k: int, steps: int) -> int:
    """--log-every K, where 0 means: every step up to AUTO_TABLE_STEPS steps, else about AUTO_ROWS lines."""
    return k if k > 0 else (1 if steps <= AUTO_TABLE_STEPS else max(2, round(steps / AUTO_ROWS)))


def duration(seconds: float) -> str:
    """12.3s, 4m05s, 2h07m."""
    if not math.isfinite(seconds):
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m"


class Console:
    """The per-step console of one launch. Every K = 1 steps: the full table (step_header). K > 1: a
    short line on the first step, every K-th step, the last step, every step with an event
    (checkpoint, rollback, ...) and every evaluation step: step, EMA of the accepted steps' training
    loss, the held-out loss when measured, the learning rate, tokens/s since the previous line,
    elapsed time and ETA of this launch."""

    def __init__(self, every: int, steps: int, start_step: int):
        self.every, self.steps, self.start_step = every, steps, start_step
        self.t0 = self.last_t = time.perf_counter()
        self.ema, self.n_ema, self.tokens = 0.0, 0, 0

    def header(self) -> str:
        if self.every == 1:
            return step_header()
        return (f"a line every {self.every} steps and at each event; loss_ema: EMA (beta {EMA_BETA}, bias-corrected) "
                f"of the accepted steps' train loss;\neval_loss: held-out, when measured (every evaluation is "
                f"printed); lr: the step's learning rate; tok/s: since the previous line; eta: at this launch's mean "
                f"step time\n{'step':>7} {'loss_ema':>9} {'eval_loss':>9} {'lr':>9} {'tok/s':>10} {'elapsed':>8} "
                f"{'eta':>8}  event")

    def line(self, m: dict) -> str | None:
        """The console line of metrics row `m`, or None when this step is not printed."""
        if m["accepted"] and (loss := number(m["loss"])) is not None:
            self.ema, self.n_ema = EMA_BETA * self.ema + (1 - EMA_BETA) * loss, self.n_ema + 1
        self.tokens += m["tokens"]
        if self.every == 1:   # the full table: step_header's columns
            return (f"{m['step']:>5} {m['loss']:>9.5f} {dash(m['eval_loss'], '.5f'):>9} {m['grad_norm']:>10.4f} "
                    f"{m['lr']:>9.2e} {m['step_ms']:>7.2f}  {m['param_norm']:>11.6f} {m['fingerprint']:<16}  "
                    f"{' '.join(e['event'] for e in m['events'])}")
        step = m["step"]
        if not (step % self.every == 0 or m["events"] or step == self.steps or step == self.start_step + 1
                or m["eval_loss"] is not None):
            return None
        now = time.perf_counter()
        rate, self.tokens, self.last_t = self.tokens / max(now - self.last_t, 1e-9), 0, now
        elapsed = now - self.t0
        eta = (self.steps - step) * elapsed / max(step - self.start_step, 1)
        ema = f"{self.ema / (1 - EMA_BETA ** self.n_ema):.5f}" if self.n_ema else "-"
        return (f"{step:>7} {ema:>9} {dash(m['eval_loss'], '.5f'):>9} {m['lr']:>9.2e} {rate:>10.0f} "
                f"{duration(elapsed):>8} {duration(eta):>8}  {' '.join(e['event'] for e in m['events'])}")


def rolled_back(r, guard_state, adam_t: int, rank: int) -> None:
    say(f"  rollback at step {r.step}: {r.rollback} (loss {r.loss:.6g}, held-out {dash(r.eval_loss, '.6g')}; last "
        f"accepted {dash(guard_state.last_loss, '.6g')}, held-out {guard_state.last_eval:.6g}); state of Adam step "
        f"{adam_t} in effect, samples [{r.samples[0]}, {r.samples[1]}) skipped", rank)


def resumed(path: str, state, saved_world: int, world: int, changed: dict, rank: int) -> None:
    changes = ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in sorted(changed.items()))
    note = f"note: resuming with changed settings: {changes}\n" if changed else ""
    say(f"{note}resumed from {path}: step {state.step}, written by {saved_world} ranks, now {world}; sample cursor "
        f"{state.cursor}; {'CRC-32s' if path.startswith('node memory') else 'logical digests'} verified", rank)


def memory_table(rows: list[dict]) -> str:
    """Per-rank memory rows (capstone.observe.memory), max and mean across ranks, and the formula of
    the run's ZeRO stage (bytes; peak RSS in MiB)."""
    keys = [f + "_bytes" for f in FIELDS]

    def row(label: str, values: list, *rss_bytes) -> tuple:
        return (label, *values, sum(values), *(b / MIB for b in rss_bytes))

    columns = [("rank", ">8")] + [(f, ">10.0f") for f in FIELDS] + [("total", ">11.0f"), ("peak_rss_MiB", ">13.1f")]
    labelled = [(str(r["rank"]), r) for r in rows] + list(aggregate(rows).items())   # each rank, then max and mean
    measured = [row(label, [m.get(k, 0) for k in keys], m["peak_rss_bytes"]) for label, m in labelled]
    formula = row(f"stage {rows[0]['stage']}", [max(r["formula"][k] for r in rows) for k in keys])
    return accounting.table(columns, measured + [formula]) + "  the formula (max over ranks; capstone.observe.memory)"


def aggregate(rows: list[dict]) -> dict:
    keys = [k for k in rows[0] if k not in ("rank", "stage") and isinstance(rows[0][k], (int, float))]
    return {"max": {k: max(r[k] for r in rows) for k in keys}, "mean": {k: sum(r[k] for r in rows) / len(rows) for k in keys}}


def checkpoints_line(manifests: list, verified: dict | None) -> str:
    """The console's one line on the checkpoints (`manifests`, at least one): how many written and kept,
    which one invariant (d) reloaded, the newest; their digests are in summary.json (`checkpoints`) and each
    file's .sha256."""
    kept = [m for m in manifests if os.path.exists(m["path"])]
    first = f"{os.path.basename(verified['path'])} reloaded by (d), " if verified and verified.get("path") else ""
    return (f"checkpoints: {len(manifests)} written, {len(kept)} kept; {first}newest {(kept or manifests)[-1]['path']} "
            f"(digests in summary.json; `python -m capstone.checkpoint inspect FILE` shows one)")


class MetricsLog:
    """Append-only metrics.jsonl (rank 0 writes; one JSON object per line, written per step). A row
    that does not fit (a full disk: a checkpoint being written fills it) is kept and written with
    the next one, after a warning; the run goes on, and the checkpoint's own error, if any, ends it."""

    def __init__(self, path: str | None):
        # the highest step logged: a resumed launch repeats steps up to this
        self.last_step = max((r["step"] for r in logged_rows(path)), default=0) if path else 0
        self.path, self.f = path, open(path, "ab", buffering=0) if path else None   # unbuffered: what failed is ours
        self.pending, self.warned = b"", False

    def write(self, record: dict) -> None:
        if self.f:
            self.pending += (json.dumps(jsonable(record), sort_keys=True, allow_nan=False) + "\n").encode()
            self.flush()

    def flush(self) -> None:
        try:
            while self.pending:
                self.pending = self.pending[self.f.write(self.pending):]
        except OSError as exc:
            if not self.warned:
                print(f"warning: could not write {self.path} ({exc.strerror}); its rows are kept in memory "
                      "and written when it can be", file=sys.stderr, flush=True)
            self.warned = True

    def close(self) -> None:
        if self.f:
            self.flush()
            if self.pending:
                error(f"warning: {len(self.pending)} bytes of rows could not be written to {self.path}")
            self.f.close()


@dataclasses.dataclass
class Summary:
    """The end of a run: what summary.json holds and the final report prints."""

    status: str
    run: object
    rows: list
    start_step: int
    invariants: dict
    memory: list
    wall: float
    final_fingerprint: tuple

    def to_json(self) -> dict:
        return {**outcome.basics(self.run, self.status, self.start_step, self.wall), "zero_what_if": self.what_if(),
                "padded": self.run.model.layout.padded, "last_step": self.rows[-1] if self.rows else None,
                "invariants": self.invariants, "memory": {"per_rank": self.memory, **aggregate(self.memory)},
                "final_param_fingerprint": self.final_fingerprint, "comm": accounting.comm_summary(self.rows),
                **({"post_validation": self.run.opt.counts} if self.run.plan.post_validates else {})}

    def what_if(self) -> dict:
        layout = self.run.model.layout
        return accounting.what_if(layout.n_params, layout.padded, self.run.grid.dp.size, self.memory,
                                  accounting.PRECISIONS[self.run.plan.precision])


def final(summary: Summary, verified: dict | None, failed: list[str], rank: int) -> None:
    """The final report: memory table, collectives, a line on the checkpoints, invariants, and the verdict
    line; with --quiet the verdict line only (and a violated invariant's lines)."""
    from capstone.observe.verdict import describe
    run = summary.run
    if not run.opts.quiet:
        say("\nmemory per rank (bytes):\n" + memory_table(summary.memory), rank)
        say("\n" + accounting.format_what_if(summary.what_if()), rank)
        # each collective's median time and bandwidths in this launch
        if comm := accounting.comm_summary(summary.rows):
            say(f"\ncollectives per step, rank 0's clock, median over {'steps after the first' if len(summary.rows) > 1 else 'the step'} "
                f"of this launch (bytes: nccl-tests S; GB/s = 1e9 B/s):\n" + accounting.format_comm_summary(comm), rank)
        if run.ckpt.manifests:
            say(checkpoints_line(run.ckpt.manifests, verified), rank)
        say("\ninvariants:\n  " + "\n  ".join(describe(summary.invariants, run.grid.world.size)), rank)
        if verified and verified["ok"]:
            say(f"resume verified: {verified['path']} reloads byte-equal on all {run.grid.world.size} ranks", rank)
    if failed:
        say("INVARIANT VIOLATED:\n  " + "\n  ".join(failed), rank)
        return
    again = f"; {how_to_continue(run)}" if summary.status == "preempted" and run.opts.quiet else ""
    say(f"{summary.status} step {run.state.step} in {summary.wall:.2f} s; summary "
        f"{os.path.join(run.out, 'summary.json')}{again}", rank)


def stopped(run, step: int, why: str | None) -> None:
    """Collective. The line of a run stopped on request: what asked, what was saved (once it is written: a stop
    waits for the background write), how to go on."""
    run.ckpt.drain()
    if run.grid.world.rank == 0:   # on record now, before the checks that end a run (capstone.runtime.ending)
        outcome.stopped(run, step, why)
    if run.opts.quiet:   # the final line says how to go on
        return
    man = run.ckpt.manifests[-1] if run.ckpt.manifests else {"path": run.resumed_from}
    why = why or ("--stop-after" if step == run.opts.stop_after else "a signal to another rank")
    saved = "saved checkpoint" if run.ckpt.manifests else "nothing trained since the checkpoint it resumed from,"
    unjudged = " (saved without its held-out evaluation: a resume judges it first)" if man.get("judged") is False else ""
    say(f"stopped at step {step} on {why}: {saved} {man['path']}{unjudged} (check it with python -m capstone.checkpoint "
        f"verify {man['path']}); {how_to_continue(run)}", run.grid.world.rank)


def how_to_continue(run) -> str:
    """The command's tail that continues a stopped run (the --stop-after it reached refuses a resume)."""
    passed = f" and --stop-after above {run.state.step} or none" if 0 < run.opts.stop_after <= run.state.step else ""
    return f"continue with --out {run.out} --resume latest{passed}"


def error(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
