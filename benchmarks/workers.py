"""A benchmark's worker launched under mpirun: one short training run, its RESULT line as JSON.

The worker (`python -m benchmarks.NAME worker ...`) trains with the flags given and prints
`RESULT {json}` on rank 0; `launch` runs it on `ranks` ranks, one thread each, in a run directory
of its own that is removed afterwards, and returns that JSON (or exits with the job's output).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a measured run: no evaluation, no checkpoint, the full learning rate from the first step
QUIET_RUN = ("--eval-every", "100000", "--ckpt-every", "0", "--ckpt-every-minutes", "0", "--warmup-steps", "0", "--quiet")


def launch(module: str, ranks: int, flags: list, timeout: float = 3600) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix=f"capstone-{module.rsplit('.', 1)[-1]}-") as out:
        cmd = ["mpirun", "-n", str(ranks), "--oversubscribe", sys.executable, "-m", module, "worker",
               "--out", os.path.join(out, "run"), *QUIET_RUN, *map(str, flags)]
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    if res.returncode != 0 or not lines:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {res.returncode}):\n{res.stdout[-3000:]}{res.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])
