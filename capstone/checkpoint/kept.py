"""The run's modes a checkpoint keeps: how the run is laid out on its ranks and in memory.

Every checkpoint's metadata holds `modes` (`of`): the ZeRO stage and its reshard policy, recompute,
the guard's undo copy, and the grid's model-parallel axes (tp, pp, the pipeline's schedule and its blocks per stage). On `--resume` a mode
the command line does not give takes the checkpoint's value and a mode flag given wins (`layered`),
as the configs' settings do (capstone.cli.Settings.on_top_of). Not kept: the bucket size and the
overlap (tuning of the gradient exchange's messages: the same run and about the same memory), the
test hooks and where the run writes. `--init-from` starts a new run: it keeps nothing of these.

The checkpoint is canonical (any grid resumes it), so a kept tp or pp that does not fit the ranks of
the resumed launch is not an error: that axis falls back to 1 (tp kept before pp when only one
fits) and the changed-settings line at the start says so and which flag chooses. The memory modes
(ZeRO stage, recompute) do not depend on the world size and are always kept; a kept mode about
another (the schedule, the reshard policy) goes back to its default where that one no longer applies. A checkpoint written
before the modes were recorded has none: the flags and their defaults, as before.
"""

from __future__ import annotations

import dataclasses

from capstone.cli import KEPT

_LABELS = {"pp_layers": "balanced", "pp_schedule": "none"}   # how a mode's None is shown


def of(opts) -> dict:
    """The kept modes of run options `opts`, JSON-able (the checkpoint's `modes`)."""
    return {name: list(v) if isinstance(v, tuple) else v for name in KEPT for v in [getattr(opts, name)]}


def shown(name: str, value) -> str:
    if value is None:
        return _LABELS.get(name, "none")
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def layered(opts, saved: dict | None, given, world: int) -> tuple[object, dict]:
    """(`opts` with the checkpoint's modes `saved` for those not in `given`, {mode: why it is not the
    checkpoint's}). A grid the ranks cannot hold falls back as the module says."""
    if not saved:
        return opts, {}
    take = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in KEPT and k not in given}
    new = dataclasses.replace(opts, **take)
    tp, pp = _fitting(new, given, world)
    why = {name: f"the checkpoint's --{name} {getattr(new, name)} x --{other} {getattr(new, other)} does not divide "
                 f"the {world} rank{'s' if world > 1 else ''}; --{name} K chooses"
           for name, other, now in (("tp", "pp", tp), ("pp", "tp", pp)) if now != getattr(new, name)}
    return _dependent(dataclasses.replace(new, tp=tp, pp=pp), saved, take), why


def _dependent(opts, saved: dict, take: dict):
    """`opts` with each kept mode that is about another one at its default if that one no longer
    applies: the pipeline's schedule and blocks (with the pp they were for), the reshard policy (ZeRO-2/3)."""
    default = {f.name: f.default for f in dataclasses.fields(opts)}
    applies = {"pp_schedule": opts.pp > 1, "pp_layers": opts.pp > 1 and opts.pp == saved.get("pp"),
               "reshard": opts.zero_stage >= 2}
    return dataclasses.replace(opts, **{name: default[name] for name, ok in applies.items() if name in take and not ok})


def _fitting(opts, given, world: int) -> tuple[int, int]:
    """The (tp, pp) of `opts` if tp x pp divides the world, else the first that does with each kept
    axis (not in `given`) at 1: tp kept before pp. If none does, `opts`' (modes.check says why). The
    checkpoint's tp and pp fit its model (the same model resumes it): only the world may not hold them."""
    tps = (opts.tp,) if "tp" in given else (opts.tp, 1)
    pps = (opts.pp,) if "pp" in given else (opts.pp, 1)
    return next(((t, p) for t in tps for p in pps if world % (t * p) == 0), (opts.tp, opts.pp))


def changes(saved: dict | None, opts, why: dict) -> dict:
    """{mode: (the checkpoint's, this run's)} for the changed-settings line; none for an old checkpoint."""
    now = of(opts)
    return {name: (shown(name, saved[name]), shown(name, now[name]) + (f" ({why[name]})" if name in why else ""))
            for name in KEPT if saved and name in saved and saved[name] != now[name]}
