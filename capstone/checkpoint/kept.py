"""The run's modes a checkpoint keeps: how the run is laid out on its ranks and in memory.

Every checkpoint's metadata holds `modes`, the run's plan's kept modes (capstone.plan.Plan.kept):
the ZeRO stage and its reshard policy, recompute, the guard's undo copy, and the grid's
model-parallel axes (tp, pp, the pipeline's schedule and its blocks per stage). On `--resume` a
mode the command line does not give takes the checkpoint's value and a mode flag given wins, as the
configs' settings do (capstone.cli.Settings.on_top_of); the plan layers them (capstone.plan: a kept
grid axis the ranks cannot hold falls back to 1). `--init-from` starts a new run: it keeps nothing
of these. A checkpoint written before the modes were recorded has none: the flags and their
defaults, as before. Here: how the modes are shown, and what changed on a resume.
"""

from capstone.plan import KEPT

_LABELS = {"pp_layers": "balanced", "pp_schedule": "none"}   # how a mode's None is shown


def shown(name: str, value) -> str:
    return (_LABELS.get(name, "none") if value is None else
            ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value))


def changes(saved: dict | None, plan, why: dict) -> dict:
    """{mode: (the checkpoint's, this run's)} for the changed-settings line; none for an old checkpoint."""
    now = plan.kept()
    return {name: (shown(name, saved[name]), shown(name, now[name]) + (f" ({why[name]})" if name in why else ""))
            for name in KEPT if saved and name in saved and saved[name] != now[name]}
