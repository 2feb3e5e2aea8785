"""The four invariants of every run, each returned as {"ok": bool, measured values...}.

(a) the run learns (`learns`): its best held-out loss is at least MIN_DROP below the start, no held-out
    point jumps far above the noise of its moves, and the smoothed training loss does not rise beyond
    its noise; a held-out loss that rises from its best while the training loss does not (overfitting,
    noise) is reported plainly, not failed. `loss_monotone`, the strict point-to-point check, is
    reported alongside and gives the tolerance a jump must also exceed;
(b) every rank holds the same parameters at every step (norm and digest: sha256 on evaluation steps);
(c) every rank's model-state bytes (parameters, gradients, optimizer state, the buffers of the
    gradient reduction and of the ZeRO-3 gathers) equal its ZeRO stage's formula
    (capstone.observe.memory), the optimizer's 12 * P / N up to the padding of the flat buffer;
(d) the first checkpoint of the run reloads byte-equal to the in-memory snapshot taken when saving.
"""

from __future__ import annotations

import math
import statistics

SETTLE_MARGIN = 0.05  # how far above its start the held-out loss may wander while the run settles
MIN_DROP = 0.01       # (a): the run's best held-out loss must be at least 1% below its start
JUMP_SIGMAS = 8.0     # (a): a held-out rise this many robust sigmas above the typical move is a jump
TREND_SIGMAS = 4.0    # (a): a rise of the smoothed training loss by this many sigmas of its noise fails
MIN_BLOCK = 5         # (a): steps per block of the smoothed training loss (at least; else a tenth)
SIZE_FLOOR = 0.25     # (a): the spread of the held-out moves is taken as at least this x their typical size


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
    for step, rise, allowed in moves(evals, tol, rel, settle_until, start, best):
        if rise - allowed > worst:
            worst, at, worst_rise, allowed_at = rise - allowed, step, rise, allowed
    first, last = (evals[0][1], evals[-1][1]) if evals else (None, None)
    decreased = len(evals) >= 2 and last < (first if fresh else start)
    return {"ok": decreased and (at is None or worst <= 0), "tol": tol, "rel": rel, "settle_until": settle_until,
            "max_increase": worst_rise, "allowed_there": allowed_at, "at_step": at, "first": first, "last": last,
            "start": start, "fresh": fresh, "steps": len(evals) - 1}


def moves(evals: list, tol: float, rel: float, settle_until: int, start: float, best: float | None) -> list:
    """(step, rise over the previous point, the rise allowed there) of each evaluation point after the
    first: tol + rel * (start - best so far), and up to SETTLE_MARGIN above the start until `settle_until`."""
    out, best = [], start if best is None else best
    for (_, prev), (step, cur) in zip(evals, evals[1:]):
        allowed = tol + rel * (start - best)
        if step <= settle_until:
            allowed = max(allowed, start * (1 + SETTLE_MARGIN) + tol - prev)
        out.append((step, cur - prev, allowed))
        best = min(best, cur)
    return out


def robust_sigma(values: list) -> float:
    """1.4826 x the median absolute deviation: the standard deviation of normal noise, which a few
    outliers do not move (0.0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    med = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - med) for v in values)


def jumps(evals: list, tol: float, rel: float, settle_until: int, start: float, best: float | None) -> dict:
    """(a)'s jump check: each held-out rise beyond loss_monotone's allowance, in robust sigmas of the
    moves between evaluation points above the typical (median) move; above JUMP_SIGMAS is an update
    that made the model worse at once (lr x 10 for one step: about 20), not noise or overfitting (1-4)."""
    steps = moves(evals, tol, rel, settle_until, start, best)
    rises = [rise for _, rise, _ in steps]
    typical = statistics.median(rises) if rises else 0.0
    size = statistics.median(abs(r) for r in rises) if rises else 0.0   # a few equal moves have no spread:
    sigma = max(robust_sigma(rises), SIZE_FLOOR * size, tol, 1e-12)     # then a quarter of their size
    worst = {"sigmas": 0.0, "at_step": None, "rise": None, "allowed": None}
    for step, rise, allowed in steps:
        z = (rise - typical) / sigma
        if rise > allowed and z > worst["sigmas"]:
            worst = {"sigmas": z, "at_step": step, "rise": rise, "allowed": allowed}
    return {"ok": worst["sigmas"] <= JUMP_SIGMAS, "limit": JUMP_SIGMAS, "typical_move": typical, "sigma": sigma,
            **worst}


def trend(losses: list, tol: float, settle_until: int = 0) -> dict:
    """(a)'s training check on the accepted steps' (step, training loss): means of consecutive blocks of
    w = max(MIN_BLOCK, n / 10) steps (aligned to the last step); the largest rise of a block over an
    earlier block, against tol + TREND_SIGMAS x the noise of a difference of two block means (per step:
    the robust sigma of the step-to-step changes / sqrt(2)). Rises that end by `settle_until` are
    Adam settling. Fewer than two blocks: not judged."""
    n = len(losses)
    w = max(MIN_BLOCK, n // 10)
    if n < 2 * w:
        return {"ok": True, "judged": False, "block": w, "steps": n}
    values = [loss for _, loss in losses]
    sigma = robust_sigma([b - a for a, b in zip(values, values[1:])]) / math.sqrt(2)
    allowed = tol + TREND_SIGMAS * sigma * math.sqrt(2 / w)
    blocks = [(losses[i][0], losses[i + w - 1][0], sum(values[i:i + w]) / w) for i in range(n % w, n, w)]
    low, worst = blocks[0], (0.0, None, None)
    for block in blocks[1:]:
        if block[1] > settle_until and block[2] - low[2] > worst[0]:
            worst = (block[2] - low[2], low, block)
        low = min(low, block, key=lambda b: b[2])
    return {"ok": worst[0] <= allowed, "judged": True, "block": w, "steps": n, "sigma_per_step": sigma,
            "allowed": allowed, "rise": worst[0], "from": worst[1], "to": worst[2], "first": blocks[0][2],
            "last": blocks[-1][2], "lowest": min(b[2] for b in blocks)}


def learns(evals: list, train: list, tol: float, rel: float = 0.0, settle_until: int = 0, start: float | None = None,
           best: float | None = None, fresh: bool = True, run_best: float | None = None,
           trend_settle: int = 0) -> dict:
    """(a) over this segment's held-out points `evals` (as loss_monotone) and accepted training losses
    `train` [(step, loss)]: learnt (the run's best held-out loss `run_best`, default this segment's, at
    least MIN_DROP below `start`), no jump, no rising training trend. `rose`: the held-out loss ended
    above its best by more than the strict tolerance (reported, not failed)."""
    strict = loss_monotone(evals, tol, rel, settle_until, start, best, fresh)
    start = strict["start"]
    lowest = min([h for _, h in evals] + ([run_best] if run_best is not None else []), default=None)
    drop = None if lowest is None or start is None else start - lowest
    learnt = {"ok": drop is not None and len(evals) >= 2 and drop >= MIN_DROP * abs(start),
              "start": start, "best": lowest, "drop": drop, "min_drop": MIN_DROP}
    jump = jumps(evals, tol, rel, settle_until, start, best) if evals else {"ok": True, "sigmas": 0.0, "at_step": None}
    rising = trend(train, tol, trend_settle)
    return {**strict, "ok": learnt["ok"] and jump["ok"] and rising["ok"], "strict_ok": strict["ok"],
            "learnt": learnt, "jump": jump, "trend": rising, "rose": rose_from_best(evals, tol, rel, start)}


def of_segment(state, tcfg, start_step: int, segment_start: tuple) -> dict:
    """`learns` on a run segment's RunState: its evaluation points from its baseline (the start, or
    the state it resumed from, `segment_start` = (held-out loss, best held-out loss) there) and its
    accepted steps' training losses, with the tolerances and settle window of TrainConfig `tcfg`."""
    fresh = start_step == 0
    points = [(start_step, state.eval_start if fresh else segment_start[0])]
    points += [(step, held) for step, _, held in state.losses if held is not None]
    settle = max(tcfg.warmup_steps, -(-tcfg.steps // 10))
    return learns(points, [(step, loss) for step, loss, _ in state.losses], tcfg.loss_tol, tcfg.loss_tol_rel, settle,
                  state.eval_start, state.eval_start if fresh else segment_start[1], fresh=fresh,
                  run_best=state.best_eval, trend_settle=-(-tcfg.steps // 10))


def rose_from_best(evals: list, tol: float, rel: float, start: float | None) -> dict | None:
    """Where the held-out loss ended above its best point by more than tol + rel x progress, else None."""
    if len(evals) < 2:
        return None
    best_step, best = min(evals, key=lambda p: p[1])
    last_step, last = evals[-1]
    if last - best <= tol + rel * (start - best):
        return None
    return {"best": best, "best_step": best_step, "last": last, "last_step": last_step, "rise": last - best}


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
        lines += learning_failures(a) if "learnt" in a else [
            f"(a) loss not decreasing: rose by {a['max_increase']} at step {a['at_step']} where "
            f"{a['allowed_there']} was allowed (tol {a['tol']} + {a['rel']} x progress; up to the start "
            f"until step {a['settle_until']}); first {a['first']}, last {a['last']}"]
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
    return [
        *describe_learning(a, mark[a["ok"]]),
        f"(b) {mark[b['ok']]} parameter fingerprint identical on all {world} ranks at {b['steps_checked'] - b['n_mismatches']}"
        f"/{b['steps_checked']} steps",
        f"(c) {mark[c['ok']]} {_memory_text(c)}",
        f"(d) {mark[d['ok']]} " + (f"{d['path']}: {d['mismatched_bytes']} bytes differ from the in-memory snapshot"
                                   if "path" in d else d["reason"]),
    ]


def learning_failures(a: dict) -> list[str]:
    """(a)'s failure lines (from `learns`): what failed, by how much, what to do."""
    lines, learnt, jump, rising = [], a["learnt"], a["jump"], a["trend"]
    if not learnt["ok"]:
        share = None if learnt["drop"] is None else learnt["drop"] / abs(learnt["start"])
        drop = "no evaluation after an update" if share is None else \
            f"its best held-out loss {learnt['best']:.5f} is {share:.2%} below the start"
        lines.append(f"(a) loss not decreasing: the run did not learn: {drop} {learnt['start']:.5f} (at least "
                     f"{MIN_DROP:.0%} needed). Raise --lr, train for more --steps, or check that updates are "
                     f"applied (param_norm and grad_norm in metrics.jsonl).")
    if not jump["ok"]:
        lines.append(f"(a) loss not decreasing: the held-out loss jumped by {jump['rise']:+.5f} at step "
                     f"{jump['at_step']}, "
                     f"{jump['sigmas']:.1f} robust sigmas of its moves between evaluations (limit {jump['limit']:g}; "
                     f"the strict tolerance allowed {jump['allowed']:.5f}): an update made the model worse at once. "
                     f"Lower --lr or set --clip; metrics.jsonl shows the lr and grad_norm of step {jump['at_step']}.")
    if not rising["ok"]:
        (a0, a1, low), (b0, b1, high) = rising["from"], rising["to"]
        lines.append(f"(a) loss not decreasing: the training loss rose: its mean over {rising['block']} steps "
                     f"went from {low:.5f} (steps {a0}-{a1}) to {high:.5f} (steps {b0}-{b1}), {rising['rise']:+.5f} where its "
                     f"noise allows {rising['allowed']:.5f}: the model is getting worse on the data it trains on. "
                     f"Lower --lr, set --clip, or check the gradient (its sign, its scale).")
    return lines


def describe_learning(a: dict, mark: str) -> list[str]:
    """(a)'s report lines: the held-out loss, its best, jumps, the training trend, and a plain note
    when the held-out loss rose from its best while the training loss did not rise."""
    learnt, jump, rising, rose = a["learnt"], a["jump"], a["trend"], a["rose"]
    best = "-" if learnt["best"] is None else \
        f"{learnt['best']:.5f} ({learnt['drop'] / abs(learnt['start']):.1%} below the start)"
    lines = [f"(a) {mark} held-out loss {a['first']:.5f} -> {a['last']:.5f} over {a['steps']} evaluations; best {best}"]
    jumped = "no rise beyond the strict tolerance" if jump["at_step"] is None else \
        f"largest rise beyond the strict tolerance {jump['rise']:+.2e} at step {jump['at_step']} = " \
        f"{jump['sigmas']:.1f} sigmas (limit {jump['limit']:g})"
    trend_text = f"training loss not judged ({rising['steps']} steps, fewer than 2 x {rising['block']})" \
        if not rising["judged"] else f"training loss ({rising['block']}-step means) {rising['first']:.5f} -> " \
        f"{rising['last']:.5f}, largest rise {rising['rise']:+.2e} (noise allows {rising['allowed']:.2e})"
    lines.append(f"           {jumped}; {trend_text}")
    if rose and a["ok"]:
        lines.append(f"    note: the held-out loss rose from its best {rose['best']:.5f} at step {rose['best_step']} "
                     f"to {rose['last']:.5f} at step {rose['last_step']} ({rose['rise']:+.5f}) while the training loss "
                     f"did not rise: overfitting, or noise in the held-out loss. The run is fine; the model of step "
                     f"{rose['best_step']} generalised best (--keep-best keeps such a checkpoint).")
    return lines
