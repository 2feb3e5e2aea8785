"""Model-state memory per rank: what a run's buffers hold, measured from the arrays themselves, and
what the formula of its ZeRO stage says they should hold (invariant (c), the memory table, the
what-if's measured row). P is the padded length of the flat buffer (this rank's tensor-parallel
slice), N the data-parallel group's size (with --cp: the dp x cp ranks of a stage, which hold the
same parameters); the shard is P/N elements (`Layout.shard`).

    stage 0: params 4P, grads 4P, reduce 0 (allreduced in place), optimizer 12P, guard 12P
    stage 1: params 4P, grads 4P, reduce 4P/N (+4P staging in tree order), optimizer 12P/N, guard 12P/N
    stage 2: params 4P, grads 4P/N, reduce <= the two largest buckets sent one after the other
    stage 3: params 4P/N, gathered <= the two largest consecutive groups, grads and reduce as stage 2
    --reshard step (stages 2-3): grads 4P and reduce as stage 1 (the whole gradient accumulates
      through the step, reduce-scattered once); stage 3 gathered: every group of the rank's part
    --deterministic: reduce = the rows of every block's shard, 4P x grad_accum, and the shard
    --precision bf16: params 2P (stage 3: 2P/N; stage 3's gathered groups 2 bytes a value), grads and optimizer
      as fp32's; reduce (stages 0-1): the shard and every bucket's bfloat16 pieces, 2P sent and 2P received
      (capstone.parallel.bf16sum); stages 2-3: a bucket's gradient and its pieces, the two largest in a row

The transient terms (`gathered`, `reduce` at stages 2-3) are measured as their peak over the run;
the formula's is the layout's (two consecutive groups or buckets), which the double-buffered
gather and reduction reach exactly whenever they run. The guard's term is the optimizer's again
(the state before the last update, what an undo restores), 0 with --no-guard-undo, and once more
with a zero-bubble schedule (the spare state of the update taken ahead: capstone.parallel.postvalidation). The snapshot
(--ckpt-async, the default) is the buffer a checkpoint's rows are copied into for the background
write: 12 bytes for each value of the checkpoint's shard (the canonical vectors over the world's
ranks: 12P/N without tensor or pipeline parallelism), allocated once (capstone.checkpoint.background).
The tier (--memory-tier K) is node memory outside the process, a tmpfs's files: this rank's own file and the
copies it keeps for the ranks whose buddy it is (one, for equal blocks of ranks per node), each 12 bytes for
each value of that shard and a 256 KiB trailer, for at most 3 steps (the newest complete one, the one after
it, the one being written: capstone.checkpoint.tier), so 3 x (1 + copies) x (12 x 12P/N + 256 KiB); measured
from the files' sizes at their peak.
"""

import resource
from dataclasses import asdict, dataclass, replace

from capstone.observe.accounting import PRECISIONS, zero_row
from capstone.step.state import ROWS

FIELDS = ("params", "gathered", "grads", "reduce", "optimizer", "guard", "snapshot", "tier")


@dataclass(frozen=True)
class ModelStates:
    """Bytes one rank holds (or should hold) for the model, per buffer (see the module)."""

    params: int      # the parameters kept across the step (all of them, or the shard at stage 3)
    gathered: int    # stage 3: the most gathered parameter groups held at once
    grads: int       # the gradient kept across the step (the flat buffer, or the shard at stages 2-3)
    reduce: int      # the reduction's own buffers (receive shard, staging, buckets in flight, rows)
    optimizer: int   # fp32 master, Adam m and v of the shard
    guard: int       # the optimizer state before the last update (the guard's exact undo; 0: --no-guard-undo)
    snapshot: int    # the asynchronous checkpoint's copy of the stored rows (0: --no-ckpt-async)
    tier: int = 0    # --memory-tier's files in the node's tmpfs, its own and the copies it keeps (their peak)

    @property
    def total(self) -> int:
        return sum(getattr(self, f) for f in FIELDS)

    def row(self, suffix: str = "_bytes") -> dict:
        return {k + suffix: v for k, v in asdict(self).items()}


def measured(run) -> ModelStates:
    """From the arrays the run holds now (the transient terms: their peak over the run)."""
    model, reducer, opt = run.model, run.reducer, run.opt
    own_grads = model.grads is not None
    grads = model.grads.nbytes if own_grads else reducer.grad_shard.nbytes
    return ModelStates(model.params.nbytes, model.seam.gathered_peak(), grads,
                       reducer.nbytes() - (0 if own_grads else grads), opt.state.nbytes, opt.before_nbytes(),
                       run.ckpt.buffer.nbytes if run.ckpt.buffer else 0, run.ckpt.tier.peak if run.ckpt.tier else 0)


def states(plan, padded: int, reduce, gathered: int, snapshot_shard: int) -> ModelStates:
    """The formula of the plan's ZeRO stage (see the module) for a rank holding `padded` elements of the
    model: the stage's row (capstone.observe.accounting), the guard's copy, the checkpoint's snapshot
    (`snapshot_shard`: its shard's elements); `reduce(grads)` and `gathered` are the transient terms of
    the reducer and seam (the run's objects, or the preflight's estimate before they exist)."""
    prec = PRECISIONS[plan.precision]
    row = zero_row(plan.zero.stage, padded, plan.zero_group, prec)
    grads = zero_row(1, padded, plan.zero_group, prec).grads_bytes if plan.whole_grad else row.grads_bytes
    return ModelStates(row.params_bytes, gathered, grads, reduce(grads), row.optimizer_bytes,
                       row.optimizer_bytes * (plan.guard_undo + plan.post_validates),
                       4 * len(ROWS) * snapshot_shard if plan.ckpt_async else 0)


def formula(run) -> ModelStates:
    """What the stage's formula says this rank holds: `states` with the gathered and reduction terms
    of the seam and reducer the modes chose."""
    def reduce(grads: int) -> int:
        return run.reducer.bound(run.tcfg.grad_accum) - (0 if run.model.grads is not None else grads)
    held = states(run.plan, run.model.layout.padded, reduce, run.model.seam.gathered_bound(), run.ckpt.layout.shard)
    return replace(held, tier=run.ckpt.tier.bound() if run.ckpt.tier else 0)


def row(run) -> dict:
    """This rank's memory row for summary.json: measured bytes, the formula's, and its peak RSS."""
    layout = run.model.layout
    return {"rank": run.grid.world.rank, "stage": run.plan.zero.stage, "n_params": layout.n_params,
            "padded": layout.padded, **measured(run).row(),
            "formula": formula(run).row(), "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
