"""The run's modes, chosen once, when the run is built: which combinations of flags it runs
(`check`: every other combination is refused at start with the reason, exit 2), and what each
mode makes on this rank (`make` -> `Parts`): its part of the model (a pipeline stage's groups, a
tensor-parallel slice, a ZeRO-3 shard) with the initial parameters of the 1-rank run and the
checkpoints' view of it, the model, the gradient reducer (bucketed or one-shot, deterministic,
ZeRO-2/3), the optimizer, invariant (b)'s check, the held-out evaluator and the schedule of the
step's micro-batches. The optional layers are imported only for the modes that use them.
"""

from __future__ import annotations

from dataclasses import dataclass

from capstone.cli import Settings
from capstone.config import ConfigError
from capstone.data.heldout import HeldOut
from capstone.model.gpt import Model
from capstone.model.params import Layout, init_params
from capstone.model.seam import Resident, Weights
from capstone.observe import report
from capstone.parallel import grid as grids
from capstone.parallel.buckets import BucketReducer
from capstone.parallel.grid import Grid
from capstone.parallel.reduce import GradReducer
from capstone.parallel.replicas import ReplicaCheck
from capstone.parallel.schedules import Sequential
from capstone.parallel.zero import ZeroAdam
from capstone.roles import Replicas, Schedule, StateView, TrainedModel


@dataclass(kw_only=True)
class Parts:
    """What the modes make for one rank (capstone.run.Run holds them)."""

    layout: Layout     # this rank's part of the model, padded for its data-parallel group
    full: Layout       # the whole model, padded for the world: the checkpoints' layout
    view: StateView | None   # the checkpoints' view of this rank's optimizer shard (None: as is)
    model: TrainedModel
    reducer: GradReducer
    replicas: Replicas       # invariant (b)
    heldout: HeldOut
    opt: ZeroAdam
    schedule: Schedule
    data: object             # the run's batches (--cp: this rank's part of each sequence)


def check(world: int, settings: Settings) -> None:
    """ConfigError (exit 2) for a combination of flags the product does not run, with the reason."""
    mcfg, tcfg, opts = settings.model, settings.train, settings.opts
    grids.check(world, opts.tp, opts.pp, mcfg, opts.cp)
    if opts.pp > 1:
        from capstone.parallel.pipeline import stage_layers
        stage_layers(mcfg.n_layers, opts.pp, opts.pp_layers)      # counts that do not fit the model
    elif opts.pp_layers is not None or opts.pp_schedule is not None:
        raise ConfigError(f"{'--pp-layers' if opts.pp_layers is not None else '--pp-schedule'} is about pipeline "
                          f"stages: it needs --pp K > 1 (docs/pipeline.md).")
    if opts.reshard != "micro-batch" and opts.zero_stage < 2:
        raise ConfigError(f"--reshard {opts.reshard} is about ZeRO-2/3's sharded gradient and parameters: at "
                          f"--zero-stage {opts.zero_stage} the whole gradient is kept through the step anyway. Drop "
                          f"--reshard, or pass --zero-stage 2 or 3 (docs/composition.md).")
    if not opts.overlap and opts.zero_stage > 1 and opts.reshard == "micro-batch" and not tcfg.deterministic:
        raise ConfigError(f"--no-overlap is not supported with --zero-stage {opts.zero_stage}: stage {opts.zero_stage} "
                          f"reduces each bucket of the gradient as the backward pass makes it, and keeps no whole "
                          f"gradient to reduce after it. Drop --no-overlap, or keep the whole gradient through the "
                          f"step with --reshard step, or use --zero-stage 1 (docs/composition.md).")


def make(grid: Grid, settings: Settings, data, hooks, scale: float) -> Parts:
    """Collective: call on all ranks. This rank's parts; `scale` is 1 / tokens of the global batch.
    Every mode is the one model (capstone.model.gpt.Model) over this rank's groups, with the seam
    and gradient reducer the modes choose (capstone.model.seam)."""
    mcfg, tcfg, opts = settings.model, settings.train, settings.opts
    ring = None
    if grid.cp_size > 1:          # context parallelism: each sequence split over the cp ring (capstone.model.ring)
        from capstone.model import ring as rings
        ring = rings.Ring(grid.cp)
        data = rings.Chunks(data, ring)
    stages = _stages(grid, settings)
    layout = Layout.for_model(mcfg, grid.dp.size, grid.tp.size, stages[grid.pp.rank % len(stages)])
    full = Layout.for_model(mcfg, grid.world.size)
    view, params = _initial(grid, mcfg, tcfg, layout, full, stages, sharded=opts.zero_stage == 3)
    reducer = _reducer(grid, layout, settings)
    if opts.zero_stage == 0:      # plain data parallelism: the whole state replicated (capstone.parallel.zero0)
        from capstone.parallel import zero0
        view = zero0.ReplicatedView(grid.dp, layout, view)
        reducer = zero0.Allgathered(reducer) if tcfg.deterministic else reducer
    seam = _seam(grid, layout, params, reducer, opts.zero_stage, opts.reshard)
    stream, link = seam, None
    if mcfg.tie_embeddings and grid.pp.size > 1:    # wte on the first and last pipeline stages (parallel.tiedstages)
        from capstone.parallel.tiedstages import Link
        stream = link = Link(seam, grid.pp, (mcfg.vocab_size, mcfg.d_model))
    if mcfg.dropout:              # the seam counts each step's micro-batches for their masks (capstone.model.dropout)
        from capstone.model import dropout   # the sample's index is its replica's (a cp ring's ranks share samples)
        stream = dropout.Stream(stream, mcfg.dropout, tcfg.seed, grid.replica, grid.replicas,
                                ring or dropout.WHOLE)
    model = Model(mcfg, layout, stream, grid.tp, opts.recompute) if ring is None else \
        Model(mcfg, layout, stream, grid.tp, opts.recompute, ring)
    adam = ZeroAdam
    if opts.zero_stage == 3:      # the parameters are a shard too
        from capstone.parallel.zero3 import ShardedAdam as adam
    elif opts.zero_stage == 0:
        from capstone.parallel.zero0 import ReplicatedAdam as adam
    opt = adam(grid.dp, layout, model.params, (tcfg.beta1, tcfg.beta2), tcfg.eps, tcfg.weight_decay, tcfg.clip,
               undo=opts.guard_undo)
    schedule = Sequential(model, reducer, hooks, scale)
    if grid.pp.size > 1:
        from capstone.parallel.pipeline import Pipeline
        schedule = Pipeline(model, reducer, hooks, scale, opts.pp_schedule or "1f1b", grid.pp, link)
    if mcfg.dropout:
        from capstone.model.dropout import Stepped
        schedule = Stepped(schedule, stream)
    return Parts(layout=layout, full=full, view=view, model=model, reducer=reducer,
                 replicas=_replicas(grid, layout, seam, settings), heldout=_heldout(grid, data, settings, schedule),
                 opt=opt, schedule=schedule, data=data)


def _stages(grid: Grid, settings: Settings) -> list:
    """The parameter groups of each pipeline stage ([None]: one stage, the whole model)."""
    tcfg, K = settings.train, grid.pp.size
    if K == 1:
        return [None]
    from capstone.parallel.pipeline import stage_groups
    if tcfg.grad_accum < K and grid.world.rank == 0:
        report.say(f"warning: {tcfg.grad_accum} micro-batches (--grad-accum) through {K} pipeline stages: each "
                   f"stage idles (p-1)/(m+p-1) = {(K - 1) / (tcfg.grad_accum + K - 1):.0%} of the step (the bubble); "
                   f"raise --grad-accum to at least {K}.")
    return stage_groups(settings.model.n_layers, K, settings.opts.pp_layers)


def _initial(grid: Grid, mcfg, tcfg, layout: Layout, full: Layout, stages: list, sharded: bool):
    """(the checkpoints' view of this rank's state, its initial parameters): the 1-rank run's, made
    by rank 0 of each data-parallel group (ZeroAdam broadcasts them), or (ZeRO-3) by every rank,
    which keeps its shard; a model-parallel rank takes its part: its pipeline stage's `stages`
    groups, its tensor-parallel slice (capstone.parallel.canonical)."""
    dp, tp = grid.dp, grid.tp
    view, make = None, dp.rank == 0 or sharded
    if grid.mp.size > 1:
        from capstone.parallel import canonical, tensor
        view = canonical.Canonical(grid, mcfg, layout, full, stages)
        groups = stages[grid.pp.rank % len(stages)]
        params = tensor.initial_params(mcfg, layout, tcfg.seed, tp.size, tp.rank, groups) if make else layout.zeros()
    else:
        params = init_params(layout, mcfg, tcfg.seed) if make else layout.zeros()
    if sharded:
        lo, hi = layout.shard_range(dp.rank)
        params = params[lo:hi].copy()
    return view, params


def _reducer(grid: Grid, layout: Layout, settings: Settings) -> GradReducer:
    """The gradient reduction of the run's modes, with the flat gradient buffer it reduces from
    (`grads`): fixed-order sums (--deterministic), ZeRO-1's buckets, or (ZeRO-2/3: no buffer) each
    group's gradient reduce-scattered as it is made (capstone.parallel.zero2)."""
    tcfg, opts = settings.train, settings.opts
    if tcfg.deterministic:   # fixed-order sums (capstone.parallel.deterministic)
        from capstone.parallel import deterministic as det
        if grid.world.rank == 0:
            _deterministic_notes(opts)
        grads = layout.zeros() if opts.zero_stage <= 1 else None   # ZeRO-2/3: each group's exchanged as made
        return det.DeterministicReducer(grid, layout, grads, tcfg.grad_accum)
    floats = int(opts.bucket_mb * 2**20) // 4 if opts.overlap else layout.padded
    if opts.zero_stage == 1 or opts.reshard == "step":   # the whole gradient, reduce-scattered once a step
        return BucketReducer(grid, layout, layout.zeros(), floats, _loss_weight(grid))
    if opts.zero_stage == 0:      # the same buckets, allreduced (capstone.parallel.zero0)
        from capstone.parallel.zero0 import AllreduceReducer
        return AllreduceReducer(grid, layout, layout.zeros(), floats, _loss_weight(grid))
    from capstone.parallel.progress import Progress
    from capstone.parallel.zero2 import ShardedGradReducer
    return ShardedGradReducer(grid, layout, floats, Progress(), _loss_weight(grid))


def _deterministic_notes(opts) -> None:
    """What --deterministic changes of the other flags given, said once at start (rank 0)."""
    if opts.overlap:
        report.say("note: --deterministic exchanges each micro-batch's gradient after its backward pass, in a "
                   "fixed order; the bucketed overlap (--bucket-mb) does not apply.")
    if opts.reshard == "step":   # the fixed-order exchange keeps no whole gradient (capstone.observe.memory)
        kept = "only the gathered parameters stay through the step" if opts.zero_stage == 3 else "it changes nothing"
        report.say(f"note: --deterministic exchanges each micro-batch's gradient as it is made, so --reshard step "
                   f"keeps no whole gradient through the step: {kept} (docs/composition.md).")


def _seam(grid: Grid, layout: Layout, params, reducer: GradReducer, stage: int, reshard: str) -> Weights:
    """Where the model's weights come from and its gradients go: this rank's flat buffers, landing
    in the reducer's (capstone.model.seam), or at ZeRO-3 groups gathered from the shards (kept
    through the step with --reshard step)."""
    if stage == 3:
        from capstone.parallel.progress import Progress
        from capstone.parallel.zero3 import Gatherer
        progress = getattr(reducer, "progress", None) or Progress()   # ZeRO-2's thread, else one of its own
        return Gatherer(grid.dp, layout, params, tuple(layout.group_ranges()), progress, reducer.landed, reducer.grads,
                        keep=reshard == "step")
    return Resident.over(layout, params, reducer.grads, reducer.landed)


def _replicas(grid: Grid, layout: Layout, seam: Weights, settings: Settings) -> Replicas:
    """Invariant (b)'s check: the replicas' fingerprints (deterministic: bit-exact ones; ZeRO-3: of
    the groups each rank gathered)."""
    deterministic = settings.train.deterministic
    if deterministic:
        from capstone.parallel import deterministic as det
    if settings.opts.zero_stage == 3:
        from capstone.parallel.zero3 import ShardedReplicaCheck
        exact = det.ShardNorm(grid.dp, layout.n_params, layout.shard).sum_of_squares if deterministic else None
        return ShardedReplicaCheck(grid, layout, seam, exact)
    if deterministic:
        return ReplicaCheck(grid, layout, lambda p, strong: det.fingerprint(p, layout.n_params))
    return ReplicaCheck(grid, layout)


def _loss_weight(grid: Grid) -> float:
    """1 on the ranks whose loss is their replica's (the last pipeline stage's tensor-parallel rank 0)."""
    return 1.0 if grid.tp.rank == 0 and grid.pp.rank == grid.pp.size - 1 else 0.0


def _heldout(grid: Grid, data, settings: Settings, schedule: Schedule) -> HeldOut:
    """The held-out evaluation, through the schedule's forward: rows split over the data-parallel
    group (deterministic: fixed blocks)."""
    tcfg, T = settings.train, settings.model.seq_len
    if tcfg.deterministic:
        from capstone.parallel import deterministic as det
        return det.HeldOutBlocks(data, tcfg.eval_batches, tcfg.eval_batch_size, T, grid.world, grid.dp, schedule.loss,
                                 _loss_weight(grid), in_step=settings.opts.zero_stage == 3, cp=grid.cp_size)
    kind = HeldOut
    if settings.opts.zero_stage == 3:   # a forward gathers: a rank without rows still runs one
        from capstone.parallel.zero3 import GatheredHeldOut as kind
    return kind(data, tcfg.eval_batches, tcfg.eval_batch_size, T, grid.world, grid.dp.rank, grid.dp.size,
                schedule.loss, _loss_weight(grid))


