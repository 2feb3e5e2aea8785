"""Reading a run directory (OUT/metrics.jsonl, OUT/summary.json) for plots and accounting.

Plain Python, no matplotlib, no MPI. Tolerates a running run (a partial last line, no summary.json
yet) and a resumed one (a step written again: the latest row wins); optional fields may be missing.
"""

import contextlib
import json
import math
import os
from dataclasses import dataclass

# Step-time components in stacking order (disjoint parts of step_ms); any other *_ms field follows them.
PHASES = ("fwd_bwd", "reduce", "optimizer", "eval", "checks", "ckpt")
NOT_PHASES = {"step", "comm"}  # step_ms is the total; the "comm" dict's collectives happen inside the phases


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
    parsed = [json_object(line) for line in text.splitlines() if line.strip()]
    records = [obj for obj in parsed if obj is not None]
    return records, len(parsed) - len(records)


def json_object(line: str) -> dict | None:
    """The JSON object a line holds, else None (a partial line, or JSON that is no object)."""
    with contextlib.suppress(json.JSONDecodeError):
        obj = json.loads(line)
        return obj if isinstance(obj, dict) else None
    return None


def step_rows(records: list[dict]) -> list[dict]:
    """One row per step in step order; a step written again (after a resume) keeps the latest row.
    Adds "tokens_total" (cumulative tokens) where the row lacks it, summing "tokens"."""
    latest = {r["step"]: r for r in records if "event" not in r and isinstance(r.get("step"), int)}
    rows, total = [], 0
    for _, r in sorted(latest.items()):
        total = (r["tokens_total"] if number(r.get("tokens_total")) is not None
                 else total + (number(r.get("tokens")) or 0))
        rows.append({**r, "tokens_total": total})
    return rows


def logged_rows(path: str) -> list[dict]:
    """The step rows (`step_rows`) of the metrics.jsonl `path`; none if there is no such file."""
    with contextlib.suppress(OSError), open(path) as f:
        return step_rows(parse_lines(f.read())[0])
    return []


def number(value) -> float | None:
    """A finite float from a metrics value, else None (null, missing, "nan"/"inf" strings, booleans)."""
    with contextlib.suppress(TypeError, ValueError):
        x = float(value)
        if math.isfinite(x) and not isinstance(value, bool):
            return x
    return None


def series(rows: list[dict], key: str, x: str = "step", accepted_only: bool = False) -> tuple[list, list]:
    """(xs, ys) of the rows where both `x` and `key` are finite numbers."""
    pairs = [(number(r.get(x)), number(r.get(key))) for r in rows if not (accepted_only and r.get("accepted") is False)]
    pairs = [(xv, yv) for xv, yv in pairs if xv is not None and yv is not None]
    return [xv for xv, _ in pairs], [yv for _, yv in pairs]


def event_steps(rows: list[dict], name: str) -> list[int]:
    """Steps whose row lists an event called `name` (e.g. "rollback", "checkpoint")."""
    return [r["step"] for r in rows if any(isinstance(e, dict) and e.get("event") == name for e in r.get("events") or ())]


def resume_steps(starts: list[dict]) -> list[int]:
    """The step each resume started after (start rows that name a checkpoint)."""
    return [int(s.get("start_step", 0)) for s in starts if s.get("resumed_from")]


def timing_parts(row: dict) -> dict[str, float]:
    """Milliseconds of each phase of a step row: every "<phase>_ms" field except step_ms (the
    phases are disjoint, so they stack to at most the step; the collectives of "comm" run inside them)."""
    parts = {k[:-3]: number(v) for k, v in row.items() if k.endswith("_ms") and k[:-3] not in NOT_PHASES}
    return {k: v for k, v in parts.items() if v is not None}


def phase_order(rows: list[dict]) -> list[str]:
    """The phases present in any row: known ones in PHASES order, then the rest alphabetically."""
    present = set().union(*(timing_parts(r) for r in rows))
    return [p for p in PHASES if p in present] + sorted(present - set(PHASES))


def clip_level(run: Run) -> float | None:
    """train_config.clip of the latest start row that carries one (the segment still writing rows),
    else of summary.json; None if clipping is off or the run does not say."""
    configs = [(run.summary or {}).get("train_config")] + [s.get("train_config") for s in run.starts]
    clips = [c for cfg in reversed(configs) if isinstance(cfg, dict) and (c := number(cfg.get("clip"))) is not None]
    return clips[0] if clips and clips[0] > 0 else None   # the newest that says


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
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError), open(os.path.join(path, "summary.json")) as f:
        summary = json.load(f)
    return Run(path, label or os.path.basename(os.path.normpath(path)), tuple(step_rows(records)),
               tuple(r for r in records if r.get("event") == "start"), summary, bad)


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
