"""What a run shows and leaves behind: the console lines and tables, metrics.jsonl and summary.json."""

from __future__ import annotations

import dataclasses
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


def banner(run) -> None:
    layout = run.model.layout
    say(f"capstone: {run.dist.world} ranks, {layout.n_params} parameters (padded {layout.padded}, shard "
        f"{layout.shard}), global batch {run.global_batch} x {run.mcfg.seq_len} tokens, run dir {run.out}", run.dist.rank)
    say(step_header(), run.dist.rank)


def metrics_row(r, tokens: int) -> dict:
    """The metrics.jsonl row of a StepResult (`tokens` per step)."""
    return {"step": r.step, "loss": r.loss, "eval_loss": r.eval_loss, "accepted": r.rollback is None,
            "grad_norm": r.grad_norm, "grad_norm_clipped": r.grad_norm if r.grad_norm_clipped is None else r.grad_norm_clipped,
            "lr": r.lr, "tokens": tokens, "samples": list(r.samples), **r.ms,
            "tokens_per_s": tokens / max(r.ms["step_ms"] / 1e3, 1e-9), "param_norm": r.param_norm,
            "fingerprint": r.fingerprint, "events": r.events}


def rolled_back(r, guard_state, adam_t: int, rank: int) -> None:
    held = "-" if r.eval_loss is None else f"{r.eval_loss:.6g}"
    last = "-" if guard_state.last_loss is None else f"{guard_state.last_loss:.6g}"
    say(f"  rollback at step {r.step}: {r.rollback} (loss {r.loss:.6g}, held-out {held}; last accepted {last}, "
        f"held-out {guard_state.last_eval:.6g}); state of Adam step {adam_t} in effect, samples "
        f"[{r.samples[0]}, {r.samples[1]}) skipped", rank)


def resumed(path: str, state, saved_world: int, world: int, changed: dict, rank: int) -> None:
    if changed:
        say("note: resuming with changed settings: " +
            ", ".join(f"{k} {a} -> {b}" for k, (a, b) in sorted(changed.items())), rank)
    say(f"resumed from {path}: step {state.step}, written by {saved_world} ranks, now "
        f"{world}; sample cursor {state.cursor}; logical digests verified", rank)


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
        run, layout = self.run, self.run.model.layout
        return {"status": self.status, "world_size": run.dist.world,
                "model_config": dataclasses.asdict(run.mcfg), "train_config": dataclasses.asdict(run.tcfg),
                "n_params": layout.n_params, "padded": layout.padded, "start_step": self.start_step,
                "final_step": run.state.step, "resumed_from": run.resumed_from,
                "losses": [list(x) for x in run.state.losses], "last_step": self.rows[-1] if self.rows else None,
                "invariants": self.invariants,
                "memory": {"per_rank": self.memory, **aggregate(self.memory)}, "checkpoints": run.ckpt.manifests,
                "rollbacks": run.state.rollbacks, "wall_seconds": self.wall,
                "final_param_fingerprint": self.final_fingerprint}


def final(summary: Summary, verified: dict | None, failed: list[str], rank: int) -> None:
    """The final report: memory table, manifests, invariants, and the verdict line."""
    from .invariants import describe
    run = summary.run
    say("\nmemory per rank (bytes):\n" + memory_table(summary.memory), rank)
    kept = [m for m in run.ckpt.manifests if os.path.exists(m["path"])]
    for man in kept[:1] + kept[-1:] if len(kept) > 1 else kept:  # the verified one and the newest
        say(manifest_text(man), rank)
    if len(kept) > 2 or len(kept) < len(run.ckpt.manifests):
        say(f"({len(run.ckpt.manifests)} checkpoints written, {len(kept)} kept; every manifest is in summary.json, "
            f"`python -m capstone.checkpoint inspect FILE` shows one)", rank)
    say("\ninvariants:\n  " + "\n  ".join(describe(summary.invariants, run.dist.world)), rank)
    if verified and verified["ok"]:
        say(f"resume verified: {verified['path']} reloads byte-equal on all {run.dist.world} ranks", rank)
    if failed:
        say("INVARIANT VIOLATED:\n  " + "\n  ".join(failed), rank)
    else:
        say(f"{summary.status} step {run.state.step} in {summary.wall:.2f} s; summary "
            f"{os.path.join(run.out, 'summary.json')}", rank)


def stopped(run, step: int, why: str | None) -> None:
    """The line of a run stopped on request: what asked, what was saved, how to go on."""
    path = run.ckpt.manifests[-1]["path"] if run.ckpt.manifests else None
    why = why or ("--stop-after" if step == run.opts.stop_after else "a signal to another rank")
    say(f"stopped at step {step} on {why}: saved checkpoint {path} (check it with "
        f"python -m capstone.checkpoint verify {path}); continue with --out {run.out} --resume latest", run.dist.rank)


def write_json(path: str, data: dict) -> None:
    """Write JSON atomically (temporary file + rename)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(jsonable(data), f, indent=2, sort_keys=True, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def error(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
