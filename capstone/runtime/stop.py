"""The stop flag: set by a signal (capstone.runtime.signals), read at every step and agreed across ranks."""

_requested: list[str] = []      # the first request's description; empty: none


def request(description: str) -> None:
    """Ask for a stop (the first request's description is kept)."""
    if not _requested:
        _requested.append(description)


def requested() -> bool:
    return bool(_requested)


def reason() -> str | None:
    """What asked for the stop (for the final line), None if nothing did."""
    return _requested[0] if _requested else None
