"""JSON as a run writes it: non-finite floats as strings, files replaced atomically."""

import json
import math
import os


def jsonable(value):
    """Floats as JSON can carry them: NaN and infinities become the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def write_json(path: str, data: dict) -> None:
    """Write JSON atomically (temporary file + rename)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(jsonable(data), f, indent=2, sort_keys=True, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)
