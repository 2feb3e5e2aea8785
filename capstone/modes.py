"""The run's modes, chosen once, when the run is built: what each mode of the run's plan
(capstone.plan, which also refuses every layout it does not run) makes on this rank (`make` ->
`Parts`): its part of the model (a pipeline stage's groups, a tensor-parallel slice, a ZeRO-3 shard) with the initial parameters of the 1-rank run and the
checkpoints' view of it, the model, the gradient reducer (bucketed or one-shot, deterministic,
ZeRO-2/3), the optimizer, invariant (b)'s check, the held-out evaluator and the schedule of the
step's micro-batches. The optional layers are imported only for the modes that use them.
"""

from dataclasses import dataclass

from capstone.plan import Plan
from capstone.data.heldout import HeldOut
from capstone.model.blocks import WHOLE
from capstone.model.gpt import Model
from capstone.model import precision
from capstone.model.params import Layout, init_params
from capstone.model.seam import Resident, Weights
from capstone.config import ModelConfig, TrainConfig
from capstone.observe import report
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


def make(grid: Grid, plan: Plan, mcfg: ModelConfig, tcfg: TrainConfig, data, hooks, scale: float) -> Parts:
    """Collective: call on all ranks. This rank's parts; `scale` is 1 / tokens of the global batch.
    Every mode is the one model (capstone.model.gpt.Model) over this rank's groups, with the seam
    and gradient reducer the plan chooses (capstone.model.seam)."""
    zero, ring = plan.zero, None
    if grid.cp_size > 1:          # context parallelism: each sequence split over the cp ring (capstone.model.ring)
        from capstone.model import ring as rings
        ring = rings.Ring(grid.cp)
        data = rings.Chunks(data, ring)
    _warn_bubble(grid, plan, tcfg)
    groups = plan.stages[grid.pp.rank % len(plan.stages)]   # this rank's pipeline stage's parameter groups
    layout = Layout.for_model(mcfg, grid.dp.size, grid.tp.size, groups)
    full = Layout.for_model(mcfg, grid.world.size)
    view, params = _initial(grid, mcfg, tcfg, layout, full, plan.stages, groups, sharded=zero.shards_params)
    sums = None
    if plan.deterministic:        # norms and fingerprint of the canonical vector (capstone.parallel.chunksums)
        from capstone.parallel.chunksums import ChunkSums, canonical_index
        sums = ChunkSums(grid.world, canonical_index(grid, mcfg, layout, groups), full.n_params)
    reducer = _reducer(grid, layout, plan, tcfg, sums)
    if not zero.shards_optimizer:      # plain data parallelism: the whole state replicated (capstone.parallel.zero0)
        from capstone.parallel import zero0
        view = zero0.ReplicatedView(grid.dp, layout, view)
        reducer = zero0.Allgathered(reducer) if plan.deterministic or plan.precision == "bf16" else reducer
    prec = precision.of(plan.precision)    # bf16: the layers read bfloat16 weights (capstone.model.precision)
    seam = _seam(grid, layout, params if prec is None else prec.working(params), reducer, plan)
    link = masks = None
    arith = ring or WHOLE         # the layers' arithmetic (--deterministic's: cut canonically, capstone.model.exact)
    if plan.deterministic:
        from capstone.model.exact import Exact
        arith = Exact(plan.det_split, mcfg.seq_len, mcfg.n_heads, grid.tp, ring)
    if mcfg.tie_embeddings and grid.pp.size > 1:    # wte on the first and last pipeline stages (parallel.tiedstages)
        from capstone.parallel.tiedstages import Link
        link = Link(seam, grid.pp, (mcfg.vocab_size, mcfg.d_model), arith.share_buffer)
    if mcfg.dropout:              # each micro-batch's masks (capstone.model.dropout): the sample's index is its
        from capstone.model import dropout   # replica's (a cp ring's ranks share samples)
        masks = dropout.Draws(mcfg.dropout, tcfg.seed, grid.replica, grid.replicas, ring)
    model = Model(mcfg, layout, seam, grid.tp, plan.recompute, arith, masks, link, prec)
    adam = ZeroAdam
    if zero.shards_params:        # the parameters are a shard too
        from capstone.parallel.zero3 import ShardedAdam as adam
    elif not zero.shards_optimizer:
        from capstone.parallel.zero0 import ReplicatedAdam as adam
    if plan.post_validates:       # the update taken before the step's checks (capstone.parallel.postvalidation)
        from capstone.parallel.postvalidation import post_validated
        adam = post_validated(adam)
    opt = adam(grid.dp, layout, params, (tcfg.beta1, tcfg.beta2), tcfg.eps, tcfg.weight_decay, tcfg.clip,
               undo=plan.guard_undo, prec=prec, working=model.params)
    if plan.post_validates:
        reducer.ahead = lambda grad: opt.take_ahead(grad, hooks.learning_rate(hooks.step, tcfg.lr_at(hooks.step)))
    schedule = Sequential(model, reducer, hooks, scale)
    if grid.pp.size > 1:
        from capstone.parallel.pipeline import Pipeline
        schedule = Pipeline(model, reducer, hooks, scale, plan.schedule, grid.pp, link)
    return Parts(layout=layout, full=full, view=view, model=model, reducer=reducer, opt=opt, schedule=schedule,
                 data=data, replicas=_replicas(grid, layout, seam, plan, sums),
                 heldout=_heldout(grid, data, plan, tcfg, mcfg, schedule))


def _warn_bubble(grid: Grid, plan: Plan, tcfg: TrainConfig) -> None:
    """Fewer micro-batches than pipeline stages: said once at start (rank 0)."""
    if (K := plan.pp) > 1 and tcfg.grad_accum < K and grid.world.rank == 0:
        report.say(f"warning: {tcfg.grad_accum} micro-batches (--grad-accum) through {K} pipeline stages: each "
                   f"stage idles (p-1)/(m+p-1) = {(K - 1) / (tcfg.grad_accum + K - 1):.0%} of the step (the bubble); "
                   f"raise --grad-accum to at least {K}.")


def _initial(grid: Grid, mcfg, tcfg, layout: Layout, full: Layout, stages: tuple, groups, sharded: bool):
    """(the checkpoints' view of this rank's state, its initial parameters): the 1-rank run's, made
    by rank 0 of each data-parallel group (ZeroAdam broadcasts them), or (ZeRO-3) by every rank,
    which keeps its shard; a model-parallel rank takes its part: its pipeline stage's `groups` (of
    every stage's, `stages`), its tensor-parallel slice (capstone.parallel.canonical)."""
    dp, tp = grid.dp, grid.tp
    view, make = None, dp.rank == 0 or sharded
    if grid.mp.size > 1:
        from capstone.parallel import canonical, tensor
        view = canonical.Canonical(grid, mcfg, layout, full, stages)
        params = tensor.initial_params(mcfg, layout, tcfg.seed, tp.size, tp.rank, groups) if make else layout.zeros()
    else:
        params = init_params(layout, mcfg, tcfg.seed) if make else layout.zeros()
    if sharded:
        params = params[slice(*layout.shard_range(dp.rank))].copy()
    return view, params


def _reducer(grid: Grid, layout: Layout, plan: Plan, tcfg: TrainConfig, sums=None) -> GradReducer:
    """The gradient reduction of the run's modes, with the flat gradient buffer it reduces from
    (`grads`): fixed-order sums (--deterministic), ZeRO-1's buckets, or (ZeRO-2/3: no buffer) each
    group's gradient reduce-scattered as it is made (capstone.parallel.zero2)."""
    zero, bf16 = plan.zero, plan.precision == "bf16"
    if plan.deterministic:   # fixed-order sums (capstone.parallel.deterministic)
        from capstone.parallel.deterministic import DeterministicReducer
        if grid.world.rank == 0:
            _deterministic_notes(plan)
        # no buffer at ZeRO-2/3 (each group's exchanged as made); float32 messages also with bf16: a cp rank's is a
        # subtree of a block's chunk sum (docs/precision.md)
        return DeterministicReducer(grid, layout, None if zero.shards_grads else layout.zeros(), tcfg.grad_accum, sums)
    floats, kind = plan.bucket_floats(layout.padded), BucketReducer
    if zero.stage == 1 or plan.whole_grad or bf16 and zero.stage == 0:   # the whole gradient, once a step
        if bf16:   # in bfloat16 pieces, summed by their owners (capstone.parallel.bf16sum; ZeRO-0: then allgathered)
            from capstone.parallel.bf16sum import BucketPieces as kind
    elif not zero.shards_optimizer:      # the same buckets, allreduced (capstone.parallel.zero0)
        from capstone.parallel.zero0 import AllreduceReducer as kind
    else:
        from capstone.parallel.progress import Progress
        from capstone.parallel.zero2 import ShardedGradReducer
        return ShardedGradReducer(grid, layout, floats, Progress(), _loss_weight(grid), bf16)
    return kind(grid, layout, layout.zeros(), floats, _loss_weight(grid))


def _deterministic_notes(plan: Plan) -> None:
    """What --deterministic changes of the other flags given, said once at start (rank 0)."""
    if plan.overlap:
        report.say("note: --deterministic exchanges each micro-batch's gradient after its backward pass, in a "
                   "fixed order; the bucketed overlap (--bucket-mb) does not apply.")
    if plan.reshard == "step":   # the fixed-order exchange keeps no whole gradient (capstone.observe.memory)
        kept = "only the gathered parameters stay through the step" if plan.zero.shards_params else "it changes nothing"
        report.say(f"note: --deterministic exchanges each micro-batch's gradient as it is made, so --reshard step "
                   f"keeps no whole gradient through the step: {kept} (docs/composition.md).")


def _seam(grid: Grid, layout: Layout, params, reducer: GradReducer, plan: Plan) -> Weights:
    """Where the model's weights come from and its gradients go: this rank's flat buffers, landing
    in the reducer's (capstone.model.seam), or at ZeRO-3 groups gathered from the shards (kept
    through the step with --reshard step)."""
    if plan.zero.shards_params:
        from capstone.parallel.progress import Progress
        from capstone.parallel.zero3 import Gatherer
        progress = getattr(reducer, "progress", None) or Progress()   # ZeRO-2's thread, else one of its own
        return Gatherer(grid.dp, layout, params, tuple(layout.group_ranges()), progress, reducer.landed, reducer.grads,
                        keep=plan.reshard == "step")
    resident = Resident if plan.precision == "fp32" else precision.Widened
    return resident.over(layout, params, reducer.grads, reducer.landed)


def _replicas(grid: Grid, layout: Layout, seam: Weights, plan: Plan, sums=None) -> Replicas:
    """Invariant (b)'s check: the replicas' fingerprints (ZeRO-3: of the groups each rank gathered); with
    --deterministic the step's param_norm and fingerprint are the canonical vector's (`sums`: parallel.chunksums)."""
    check = ReplicaCheck(grid, layout)
    if plan.zero.shards_params:
        from capstone.parallel.zero3 import ShardedReplicaCheck
        check = ShardedReplicaCheck(grid, layout, seam)
    if sums is None:
        return check
    from capstone.parallel.chunksums import CanonicalCheck
    shard = slice(None) if plan.zero.shards_params else slice(*layout.shard_range(grid.dp.rank))
    return CanonicalCheck(check, sums, shard)


def _loss_weight(grid: Grid) -> float:
    """1 on the ranks whose loss is their replica's (the last pipeline stage's tensor-parallel rank 0)."""
    return 1.0 if grid.tp.rank == 0 and grid.pp.rank == grid.pp.size - 1 else 0.0


def _heldout(grid: Grid, data, plan: Plan, tcfg: TrainConfig, mcfg: ModelConfig, schedule: Schedule) -> HeldOut:
    """The held-out evaluation, through the schedule's forward: rows split over the data-parallel
    group (deterministic: fixed blocks)."""
    T, in_step = mcfg.seq_len, plan.zero.shards_params
    if plan.deterministic:
        from capstone.parallel import deterministic as det
        return det.HeldOutBlocks(data, tcfg.eval_batches, tcfg.eval_batch_size, T, grid.world, grid.dp, schedule.loss,
                                 _loss_weight(grid), in_step=in_step, cp=grid.cp_size)
    kind = HeldOut
    if in_step:   # a forward gathers: a rank without rows still runs one
        from capstone.parallel.zero3 import GatheredHeldOut as kind
    return kind(data, tcfg.eval_batches, tcfg.eval_batch_size, T, grid.world, grid.dp.rank, grid.dp.size,
                schedule.loss, _loss_weight(grid))
