"""One decision, one outcome on every rank: `agreed`.

A check that one rank makes (rank 0 reads a checkpoint's metadata, claims the run directory,
plans the resume) or that every rank makes (each writes its shard, each measures its node's
memory) must end the same way everywhere: the same value, or the same error raised on every rank,
so that no rank goes on into a collective that the others have left. `agreed` is the one place
that carries the value or the error across (as JSON, never pickle).
"""

from collections.abc import Callable, Sequence

Failures = list[tuple[int, str]]   # (rank, error text) of each rank whose action failed


def agreed(comm, action: Callable[[], object], *, errors: Sequence[type[Exception]], every: bool = False,
           explain: Callable[[Failures], Exception] | None = None):
    """Collective: call on every rank of `comm`.

    every=False: rank 0 runs `action()`; every rank returns its value, or raises the error of the
    class in `errors` that it raised (any other exception is a bug and propagates on rank 0 only).
    every=True: every rank runs `action()` and returns its own value, unless it raised one of
    `errors` on some rank: then every rank raises `explain(failures)` (default: the class of the
    first failing rank's error, with the distinct texts one per line).
    """
    if every or comm.rank == 0:
        try:
            outcome = {"value": action()}
        except tuple(errors) as exc:
            outcome = {"error": str(exc), "kind": next(i for i, e in enumerate(errors) if isinstance(exc, e))}
    if not every:
        outcome = comm.bcast_json(outcome if comm.rank == 0 else None)
    everyone = comm.allgather_json(None if "value" in outcome else outcome) if every else [outcome]
    if failed := [(r, o) for r, o in enumerate(everyone) if o and "error" in o]:
        if explain is not None:
            raise explain([(r, o["error"]) for r, o in failed])
        raise errors[failed[0][1]["kind"]]("\n".join(dict.fromkeys(o["error"] for _, o in failed)))
    return outcome["value"]
