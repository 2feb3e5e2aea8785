"""The four invariants' results (capstone.observe.invariants) in words: the report's line for each, and for
a violated one the line that says which, by how much and what to do."""


def failures(results: dict) -> list[str]:
    """One line per violated invariant, saying which and by how much."""
    a, b, c, d = (results[k] for k in ("a_loss_monotone", "b_params_identical", "c_memory", "d_resume_bytes"))
    lines = [] if a["ok"] else learning_failures(a)
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


def memory_text(c: dict) -> str:
    parts = c.get("parts", [c])   # a pipeline stage's part of the model has its own P
    return (f"optimizer bytes per rank {sorted(set(c['measured_bytes']))} = 12*P/N " +
            ", ".join(f"{x['formula_12P_over_N']:.1f} + padding {x['padding_bytes_per_rank']:.1f}" for x in parts) +
            (" (each pipeline stage's)" if len(parts) > 1 else "") + f"; model states {c['measured_total_bytes']} "
            f"bytes per rank (max) = the ZeRO stage-{c['stage']} formula {c['formula_total_bytes']}")


def describe(results: dict, world: int) -> list[str]:
    """One line per invariant with its measured values."""
    a, b, c, d = (results[k] for k in ("a_loss_monotone", "b_params_identical", "c_memory", "d_resume_bytes"))
    mark = {True: "ok    ", False: "FAILED"}
    return [*describe_learning(a, mark[a["ok"]]),
            f"(b) {mark[b['ok']]} parameter fingerprint identical on all {world} ranks at "
            f"{b['steps_checked'] - b['n_mismatches']}/{b['steps_checked']} steps" if b.get("judged", True) else
            "(b) not judged: the launch stopped before its first step, so there were no parameters to compare",
            f"(c) {mark[c['ok']]} {memory_text(c)}", f"(d) {mark[d['ok']]} " + (
                f"{d['path']}: {d['mismatched_bytes']} bytes differ from the in-memory snapshot" if "path" in d
                else d["reason"])]


def learning_failures(a: dict) -> list[str]:
    """(a)'s failure lines (from `learns`): what failed, by how much, what to do."""
    lines, learnt, jump, rising = [], a["learnt"], a["jump"], a["trend"]
    if not learnt["ok"]:
        drop = "no evaluation after an update" if learnt["drop"] is None else f"its best held-out loss " \
            f"{learnt['best']:.5f} is {learnt['drop'] / abs(learnt['start']):.2%} below the start"
        lines.append(f"(a) loss not decreasing: the run did not learn: {drop} {learnt['start']:.5f} (at least "
                     f"{learnt['min_drop']:.0%} needed). {_learnt_hint(a)}")
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


def _learnt_hint(a: dict) -> str:
    """What to do about a run that did not learn, never contradicting the other failures' hints: an
    update that damaged the model, or a jump or rising training loss, asks for less; else more."""
    learnt = a["learnt"]
    if learnt.get("damaged"):
        how = (f"the guard rolled back {learnt['rolled_back']} of the {learnt['planned']} steps due for evaluation"
               if learnt["rolled_back"] else f"the held-out loss rose to {learnt['highest']:.5f}, more than 5% above "
               "its start")
        return (f"Updates damaged the model: {how}. Lower --lr (fine-tuning takes a fraction of the original's), "
                f"warm up (--warmup-steps), or set --clip.")
    if not (a["jump"]["ok"] and a["trend"]["ok"]):
        return "The failure below is the likely cause."
    return ("Raise --lr, train for more --steps, or check that updates are applied (param_norm and grad_norm in "
            "metrics.jsonl).")


def describe_learning(a: dict, mark: str) -> list[str]:
    """(a)'s report lines: the held-out loss, its best, jumps, the training trend, and a plain note
    when the held-out loss rose from its best while the training loss did not rise."""
    learnt, jump, rising, rose = a["learnt"], a["jump"], a["trend"], a["rose"]
    best = "-" if learnt["best"] is None else \
        f"{learnt['best']:.5f} ({learnt['drop'] / abs(learnt['start']):.1%} below the start)"
    held = f"held-out loss {a['first']:.5f} -> {a['last']:.5f} over {a['steps']} evaluations; best {best}"
    lines = [f"(a) {mark} {held}"]
    if a.get("not_judged") and a["ok"]:
        lines = [f"(a) not judged: {a['not_judged']}; the run's status stands", f"           {held}"]
        if not a["steps"]:   # nothing measured in this launch: no figures to show
            return lines[:1]
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
