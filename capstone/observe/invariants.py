"""The four invariants of every run, each returned as {"ok": bool, measured values...}.

(a) the run learns (`learns`): its best held-out loss is at least MIN_DROP below the start, no held-out
    point jumps far above the noise of its moves, and the smoothed training loss does not rise beyond
    its noise; a held-out loss that rises from its best while the training loss does not (overfitting,
    noise) is reported plainly, not failed. Whether it learnt is "not judged" (reported in words, the
    run's status and exit code unchanged: `unjudged`) when the segment could not show it: a preempted
    segment, one with fewer than MIN_EVALS evaluations, or a run from trained weights (--init-from)
    whose held-out loss stayed at that model's floor (within SETTLE_MARGIN). A run from fresh weights
    that learns nothing, an update the guard had to undo, a jump or a rising training loss fail. `loss_monotone`, the strict point-to-point check, is
    reported alongside and gives the tolerance a jump must also exceed;
(b) every rank holds the same parameters at every step (norm and digest: sha256 on evaluation steps);
(c) every rank's model-state bytes (parameters, gradients, optimizer state, the buffers of the
    gradient reduction and of the ZeRO-3 gathers) equal its ZeRO stage's formula
    (capstone.observe.memory), the optimizer's 12 * P / N up to the padding of the flat buffer;
(d) the first checkpoint of the run reloads byte-equal to the in-memory snapshot taken when saving.
"""

import math
import statistics

SETTLE_MARGIN = 0.05  # how far above its start the held-out loss may wander while the run settles
MIN_DROP = 0.01       # (a): the run's best held-out loss must be at least 1% below its start
JUMP_SIGMAS = 8.0     # (a): a held-out rise this many robust sigmas above the typical move is a jump
TREND_SIGMAS = 4.0    # (a): a rise of the smoothed training loss by this many sigmas of its noise fails
MIN_BLOCK = 5         # (a): steps per block of the smoothed training loss (at least; else a tenth)
SIZE_FLOOR = 0.25     # (a): the spread of the held-out moves is taken as at least this x their typical size
MIN_EVALS = 2         # (a): held-out evaluations after the segment's start needed to judge whether it learnt
FALL_SIGMAS = 3.0     # (a): a training loss that fell by this many sigmas of its noise fell (said when not judged)


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
    return {"ok": len(evals) >= 2 and last < (first if fresh else start) and (at is None or worst <= 0), "tol": tol,
            "rel": rel, "settle_until": settle_until, "max_increase": worst_rise, "allowed_there": allowed_at,
            "at_step": at, "first": first, "last": last, "start": start, "fresh": fresh, "steps": len(evals) - 1}


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
    # the rises beyond the allowance, in sigmas above the typical move; the largest (the first of equals), else 0 sigmas
    beyond = [((rise - typical) / sigma, step, rise, allowed) for step, rise, allowed in steps if rise > allowed]
    z, at, rise, allowed = max([(0.0, None, None, None)] + [b for b in beyond if b[0] > 0], key=lambda b: b[0])
    return {"ok": z <= JUMP_SIGMAS, "limit": JUMP_SIGMAS, "typical_move": typical, "sigma": sigma, "sigmas": z,
            "at_step": at, "rise": rise, "allowed": allowed}


def trend(losses: list, tol: float, settle_until: int = 0, block: int | None = None) -> dict:
    """(a)'s training check on the accepted steps' (step, training loss): means of consecutive blocks of
    w = `block` steps (default max(MIN_BLOCK, n / 10); a run's segment passes its whole run's, so where
    a launch began does not change the scale a rise is judged at), aligned to the last step; the
    largest rise of a block over an earlier block, against tol + TREND_SIGMAS x the noise of a
    difference of two block means (per step: the robust sigma of the step-to-step changes / sqrt(2)). Rises that end by `settle_until` are
    Adam settling. Fewer than two blocks: not judged."""
    n = len(losses)
    w = max(MIN_BLOCK, n // 10) if block is None else block
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
           trend_settle: int = 0, preempted: bool = False, trained_start: bool = False,
           planned: int | None = None, block: int | None = None) -> dict:
    """(a) over this segment's held-out points `evals` (as loss_monotone) and accepted training losses
    `train` [(step, loss)]: learnt (the run's best held-out loss `run_best`, default this segment's, at
    least MIN_DROP below `start`), no jump, no rising training trend. `rose`: the held-out loss ended
    above its best by more than the strict tolerance (reported, not failed). `not_judged`: why whether
    it learnt cannot be told (`unjudged`; then only a jump or a training rise fails). `planned`: the
    evaluations the segment's cadence called for (default: those in `evals`); the others were rolled
    back by the guard, and an update so undone, like a held-out loss SETTLE_MARGIN above the start,
    counts as damage. `block`: the training trend's block (trend's)."""
    strict = loss_monotone(evals, tol, rel, settle_until, start, best, fresh)
    start = strict["start"]
    lowest = min([h for _, h in evals] + ([run_best] if run_best is not None else []), default=None)
    drop = None if lowest is None or start is None else start - lowest
    highest = max((h for _, h in evals[1:]), default=None)
    planned = len(evals) - 1 if planned is None else max(planned, len(evals) - 1)
    learnt = {"ok": drop is not None and len(evals) >= 2 and drop >= MIN_DROP * abs(start), "start": start,
              "best": lowest, "drop": drop, "min_drop": MIN_DROP, "highest": highest, "planned": planned,
              "rolled_back": planned - (len(evals) - 1), "damaged": planned > len(evals) - 1 or (
                  highest is not None and start is not None and highest > start * (1 + SETTLE_MARGIN) + tol)}
    jump = jumps(evals, tol, rel, settle_until, start, best) if evals else {"ok": True, "sigmas": 0.0, "at_step": None}
    rising = trend(train, tol, trend_settle, block)
    why = None if learnt["ok"] or not (jump["ok"] and rising["ok"]) else \
        unjudged(learnt, train, preempted, trained_start)
    return {**strict, "ok": (learnt["ok"] or why is not None) and jump["ok"] and rising["ok"],
            "strict_ok": strict["ok"], "learnt": learnt, "jump": jump, "trend": rising, "not_judged": why,
            "rose": rose_from_best(evals, tol, rel, start)}


def unjudged(learnt: dict, train: list, preempted: bool, trained_start: bool) -> str | None:
    """Why a segment whose best held-out loss is not MIN_DROP below its start cannot be judged on
    that (None: it can, and it did not learn): it was preempted before it could show it; its cadence
    called for fewer than MIN_EVALS evaluations; or it started from trained weights, nothing damaged
    it, and its held-out loss stayed at that model's floor (the losses cannot tell a model at its floor
    from updates too small to move it: the words say whether the training loss fell)."""
    evaluations = learnt["planned"] - learnt["rolled_back"]
    count = f"{evaluations} held-out evaluation{'s' * (evaluations != 1)}"
    if preempted:
        return f"the run was stopped (preempted) after {count} in this launch, before it could show learning"
    if learnt["planned"] < MIN_EVALS:
        return (f"{count} after the start, fewer than the {MIN_EVALS} needed to judge learning (evaluations come "
                f"every --eval-every steps, at each checkpoint and at the last step)")
    if not trained_start or learnt["damaged"]:
        return None
    fell = fall(train)
    moved = "" if fell is None else f" ({fell['first']:.5f} -> {fell['last']:.5f}, means of each half of the steps)"
    moved = f"while the training loss fell{moved}: a trained model need not improve on held-out text" \
        if fell and fell["sigmas"] > FALL_SIGMAS else f"and the training loss did not fall beyond its noise " \
        f"either{moved}: a model at its floor, or updates too small to change it (see lr and grad_norm in metrics.jsonl)"
    return (f"it started from trained weights (--init-from), and its held-out loss stayed at that model's floor "
            f"(start {learnt['start']:.5f}, best {learnt['best']:.5f}, at most {learnt['highest']:.5f}) {moved}")


def fall(train: list) -> dict | None:
    """How far the mean training loss of the second half of the steps is below the first half's, in
    sigmas of the noise of that difference (from the step-to-step changes); None: too few steps."""
    half = len(train) // 2
    if half < MIN_BLOCK:
        return None
    values = [loss for _, loss in train]
    first, last = sum(values[:half]) / half, sum(values[-half:]) / half
    sigma = robust_sigma([b - a for a, b in zip(values, values[1:])]) / math.sqrt(2) * math.sqrt(2 / half)
    return {"first": first, "last": last, "sigmas": (first - last) / max(sigma, 1e-12)}


def of_segment(state, tcfg, start_step: int, segment_start: tuple, preempted: bool = False,
               trained_start: bool = False) -> dict:
    """`learns` on a run segment's RunState: its evaluation points from its baseline (the start, or
    the state it resumed from, `segment_start` = (held-out loss, best held-out loss) there) and its
    accepted steps' training losses, with the tolerances and settle window of TrainConfig `tcfg`;
    `preempted`: the segment was stopped early; `trained_start`: the run began from trained weights. The
    training trend's blocks are the whole run's (a tenth of its steps): a bump that an uninterrupted run
    averages away is not a rise in a launch that resumed just before it."""
    fresh = start_step == 0
    points = [(start_step, state.eval_start if fresh else segment_start[0])]
    points += [(step, held) for step, _, held in state.losses if held is not None]
    settle = max(tcfg.warmup_steps, -(-tcfg.steps // 10))
    due = {s for s in range(start_step + 1, state.step + 1) if s % tcfg.eval_every == 0 or s == tcfg.steps
           or (tcfg.ckpt_every and s % tcfg.ckpt_every == 0)}   # capstone.checkpoint.cadence, less the clock's
    return learns(points, [(step, loss) for step, loss, _ in state.losses], tcfg.loss_tol, tcfg.loss_tol_rel, settle,
                  state.eval_start, state.eval_start if fresh else segment_start[1], fresh=fresh,
                  run_best=state.best_eval, trend_settle=-(-tcfg.steps // 10), preempted=preempted,
                  trained_start=trained_start, planned=len(due | {step for step, _ in points[1:]}),
                  block=max(MIN_BLOCK, tcfg.steps // 10))


def rose_from_best(evals: list, tol: float, rel: float, start: float | None) -> dict | None:
    """Where the held-out loss ended above its best point by more than tol + rel x progress, else None."""
    if len(evals) < 2:
        return None
    best_step, best = min(evals, key=lambda p: p[1])
    last_step, last = evals[-1]
    if last - best <= tol + rel * (start - best):
        return None
    return {"best": best, "best_step": best_step, "last": last, "last_step": last_step, "rise": last - best}


def params_identical(mismatches: list[dict], steps_checked: int, steps_run: int = 1) -> dict:
    """(b) from the per-step cross-rank comparisons: `mismatches` lists the steps that disagreed. A
    launch that ran steps must have compared some; one stopped before its first step (`steps_run` 0)
    has nothing to compare, and says so (`judged` False) without failing."""
    return {"ok": not mismatches and (steps_checked > 0 or steps_run == 0), "judged": steps_run > 0,
            "steps_checked": steps_checked, "mismatches": mismatches[:5], "n_mismatches": len(mismatches)}


def optimizer_memory(per_rank_bytes: list[int], n_params: int, padded: int, world: int | None = None,
                     replicated: bool = False) -> dict:
    """(c) measured optimizer bytes of every rank against 12 * padded / N (12 * P / N unpadded), or
    12 * padded (`replicated`: ZeRO stage 0, the padding below N elements in all).
    With --tp, P and padded are a TP slice's and N is the DP group's size (`world`)."""
    world = len(per_rank_bytes) if world is None else world
    share = 1 if replicated else world
    expected, formula = 12 * padded // share, 12 * n_params / share
    worst = max(abs(b - expected) for b in per_rank_bytes)
    return {"ok": worst == 0 and expected - formula < 12 * (world if replicated else 1), "expected_bytes": expected,
            "formula_12P_over_N": formula, "padding_bytes_per_rank": expected - formula,
            "measured_bytes": per_rank_bytes, "max_deviation_bytes": worst}


def memory(rows: list[dict], world: int) -> dict:
    """(c) from every rank's memory row (capstone.observe.memory.row): measured == formula, per
    buffer; the optimizer's 12 * P / N for each part of the model (a pipeline stage's P is its own;
    stage 0 replicates it: N = 1)."""
    from capstone.observe.memory import FIELDS
    parts = dict.fromkeys((r["n_params"], r["padded"]) for r in rows)   # (P, padded) of each part of the model
    checks = [optimizer_memory([r["optimizer_bytes"] for r in rows if (r["n_params"], r["padded"]) == (n, p)], n, p,
                               world, rows[0]["stage"] == 0) for n, p in parts]
    off = {f: max(abs(r[f + "_bytes"] - r["formula"][f + "_bytes"]) for r in rows) for f in FIELDS}
    totals = [(sum(r[f + "_bytes"] for f in FIELDS), sum(r["formula"][f + "_bytes"] for f in FIELDS)) for r in rows]
    return {**checks[0], "ok": all(c["ok"] for c in checks) and not any(off.values()), "stage": rows[0]["stage"],
            "measured_bytes": [r["optimizer_bytes"] for r in rows], "deviation_bytes": off,
            "max_deviation_bytes": max(c["max_deviation_bytes"] for c in checks),
            "measured_total_bytes": max(t[0] for t in totals), "formula_total_bytes": max(t[1] for t in totals),
            **({"parts": [{k: c[k] for k in ("expected_bytes", "formula_12P_over_N", "padding_bytes_per_rank")}
                          for c in checks]} if len(checks) > 1 else {})}


def resume_bytes(result: dict | None, nothing_to_save: bool = False) -> dict:
    """(d) from checkpoint.verify_snapshot (`nothing_to_save`: a resumed run stopped before its first
    update, which saves nothing)."""
    if result is None and nothing_to_save:
        return {"ok": True, "reason": "not checked: stopped before the first update of this launch, nothing to save"}
    if result is None:
        return {"ok": False, "reason": "no checkpoint was written in this run, so nothing could be verified"}
    return {"ok": bool(result["ok"]), "path": result["path"], "mismatched_bytes": result["mismatched_bytes"],
            "errors": result["errors"]}
