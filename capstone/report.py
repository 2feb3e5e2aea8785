"""What a run shows and leaves behind: the console tables, metrics.jsonl and summary.json."""

from __future__ import annotations

import json
import math
import os
import sys

MIB = 1024 * 1024


def say(text: str = "", rank: int = 0) -> None:
    if rank == 0:
        print(text, flush=True)


def step_header() -> str:
    return f"{'step':>5} {'loss':>9} {'eval_loss':>9} {'grad_norm':>10} {'lr':>9} {'ms':>7}  {'param_norm':>11} {'fingerprint':<16}  event"


def step_row(m: dict) -> str:
    held = "-" if m["eval_loss"] is None else f"{m['eval_loss']:.5f}"
    return (f"{m['step']:>5} {m['loss']:>9.5f} {held:>9} {m['grad_norm']:>10.4f} {m['lr']:>9.2e} {m['step_ms']:>7.2f}  "
            f"{m['param_norm']:>11.6f} {m['fingerprint']:<16}  {' '.join(e['event'] for e in m['events'])}")


def memory_table(rows: list[dict]) -> str:
    """Per-rank memory rows plus max and mean across ranks (bytes, peak RSS in MiB)."""
    keys = ("params_bytes", "grads_bytes", "optimizer_bytes", "guard_bytes", "peak_rss_bytes")
    lines = [f"{'rank':>6} {'params':>10} {'grads':>10} {'optimizer':>10} {'guard':>10} {'peak_rss_MiB':>13}"]

    def fmt(label, vals):
        return (f"{label:>6} " + " ".join(f"{v:>10.0f}" for v in vals[:4]) + f" {vals[4] / MIB:>13.1f}")

    for r in rows:
        lines.append(fmt(str(r["rank"]), [r[k] for k in keys]))
    lines.append(fmt("max", [max(r[k] for r in rows) for k in keys]))
    lines.append(fmt("mean", [sum(r[k] for r in rows) / len(rows) for k in keys]))
    return "\n".join(lines)


def aggregate(rows: list[dict]) -> dict:
    keys = [k for k in rows[0] if k != "rank"]
    return {"max": {k: max(r[k] for r in rows) for k in keys}, "mean": {k: sum(r[k] for r in rows) / len(rows) for k in keys}}


def manifest_text(man: dict) -> str:
    lines = [f"checkpoint {man['path']}  step {man['step']}  {man['world_size']} ranks  {man['bytes']} bytes",
             f"  meta_sha256 {man['meta_sha256']}"]
    for name, info in man["datasets"].items():
        lines.append(f"  /{name}  offset {info['offset']}  length {info['length']}  sha256 {info['sha256']}")
    for name, root in man["logical_sha256"].items():
        lines.append(f"  logical {name:<11} {root}")
    return "\n".join(lines)


def jsonable(value):
    """Floats as JSON can carry them: NaN and infinities become the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


class MetricsLog:
    """Append-only metrics.jsonl (rank 0 writes; one JSON object per line, flushed per step)."""

    def __init__(self, path: str | None):
        self.f = open(path, "a") if path else None

    def write(self, record: dict) -> None:
        if self.f:
            self.f.write(json.dumps(jsonable(record), sort_keys=True, allow_nan=False) + "\n")
            self.f.flush()

    def close(self) -> None:
        if self.f:
            self.f.close()


def write_json(path: str, data: dict) -> None:
    """Write JSON atomically (temporary file + rename)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(jsonable(data), f, indent=2, sort_keys=True, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def error(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
