"""The four invariants of every run, each returned as {"ok": bool, measured values...}.

(a) the loss decreases: the held-out loss at the evaluation points never rises by more than
    loss_monotone allows, and ends below where it began (the training loss is measured on a new
    batch every step, so its batch-to-batch noise is reported, not judged);
(b) every rank holds the same parameters at every step (norm and digest: sha256 on evaluation steps);
(c) every rank's model-state bytes (parameters, gradients, optimizer state, the buffers of the
    gradient reduction and of the ZeRO-3 gathers) equal its ZeRO stage's formula
    (capstone.observe.memory), the optimizer's 12 * P / N up to the padding of the flat buffer;
(d) the first checkpoint of the run reloads byte-equal to the in-memory snapshot taken when saving.
"""

from __future__ import annotations

SETTLE_MARGIN = 0.05  # how far above its start the held-out loss may wander while the run settles


class ReplicaCheck:
    """(b)'s record: every step's (norm, fingerprint) of every rank, kept only where they differ."""

    def __init__(self):
        self.checked, self.mismatches = 0, []

    def record(self, step: int, every: list) -> None:
        self.checked += 1
        if any(x != every[0] for x in every):
            self.mismatches.append({"step": step, "fingerprints": every})


def loss_monotone(evals: list, tol: float, rel: float = 0.0, settle_until: int = 0,
                  start: float | None = None, best: float | None = None, fresh: bool = True) -> dict:
    """(a) over the (step, held-out loss) evaluation points of this run segment, in order; the first
    is the segment's baseline (the start of the run, or the state it resumed from).

    A point may rise over the one before by at most tol + rel * (start - best so far): float noise
    early on, and the wiggle of a converging run later, in proportion to what it has learnt. Up to
    step `settle_until` (the warmup, or the first tenth of the run) a point may rise as far as
    SETTLE_MARGIN above the starting loss: Adam's first updates move every parameter by about lr,
    and the held-out loss may overshoot before it falls. The last point must be below the first (a fresh run) or below
    the run's starting loss (a resumed segment). A diverging run or a bad update rises far more.
    `start` and `best` default to the first point (a fresh run)."""
    worst, at, worst_rise, allowed_at = float("-inf"), None, None, None
    start = evals[0][1] if start is None and evals else start
    best = start if best is None else best
    for (_, prev), (step, cur) in zip(evals, evals[1:]):
        allowed = tol + rel * (start - best)
        if step <= settle_until:
            allowed = max(allowed, start * (1 + SETTLE_MARGIN) + tol - prev)
        if cur - prev - allowed > worst:
            worst, at, worst_rise, allowed_at = cur - prev - allowed, step, cur - prev, allowed
        best = min(best, cur)
    first, last = (evals[0][1], evals[-1][1]) if evals else (None, None)
    decreased = len(evals) >= 2 and last < (first if fresh else start)
    return {"ok": decreased and (at is None or worst <= 0), "tol": tol, "rel": rel, "settle_until": settle_until,
            "max_increase": worst_rise, "allowed_there": allowed_at, "at_step": at, "first": first, "last": last,
            "start": start, "fresh": fresh, "steps": len(evals) - 1}


def params_identical(mismatches: list[dict], steps_checked: int) -> dict:
    """(b) from the per-step cross-rank comparisons: `mismatches` lists the steps that disagreed."""
    return {"ok": not mismatches and steps_checked > 0, "steps_checked": steps_checked,
            "mismatches": mismatches[:5], "n_mismatches": len(mismatches)}


def optimizer_memory(per_rank_bytes: list[int], n_params: int, padded: int, world: int | None = None) -> dict:
    """(c) measured optimizer bytes of every rank against 12 * padded / N (12 * P / N unpadded).
    With --tp, P and padded are a TP slice's and N is the DP group's size (`world`)."""
    world = len(per_rank_bytes) if world is None else world
    expected = 12 * padded // world
    formula = 12 * n_params / world
    worst = max(abs(b - expected) for b in per_rank_bytes)
    return {"ok": worst == 0 and expected - formula < 12, "expected_bytes": expected,
            "formula_12P_over_N": formula, "padding_bytes_per_rank": expected - formula,
            "measured_bytes": per_rank_bytes, "max_deviation_bytes": worst}


def memory(rows: list[dict], world: int) -> dict:
    """(c) from every rank's memory row (capstone.observe.memory.row): measured == formula, per
    buffer; the optimizer's 12 * P / N for each part of the model (a pipeline stage's P is its own)."""
    from capstone.observe.memory import FIELDS
    parts: dict = {}
    for r in rows:
        parts.setdefault((r["n_params"], r["padded"]), []).append(r["optimizer_bytes"])
    checks = [optimizer_memory(b, n, p, world) for (n, p), b in parts.items()]
    result = {**checks[0], "ok": all(c["ok"] for c in checks), "measured_bytes": [r["optimizer_bytes"] for r in rows],
              "max_deviation_bytes": max(c["max_deviation_bytes"] for c in checks)}
    if len(checks) > 1:
        result["parts"] = [{k: c[k] for k in ("expected_bytes", "formula_12P_over_N", "padding_bytes_per_rank")}
                           for c in checks]
    off = {f: max(abs(r[f + "_bytes"] - r["formula"][f + "_bytes"]) for r in rows) for f in FIELDS}
    totals = [(sum(r[f + "_bytes"] for f in FIELDS), sum(r["formula"][f + "_bytes"] for f in FIELDS)) for r in rows]
    return {**result, "ok": result["ok"] and not any(off.values()), "stage": rows[0]["stage"],
            "deviation_bytes": off, "measured_total_bytes": max(t[0] for t in totals),
            "formula_total_bytes": max(t[1] for t in totals)}


def resume_bytes(result: dict | None) -> dict:
    """(d) from checkpoint.verify_snapshot."""
    if result is None:
        return {"ok": False, "reason": "no checkpoint was written in this run, so nothing could be verified"}
    return {"ok": bool(result["ok"]), "path": result["path"], "mismatched_bytes": result["mismatched_bytes"],
            "errors": result["errors"]}


def failures(results: dict) -> list[str]:
    """One line per violated invariant, saying which and by how much."""
    lines = []
    a, b, c, d = (results[k] for k in ("a_loss_monotone", "b_params_identical", "c_memory", "d_resume_bytes"))
    if not a["ok"]:
        lines.append(f"(a) loss not decreasing: rose by {a['max_increase']} at step {a['at_step']} where "
                     f"{a['allowed_there']} was allowed (tol {a['tol']} + {a['rel']} x progress; up to the start "
                     f"until step {a['settle_until']}); first {a['first']}, last {a['last']}")
    if not b["ok"]:
        lines.append(f"(b) parameters differ across ranks at {b['n_mismatches']} of {b['steps_checked']} steps: {b['mismatches']}")
    if not c["ok"]:
        lines.append(f"(c) optimizer bytes {c['measured_bytes']} != 12*padded/N = {c['expected_bytes']} "
                     f"(off by up to {c['max_deviation_bytes']} bytes)" + "".join(
                         f"; {k} off the stage-{c['stage']} formula by up to {v} bytes"
                         for k, v in c.get("deviation_bytes", {}).items() if v))
    if not d["ok"]:
        lines.append(f"(d) checkpoint reload not byte-equal: {d.get('mismatched_bytes')} bytes differ; {d.get('errors') or d.get('reason')}")
    return lines


def _memory_text(c: dict) -> str:
    parts = c.get("parts", [c])   # a pipeline stage's part of the model has its own P
    text = (f"optimizer bytes per rank {sorted(set(c['measured_bytes']))} = 12*P/N " +
            ", ".join(f"{x['formula_12P_over_N']:.1f} + padding {x['padding_bytes_per_rank']:.1f}" for x in parts) +
            (" (each pipeline stage's)" if len(parts) > 1 else ""))
    if "stage" in c:
        text += (f"; model states {c['measured_total_bytes']} bytes per rank (max) = the ZeRO stage-{c['stage']} "
                 f"formula {c['formula_total_bytes']}")
    return text


def describe(results: dict, world: int) -> list[str]:
    """One line per invariant with its measured values."""
    a, b, c, d = (results[k] for k in ("a_loss_monotone", "b_params_identical", "c_memory", "d_resume_bytes"))
    mark = {True: "ok    ", False: "FAILED"}
    rise = "n/a" if a["max_increase"] is None else \
        f"{a['max_increase']:+.2e} at step {a['at_step']} (allowed there {a['allowed_there']:.2e})"
    return [
        f"(a) {mark[a['ok']]} held-out loss {a['first']:.5f} -> {a['last']:.5f} over {a['steps']} evaluations; "
        f"closest to the limit: {rise}",
        f"(b) {mark[b['ok']]} parameter fingerprint identical on all {world} ranks at {b['steps_checked'] - b['n_mismatches']}"
        f"/{b['steps_checked']} steps",
        f"(c) {mark[c['ok']]} {_memory_text(c)}",
        f"(d) {mark[d['ok']]} " + (f"{d['path']}: {d['mismatched_bytes']} bytes differ from the in-memory snapshot"
                                   if "path" in d else d["reason"]),
    ]
